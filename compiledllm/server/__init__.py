"""The OpenAI-compatible HTTP server (`compiledllm serve`): app.py (routes), worker.py (the engine's thread),
protocol.py (request and response shapes), metrics.py (Prometheus)."""
from compiledllm.server.app import Server, ServerConfig

__all__ = ["Server", "ServerConfig"]
