"""The gateway's aiohttp application: the proxied OpenAI routes and WebSocket, the worker list
(GET/POST/DELETE /workers), its own /health and /metrics; and `serve_gateway`, the process's main.

    app = build_gateway_app(GatewayConfig(worker_urls=("http://127.0.0.1:30001",)))
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import structlog
from aiohttp import web

from runtime.errors import InvalidRequest, NotFound
from runtime.http.app import MAX_BODY_BYTES
from runtime.http.gateway.config import GatewayConfig
from runtime.http.gateway.metrics import CONTENT_TYPE
from runtime.http.gateway.proxy import HttpProxy
from runtime.http.gateway.router import Router
from runtime.http.gateway.ws_proxy import WebSocketProxy
from runtime.http.middleware import errors_middleware

log = structlog.get_logger("conduit.gateway")

ROUTER_KEY: web.AppKey[Router] = web.AppKey("router", Router)


class _WorkerBody(msgspec.Struct):
    url: str


def _worker_url(body: bytes) -> str:
    try:
        return msgspec.json.decode(body, type=_WorkerBody).url
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise InvalidRequest(f'Send a JSON body {{"url": "http://host:port"}}: {e}', param="url") from None


def build_gateway_app(cfg: GatewayConfig) -> web.Application:
    router = Router(cfg)
    app = web.Application(middlewares=[errors_middleware], client_max_size=MAX_BODY_BYTES)
    app[ROUTER_KEY] = router
    HttpProxy(router).add_to(app)
    WebSocketProxy(router).add_to(app)

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.health_check_timeout_secs)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            router.session = session
            checks = []
            for pool in router.pools():
                pool.session = session
                checks.append(asyncio.create_task(pool.run_checks(), name="health-checks"))
            yield
            for c in checks:
                c.cancel()
            await asyncio.gather(*checks, return_exceptions=True)

    app.cleanup_ctx.append(lifetime)

    async def health(request: web.Request) -> web.Response:
        n = router.healthy_count()
        if n:
            return web.json_response({"status": "ok", "healthy_workers": n})
        body = {
            "status": "unhealthy",
            "error": {
                "message": "No healthy worker behind the gateway.",
                "type": "server_error",
                "param": None,
                "code": "no_healthy_worker",
            },
        }
        return web.json_response(body, status=503)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=router.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def list_workers(request: web.Request) -> web.Response:
        workers = [w.record() for w in router.pool]
        if router.decode_pool is not None:  # --pd-disaggregation: each record says its role
            workers = [{**w, "role": "prefill"} for w in workers]
            workers += [{**w.record(), "role": "decode"} for w in router.decode_pool]
        return web.json_response({"policy": router.policy.name, "workers": workers})

    async def add_worker(request: web.Request) -> web.Response:
        url = _worker_url(await request.read())
        try:
            worker = router.pool.add(url)
        except ValueError as e:
            raise InvalidRequest(str(e), param="url") from None
        await router.pool.check(worker)  # traffic at once if it answers; else once its checks pass
        return web.json_response(worker.record())

    async def remove_worker(request: web.Request) -> web.Response:
        url = _worker_url(await request.read())
        try:
            worker = router.pool.remove(url)
        except ValueError as e:
            raise InvalidRequest(str(e), param="url") from None
        if worker is None:
            raise NotFound(f"No worker {url} in the pool.", param="url")
        return web.json_response(worker.record())

    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/workers", list_workers)
    app.router.add_post("/workers", add_worker)
    app.router.add_delete("/workers", remove_worker)
    return app


async def serve_gateway(cfg: GatewayConfig) -> None:
    """Serve until SIGINT/SIGTERM."""
    app = build_gateway_app(cfg)
    # handler_cancellation: a client that goes away cancels its handler, which drops the worker's
    # connection, and the worker aborts the request
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True, access_log=None)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True).start()
        log.info(
            "gateway serving",
            url=f"http://{cfg.host}:{cfg.port}",
            policy=cfg.policy,
            workers=list(cfg.worker_urls),
        )
        await stop.wait()
        log.info("shutting_down")
    finally:
        await runner.cleanup()
