"""The HTTP frontend: OpenAI-compatible API, SSE, WebSocket, metrics and health (aiohttp)."""

from runtime.http.app import build_app, start_server

__all__ = ["build_app", "start_server"]
