"""The engine's thread: the one owner of the EngineSession (and of the GPU), stepped while it has work.

Handlers never touch the session. They `submit` a request with a sink (a callable the worker hands every event of
that request to, in the worker's thread) and `cancel` it; the worker applies both between steps, so a request joins a
free slot at the next step and a cancelled one frees its slot at the next step. A failure is contained where it
happens: a request the session refuses gets its exception alone; a step that raises fails the requests then decoding
(their clients get a 500) and the worker starts a fresh session for the rest.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

from compiledllm.engine.request import Event, FinishEvent, RequestParams
from compiledllm.server.metrics import Metrics
from compiledllm.server.protocol import RequestError

log = logging.getLogger("compiledllm.server")

Sink = Callable[[Event | BaseException], None]


class EngineWorker:
    def __init__(self, engine, slots: int, capacity: int, max_queue: int, metrics: Metrics):
        """engine: the Engine to serve; `slots` requests decode at once, each with `capacity` KV positions;
        `max_queue` requests may wait for a slot (more are refused: 429)."""
        self.engine, self.slots, self.capacity, self.max_queue = engine, slots, capacity, max_queue
        self.metrics = metrics
        self.session = None
        self._lock = threading.Lock()
        self._inbox: list[tuple] = []
        self._adds = 0                      # adds in the inbox (waiting, like the session's queue)
        self._sinks: dict[int, Sink] = {}
        self._wake = threading.Event()
        self._ready = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._main, name="compiledllm-engine", daemon=True)

    # --- handlers' side (any thread) --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the thread; returns once its session is allocated and captured (its error re-raised here)."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def new_id(self) -> int:
        return next(self._ids)

    def prepare(self, request_id: int, prompt: list[int], params: RequestParams) -> None:
        """The session's checks of a request (UserError), without touching its state."""
        self.session.prepare(request_id, prompt, params)

    def submit(self, request_id: int, prompt: list[int], params: RequestParams, sink: Sink) -> None:
        with self._lock:
            if self._stopping or self._error is not None:
                raise RequestError(503, "the server is shutting down", kind="server_error")
            if self.waiting >= self.max_queue:
                raise RequestError(429, f"{self.waiting} requests are waiting for a slot (the queue holds "
                                   f"{self.max_queue}); retry later", kind="rate_limit_error",
                                   headers={"Retry-After": "1"})
            self._inbox.append(("add", request_id, prompt, params, sink))
            self._adds += 1
        self._wake.set()

    def cancel(self, request_id: int) -> None:
        with self._lock:
            self._inbox.append(("cancel", request_id))
        self._wake.set()

    @property
    def waiting(self) -> int:
        """Requests accepted and not yet in a slot."""
        return self._adds + (self.session.queued if self.session is not None else 0)

    @property
    def alive(self) -> bool:
        """The engine's thread is serving (False once it stopped, or died of an error)."""
        return self._thread.is_alive() and self._error is None

    @property
    def running(self) -> int:
        return self.session.running if self.session is not None else 0

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the requests in the session end (the server drained its handlers before calling this)."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    # --- the worker's thread --------------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.session = self.engine.session(self.slots, self.capacity)
        except BaseException as e:  # noqa: BLE001 - handed to start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                self._apply_inbox()
                if not self.session.has_work():
                    if self._stopping:
                        return
                    self._wake.wait(1.0)
                    self._wake.clear()
                    continue
                self._step()
        except BaseException as e:  # noqa: BLE001 - nothing may kill the thread silently
            log.exception("the engine worker stopped")
            self._error = e
            self._fail_all(e)
        finally:
            self.session.close()

    def _apply_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for item in inbox:
            if item[0] == "cancel":
                self.session.cancel(item[1])
                continue
            _, rid, prompt, params, sink = item
            try:
                self.session.add(rid, prompt, params)
                self._sinks[rid] = sink
            except Exception as e:  # noqa: BLE001 - that request's failure, not the server's
                self._deliver(rid, sink, e)
            finally:
                with self._lock:
                    self._adds -= 1

    def _step(self) -> None:
        t = time.perf_counter()
        try:
            events = self.session.step()
        except Exception as e:  # noqa: BLE001 - the requests decoding fail; the server goes on
            log.exception("an engine step failed; its requests fail, a fresh session serves the rest")
            self._fail_all(e)
            self.session.close()
            self.session = self.engine.session(self.slots, self.capacity)
            return
        self.metrics.step(time.perf_counter() - t)
        for ev in events:
            sink = self._sinks.get(ev.request_id)
            if isinstance(ev, FinishEvent):
                self._sinks.pop(ev.request_id, None)
                self.metrics.finished(ev.result)
            if sink is not None:
                self._deliver(ev.request_id, sink, ev)

    def _deliver(self, rid: int, sink: Sink, item: Event | BaseException) -> None:
        try:
            sink(item)
        except Exception:  # noqa: BLE001 - e.g. its event loop is gone: nobody waits for it any more
            log.warning("request %d: its handler is gone; cancelled", rid)
            if self._sinks.pop(rid, None) is not None:
                self.session.cancel(rid)

    def _fail_all(self, e: BaseException) -> None:
        sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            self._deliver(rid, sink, e)
