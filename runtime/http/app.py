"""The aiohttp application: OpenAI routes, WebSocket, health, metrics, cache control, the page at `/`;
API keys and CORS (runtime/http/security.py) when configured.

app = build_app(engine_client, served_model="SmolLM2-135M-Instruct", options=ServingOptions(...))
runner = await start_server(app, "0.0.0.0", 8000)    # ... await runner.cleanup()
"""

from __future__ import annotations

import structlog
from aiohttp import web

from runtime.errors import InvalidRequest
from runtime.http.engine import Engine
from runtime.http.metrics import CONTENT_TYPE, Metrics
from runtime.http.middleware import METRICS_KEY, errors_middleware
from runtime.http.openai_routes import OpenAIRoutes
from runtime.http.options import ServingOptions
from runtime.http.page import add_page_routes
from runtime.http.security import Cors, auth_middleware
from runtime.http.websocket import WebSocketRoutes

log = structlog.get_logger("conduit.http")

MAX_BODY_BYTES = 64 << 20  # long prompts as token ids run to megabytes; aiohttp's default is 1 MiB


def build_app(
    client: Engine,
    *,
    served_model: str,
    max_body_bytes: int = MAX_BODY_BYTES,
    options: ServingOptions | None = None,
) -> web.Application:
    options = options or ServingOptions()
    cors = Cors(options.allowed_origins)
    middlewares = [errors_middleware, cors.middleware]  # preflights are answered before the key check
    if options.api_key:
        middlewares.append(auth_middleware(options.api_key))
    app = web.Application(middlewares=middlewares, client_max_size=max_body_bytes)
    app.on_response_prepare.append(cors.on_prepare)
    metrics = Metrics(client)
    app[METRICS_KEY] = metrics
    OpenAIRoutes(client, metrics, served_model, options).add_to(app)
    WebSocketRoutes(client, metrics, served_model, options).add_to(app)
    add_page_routes(app)

    async def health(request: web.Request) -> web.Response:
        if client.healthy:
            return web.json_response({"status": "ok"})
        error = client.stats.error if client.stats is not None else None
        body = {
            "status": "unhealthy",
            "error": {
                "message": error or "engine unhealthy",
                "type": "server_error",
                "param": None,
                "code": "engine_unhealthy",
            },
        }
        return web.json_response(body, status=503)

    async def render_metrics(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def flush_cache(request: web.Request) -> web.Response:
        # SGLang's contract: refused (400) while requests run or wait; answered once the flush is done
        if not await client.flush_cache():
            raise InvalidRequest(
                "The prefix cache was not flushed: requests are running or waiting. Retry when idle.",
                code="cache_busy",
            )
        log.info("prefix cache flushed")
        return web.json_response({"status": "ok"})

    app.router.add_get("/health", health)
    app.router.add_get("/metrics", render_metrics)
    app.router.add_post("/flush_cache", flush_cache)
    return app


async def start_server(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Serve `app` until `runner.cleanup()`. Handlers are cancelled when their client disconnects
    (aiohttp does not by default), so abandoned requests are aborted at once."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("http server listening", host=host, port=port)
    return runner
