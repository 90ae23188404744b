"""The aiohttp application: OpenAI routes, WebSocket, health, metrics, cache control, the page at `/`;
API keys and CORS (runtime/http/security.py) when configured.

app = build_app(engine_client, served_model="SmolLM2-135M-Instruct", options=ServingOptions(...))
runner = await start_server(app, "0.0.0.0", 8000)    # ... await runner.cleanup()
"""

from __future__ import annotations

import structlog
from aiohttp import web

from runtime.errors import InvalidRequest, NotFound
from runtime.http import openapi
from runtime.http.engine import Engine
from runtime.http.lifecycle import LIFECYCLE_KEY, Lifecycle, drain_middleware
from runtime.http.metrics import CONTENT_TYPE, Metrics
from runtime.http.middleware import METRICS_KEY, errors_middleware
from runtime.http.openai_routes import OpenAIRoutes
from runtime.http.options import ServingOptions
from runtime.http.page import add_page_routes
from runtime.http.security import Cors, auth_middleware
from runtime.http.websocket import MAX_LIVE_PER_SOCKET, WebSocketRoutes

log = structlog.get_logger("conduit.http")

# the default of tests and embedders; `conduit serve` passes one that fits its context length
# (ServerConfig.resolved_max_body_bytes)
MAX_BODY_BYTES = 1 << 20


def build_app(
    client: Engine,
    *,
    served_model: str,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_requests_per_websocket: int = MAX_LIVE_PER_SOCKET,
    options: ServingOptions | None = None,
) -> web.Application:
    """Request bodies over `max_body_bytes` get 413 (naming the limit) before they are read whole; a
    WebSocket message may be as large as a body, and carry `max_requests_per_websocket` live ids."""
    options = options or ServingOptions()
    cors = Cors(options.allowed_origins)
    # preflights are answered before the key check; a draining server refuses before any work
    middlewares = [errors_middleware, cors.middleware, drain_middleware]
    if options.api_key:
        middlewares.append(auth_middleware(options.api_key))
    app = web.Application(middlewares=middlewares, client_max_size=max_body_bytes)
    app.on_response_prepare.append(cors.on_prepare)
    metrics = Metrics(client)
    app[METRICS_KEY] = metrics
    app[LIFECYCLE_KEY] = lifecycle = Lifecycle(metrics)
    OpenAIRoutes(client, metrics, served_model, options).add_to(app)
    WebSocketRoutes(
        client, metrics, served_model, options,
        max_message_bytes=max_body_bytes, max_live=max_requests_per_websocket,
    ).add_to(app)  # fmt: skip
    add_page_routes(app)
    document = openapi.document(served_model)

    async def health(request: web.Request) -> web.Response:
        if lifecycle.draining:
            body = {"status": "shutting_down", "error": lifecycle.refuse().body()["error"]}
            return web.json_response(body, status=503, headers={"Retry-After": "5"})
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

    async def openapi_json(request: web.Request) -> web.Response:
        return web.json_response(document)

    async def disaggregation(request: web.Request) -> web.Response:
        """This server's side of prefill/decode disaggregation, for `conduit gateway --pd-disaggregation`."""
        if options.disaggregation is None:
            raise NotFound("This server does not run in --disaggregation-mode.")
        return web.json_response(options.disaggregation)

    app.router.add_get("/health", health)
    app.router.add_get("/disaggregation", disaggregation)
    app.router.add_get("/openapi.json", openapi_json)
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
