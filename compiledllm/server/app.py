"""`compiledllm serve`: the OpenAI-compatible HTTP API (FastAPI) over one EngineWorker.

Every request is parsed (protocol.py), its prompts encoded (in a thread: a long prompt or a chat template does not
hold up the event loop) and checked by the session's own checks before it is queued, so what the engine would refuse
is a 400 at once. Its engine requests (one per prompt) then report their events through a Job: blocks become
server-sent chunks as they finish (text never splits a character, and never shows text a stop string later cuts),
the finish gives the choice. A client that goes away, or a request past its timeout, cancels its engine requests:
their slots are free at the next step.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from compiledllm.engine.request import BlockEvent, FinishEvent, GenerationResult, RequestParams
from compiledllm.errors import UserError
from compiledllm.server.metrics import Metrics
from compiledllm.server.protocol import (FINISH, MAX_BODY_BYTES, ChatRequest, CompletionRequest, RequestError,
                                         new_id, now, parse, usage, user_error)
from compiledllm.server.worker import EngineWorker
from compiledllm.stream import TextStream

log = logging.getLogger("compiledllm.server")


@dataclass(frozen=True)
class ServerConfig:
    name: str                        # the model name clients give (GET /v1/models lists it)
    slots: int                       # requests decoding at once (the recipe's batch_size)
    capacity: int                    # KV positions per request: prompt + max_tokens, rounded up to a block
    api_key: str | None = None       # every request must carry "Authorization: Bearer KEY"
    max_queue: int = 256             # requests waiting for a slot; past it, 429
    request_timeout_s: float = 600.0  # a request still decoding after this is cancelled (408)


class Job:
    """One HTTP request's engine requests and their events, handed over from the worker's thread."""

    def __init__(self, worker: EngineWorker, loop: asyncio.AbstractEventLoop, n: int):
        self.worker, self.loop = worker, loop
        self.rids = [worker.new_id() for _ in range(n)]
        self.index = {rid: i for i, rid in enumerate(self.rids)}
        self.open: set[int] = set()
        self.queue: asyncio.Queue = asyncio.Queue()

    def submit(self, prompts: list[list[int]], params: list[RequestParams]) -> None:
        try:
            for rid, p, rp in zip(self.rids, prompts, params):
                self.worker.submit(rid, p, rp, self._sink(rid))
                self.open.add(rid)
        except RequestError:
            self.cancel()
            raise

    def _sink(self, rid: int):
        put = self.queue.put_nowait
        return lambda item: self.loop.call_soon_threadsafe(put, (rid, item))

    async def events(self, deadline: float, gone: asyncio.Future | None = None) -> AsyncIterator[tuple[int, object]]:
        """(choice index, BlockEvent | FinishEvent) until every engine request ended; RequestError 408 past the
        deadline; the client's disconnect (`gone`) ends it quietly."""
        while self.open:
            get = asyncio.ensure_future(self.queue.get())
            wait = {get} | ({gone} if gone is not None else set())
            done, _ = await asyncio.wait(wait, timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                if gone is not None and gone in done:
                    return
                raise RequestError(408, "the request ran past the server's request timeout; cancelled",
                                   kind="timeout_error")
            rid, item = get.result()
            if isinstance(item, BaseException):
                self.open.discard(rid)
                if isinstance(item, UserError):
                    raise user_error(item)
                raise RuntimeError(f"the engine failed: {type(item).__name__}: {item}") from item
            if isinstance(item, FinishEvent):
                self.open.discard(rid)
            yield self.index[rid], item

    def cancel(self) -> None:
        for rid in self.open:
            self.worker.cancel(rid)
        self.open.clear()


class Server:
    def __init__(self, engine, config: ServerConfig):
        self.engine, self.config = engine, config
        self.tokenizer = engine.model.tokenizer
        self.sampling = engine.policy.sampling
        self.worker = EngineWorker(engine, config.slots, config.capacity, config.max_queue,
                                   Metrics(lambda: self.worker.waiting, lambda: self.worker.running,
                                           engine.model.device))
        self.metrics = self.worker.metrics
        self.created = now()
        self.app = self._app()

    def start(self) -> None:
        """Allocate and capture the engine session (its errors, e.g. memory, raised here, before serving)."""
        self.worker.start()

    # --- requests -> engine requests ----------------------------------------------------------------------------
    def _params(self, req, max_tokens: int | None) -> list[RequestParams]:
        s = self.sampling
        if req.model is not None and req.model != self.config.name:
            raise RequestError(404, f"model {req.model!r} is not served here (this server serves "
                               f"{self.config.name!r})", "model", kind="not_found_error")
        if req.temperature is not None and req.temperature != s.temperature:
            raise RequestError(400, f"temperature: this server decodes at temperature {s.temperature:g} (the "
                               "recipe's policy.temperature); per-request sampling is not supported", "temperature")
        if req.top_p is not None and req.top_p != (s.top_p or 1.0):
            raise RequestError(400, f"top_p: this server decodes with top_p {s.top_p or 1.0:g} (the recipe's "
                               "policy.top_p); per-request sampling is not supported", "top_p")
        try:
            return RequestParams(max_tokens, req.seed, req.stops(), req.policy, None if req.seed is None else 0)
        except UserError as e:
            raise user_error(e) from None

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise RequestError(400, "prompt: text, but this model has no tokenizer; give token ids", "prompt")
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise RequestError(400, "prompt: encodes to no tokens", "prompt")
        return ids

    def _chat_prompt(self, req: ChatRequest) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(400, "messages: this model has no tokenizer (and so no chat template)", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, True)
        except UserError as e:
            raise RequestError(400, f"messages: {e}", "messages") from None
        return self._encode(text)

    async def _start(self, prompts: list[list[int]], params: RequestParams) -> Job:
        job = Job(self.worker, asyncio.get_running_loop(), len(prompts))
        # with a seed, choice i is keyed as prompt i of a run: the same request reproduces it, whatever its ids
        each = [params if params.noise_index is None else replace(params, noise_index=i)
                for i in range(len(prompts))]
        for rid, p, rp in zip(job.rids, prompts, each):
            try:
                self.worker.prepare(rid, p, rp)
            except UserError as e:
                raise user_error(e, "prompt") from None
        job.submit(prompts, each)
        return job

    # --- responses ----------------------------------------------------------------------------------------------
    async def completion(self, request: Request, chat: bool) -> Response:
        req = parse(await _body(request), ChatRequest if chat else CompletionRequest)
        params = self._params(req, req.length() if chat else req.max_tokens)
        if chat:
            prompts = [await anyio.to_thread.run_sync(self._chat_prompt, req)]
        else:
            prompts = [await anyio.to_thread.run_sync(self._encode, p) for p in req.prompts()]
        job = await self._start(prompts, params)
        deadline = time.monotonic() + self.config.request_timeout_s
        rid, kind = new_id("chatcmpl" if chat else "cmpl"), "chat.completion" if chat else "text_completion"
        if req.stream:
            include = req.stream_options is not None and req.stream_options.include_usage
            hold = max(map(len, params.stop), default=1) - 1
            return StreamingResponse(self._chunks(job, deadline, rid, kind, chat, include, hold),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        gone = asyncio.ensure_future(_disconnect(request))
        results: dict[int, GenerationResult] = {}
        try:
            async for i, ev in job.events(deadline, gone):
                if isinstance(ev, FinishEvent):
                    results[i] = ev.result
        finally:
            gone.cancel()
            job.cancel()
        if len(results) < len(prompts):  # the client went away: nobody reads this
            return Response(status_code=499)
        choices = [self._choice(i, results[i], chat) for i in range(len(prompts))]
        return JSONResponse({"id": rid, "object": kind, "created": now(), "model": self.config.name,
                             "choices": choices, "usage": _usage(results.values())})

    def _choice(self, i: int, r: GenerationResult, chat: bool) -> dict:
        text = r.text if r.text is not None else ""
        out = {"index": i, "finish_reason": FINISH[r.finish_reason], "logprobs": None, "token_ids": r.output_ids}
        return out | ({"message": {"role": "assistant", "content": text}} if chat else {"text": text})

    async def _chunks(self, job: Job, deadline: float, rid: str, kind: str, chat: bool, include_usage: bool,
                      hold: int) -> AsyncIterator[str]:
        kind += ".chunk" if chat else ""
        head = {"id": rid, "object": kind, "created": now(), "model": self.config.name}
        streams = {i: TextStream(self.tokenizer, hold) for i in range(len(job.rids))}

        def chunk(i: int, text: str, tokens: list[int], reason: str | None) -> str:
            body = {"delta": {"content": text}} if chat else {"text": text}
            choice = {"index": i, **body, "finish_reason": reason, "logprobs": None, "token_ids": tokens}
            return _sse(head | {"choices": [choice]})

        results, sent = [], dict.fromkeys(streams, 0)  # sent: tokens each choice's chunks carried
        try:
            if chat:
                for i in streams:
                    yield _sse(head | {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                    "finish_reason": None, "logprobs": None}]})
            async for i, ev in job.events(deadline):
                s = streams[i]
                if isinstance(ev, BlockEvent):
                    text = s.push(ev.tokens) if self.tokenizer is not None else ""
                    sent[i] += len(ev.tokens)
                    yield chunk(i, text, ev.tokens, None)
                else:
                    r = ev.result
                    results.append(r)
                    rest = s.finish(r.text or "") if self.tokenizer is not None else ""
                    yield chunk(i, rest, r.output_ids[sent[i]:], FINISH[r.finish_reason])
            if include_usage:
                yield _sse(head | {"choices": [], "usage": _usage(results)})
        except RequestError as e:
            yield _sse(e.body())
        except Exception as e:  # noqa: BLE001 - the headers are sent: the error goes in the stream
            log.exception("request %s failed", rid)
            yield _sse(RequestError(500, str(e), kind="server_error").body())
        finally:
            job.cancel()
        yield "data: [DONE]\n\n"

    # --- the app ------------------------------------------------------------------------------------------------
    def _app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_app):
            yield
            await anyio.to_thread.run_sync(self.worker.stop)  # handlers have drained: the session is idle

        app = FastAPI(title="compiledllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        if self.config.api_key is not None:
            app.add_middleware(KeyCheck, key=self.config.api_key)

        @app.exception_handler(HTTPException)
        async def http_error(_request, e: HTTPException):
            return _error(RequestError(e.status_code, str(e.detail), kind="invalid_request_error"))

        @app.exception_handler(Exception)
        async def internal(_request, e: Exception):
            log.exception("unhandled error")
            return _error(RequestError(500, f"{type(e).__name__}: {e}", kind="server_error"))

        def endpoint(path: str, chat: bool):
            async def handle(request: Request) -> Response:
                try:
                    response = await self.completion(request, chat)
                except RequestError as e:
                    response = _error(e)
                except Exception as e:  # noqa: BLE001 - this request fails, the server goes on
                    log.exception("request to %s failed", path)
                    response = _error(RequestError(500, f"{type(e).__name__}: {e}", kind="server_error"))
                self.metrics.response(path, response.status_code)
                return response
            app.post(path)(handle)

        endpoint("/v1/completions", chat=False)
        endpoint("/v1/chat/completions", chat=True)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.config.name, "object": "model", "created": self.created,
                                                "owned_by": "compiledllm", "max_model_len": self.config.capacity}]}

        @app.get("/health")
        async def health():
            ok = self.worker.alive
            return JSONResponse({"status": "ok" if ok else "failed", "running": self.worker.running,
                                 "waiting": self.worker.waiting}, 200 if ok else 503)

        @app.get("/metrics")
        async def metrics():
            return Response(self.metrics.text(), media_type="text/plain; version=0.0.4")

        return app


class KeyCheck:
    """ASGI middleware: every HTTP request carries "Authorization: Bearer KEY" or gets a 401 (compared in constant
    time; the receive channel is untouched, so disconnects still reach the handlers)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.key):
                e = RequestError(401, "a valid API key is required (Authorization: Bearer KEY)",
                                 kind="authentication_error", headers={"WWW-Authenticate": "Bearer"})
                await _error(e)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _body(request: Request) -> bytes:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise RequestError(413, f"the request body is {size} bytes; at most {MAX_BODY_BYTES}")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise RequestError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    return bytes(body)


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body is read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _error(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), e.status, headers=e.headers)


def _usage(results) -> dict:
    results = list(results)
    return usage(sum(len(r.prompt_ids) for r in results), sum(len(r.output_ids) for r in results),
                 sum(r.steps for r in results), sum(r.blocks for r in results))
