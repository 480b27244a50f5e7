"""From a recipe to a listening server: the model loaded, the engine session captured, the port bound, then
uvicorn until SIGINT / SIGTERM, which stop accepting, let the running requests finish and exit cleanly."""
from __future__ import annotations

import contextlib
import ipaddress
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable

from compiledllm.errors import UserError
from compiledllm.server.app import Server, ServerConfig

log = logging.getLogger("compiledllm.server")
SWITCH_INTERVAL_S = 0.0005


def build_server(recipe, api_key: str | None = None, max_queue: int = 256, timeout_s: float = 600.0,
                 name: str | None = None) -> Server:
    """The recipe's model and engine behind a Server (not listening yet). Each request's KV capacity is the
    recipe's generation.max_seq_len, else the model's context (an exported engine: its fixed capacity)."""
    from compiledllm.engine import Engine, EngineConfig
    from compiledllm.runner import load_from_spec
    from compiledllm.threads import set_threads

    if recipe.parallel.tensor * recipe.parallel.expert * recipe.parallel.data > 1:
        raise UserError("serve: one process serves one engine; remove the recipe's parallel settings")
    set_threads(recipe.threads)
    model = load_from_spec(recipe.model)
    engine = Engine(model, EngineConfig.from_recipe(recipe))
    cfg = engine.config
    capacity = engine.static.capacity if engine.static else (cfg.max_seq_len or model.config.max_position_embeddings)
    slots = engine.slots_for(cfg.batch_size)
    server = Server(engine, ServerConfig(name or recipe.model.name, slots, capacity, api_key, max_queue, timeout_s))
    server.start()
    return server


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a port in use is a one-line error, not a log line after start-up."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UserError(f"--host {host} --port {port}: {e.strerror}") from None
    sock.listen(2048)
    return sock


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve(server: Server, sock: socket.socket, log_level: str = "warning",
          on_ready: Callable[[str], None] | None = None) -> None:
    """Serve until SIGINT / SIGTERM (uvicorn's handlers: stop accepting, drain the running requests, exit)."""
    import uvicorn

    # the engine's thread and the event loop's share the GIL: after the step's host sync the engine thread waits for
    # the GIL up to the switch interval (Python's default 5 ms, a third of a decode step on a GPU)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    config = uvicorn.Config(server.app, log_level=log_level, access_log=log_level == "debug",
                            timeout_graceful_shutdown=server.config.request_timeout_s)
    userver = _uvicorn_class()(config)
    if on_ready is not None:
        on_ready(url)
    userver.run(sockets=[sock])


def _uvicorn_class():
    import uvicorn

    class Uvicorn(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            """SIGINT / SIGTERM start the graceful shutdown; unlike uvicorn's own, the signal is not raised again
            afterwards: a server that drained its requests exits 0."""
            if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
                yield
                return
            old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in old.items():
                    signal.signal(s, handler)

    return Uvicorn
