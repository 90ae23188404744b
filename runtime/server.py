"""`conduit serve`: the engine's actors plus the HTTP app on one port, until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import signal

import structlog
from aiohttp import web

from runtime.config import ServerConfig
from runtime.engine import launch
from runtime.http.options import ServingOptions
from runtime.model_info import ModelInfo

log = structlog.get_logger(__name__)


def serving_options(cfg: ServerConfig, info: ModelInfo) -> ServingOptions:
    """The HTTP layer's choices: sampling defaults, the tool-call and reasoning parsers, access."""
    from runtime.parsers.tool_calls import resolve_name

    options = ServingOptions(
        sampling_defaults=info.sampling_defaults,
        tool_call_parser=resolve_name(cfg.tool_call_parser, info.architecture),
        reasoning_parser=cfg.reasoning_parser,
        api_key=cfg.api_key,
        allowed_origins=tuple(cfg.allowed_origins),
    )
    log.info(
        "serving_options",
        sampling_defaults=info.sampling_defaults.describe(),
        tool_call_parser=options.tool_call_parser,
        reasoning_parser=options.reasoning_parser,
        api_key=options.api_key is not None,
        allowed_origins=list(options.allowed_origins),
    )
    return options


async def serve(cfg: ServerConfig, ready: asyncio.Event | None = None) -> None:
    from runtime.http.app import build_app

    running = await launch(cfg)
    app = build_app(
        running.client, served_model=running.info.name, options=serving_options(cfg, running.info)
    )
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True, shutdown_timeout=5.0)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True)
        await site.start()
        log.info("serving", url=f"http://{cfg.host}:{cfg.port}", model=running.info.name, device=cfg.device)
        if ready is not None:
            ready.set()
        await stop.wait()
        log.info("shutting_down")
    finally:
        await runner.cleanup()
        await running.stop()
