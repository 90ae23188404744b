"""`conduit serve`: the engine's actors plus the HTTP app on one port, until SIGINT/SIGTERM.

Start-up binds the port first, so a busy port fails at once, before the engine loads (`PortInUse`).
A signal during start-up stops the engine being started; after it, a signal drains: the listening
socket closes, requests in flight get `--shutdown-timeout` seconds to finish, the rest end with one final
503 error each, then the engine process is stopped and the socket directory removed. A second signal
skips the wait."""

from __future__ import annotations

import asyncio
import errno
import gc
import signal
import socket

import structlog
from aiohttp import web

from runtime.config import ServerConfig
from runtime.engine import launch
from runtime.http.options import ServingOptions
from runtime.model_info import ModelInfo

log = structlog.get_logger(__name__)


def disaggregation_info(cfg: ServerConfig) -> dict[str, str] | None:
    """What GET /disaggregation tells a gateway: the server's side, its backend, where its KV goes."""
    if cfg.disaggregation_mode is None:
        return None
    return {
        "mode": cfg.disaggregation_mode,
        "backend": cfg.disaggregation_transfer_backend,
        "bootstrap": f"{cfg.host}:{cfg.disaggregation_bootstrap_port}",
    }


def serving_options(cfg: ServerConfig, info: ModelInfo) -> ServingOptions:
    """The HTTP layer's choices: sampling defaults, the tool-call and reasoning parsers, access."""
    from runtime.parsers.tool_calls import resolve_name

    options = ServingOptions(
        sampling_defaults=info.sampling_defaults,
        tool_call_parser=resolve_name(cfg.tool_call_parser, info.architecture),
        reasoning_parser=cfg.reasoning_parser,
        api_key=cfg.api_key,
        allowed_origins=tuple(cfg.allowed_origins),
        disaggregation=disaggregation_info(cfg),
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


class PortInUse(OSError):
    """The address to listen on is taken (or otherwise cannot be bound); the message says which."""


def bind(host: str, port: int) -> socket.socket:
    """The listening address, bound now (not yet listening: connections are refused until the app runs)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        why = "the address is already in use" if e.errno == errno.EADDRINUSE else e.strerror
        raise PortInUse(f"cannot listen on {host}:{port}: {why}") from None
    sock.setblocking(False)
    return sock


async def serve(cfg: ServerConfig, ready: asyncio.Event | None = None) -> None:
    from runtime.http.app import build_app
    from runtime.http.lifecycle import LIFECYCLE_KEY

    sock = bind(cfg.host, cfg.port)
    stop = asyncio.Event()
    signals = 0
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            log.info("shutting_down", drain_timeout_s=cfg.shutdown_timeout)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        starting = asyncio.create_task(launch(cfg), name="launch")
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait([starting, stopped], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # a signal while the engine starts: stop it (launch cleans up)
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            log.info("stopped_during_start_up")
            return
        stopped.cancel()
        running = starting.result()
        gc.freeze()  # start-up's objects (imports, tokenizers) stay: full collections and exit skip them
        await _serve_until_stopped(cfg, sock, running, stop, build_app, LIFECYCLE_KEY, ready)
    finally:
        sock.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _serve_until_stopped(cfg, sock, running, stop, build_app, lifecycle_key, ready) -> None:
    app = build_app(
        running.client,
        served_model=running.info.name,
        max_body_bytes=cfg.resolved_max_body_bytes(running.info.max_model_len),
        max_requests_per_websocket=cfg.max_requests_per_websocket,
        options=serving_options(cfg, running.info),
    )
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True, shutdown_timeout=5.0)
    try:
        await runner.setup()
        site = web.SockSite(runner, sock)
        await site.start()
        log.info("serving", url=f"http://{cfg.host}:{cfg.port}", model=running.info.name, device=cfg.device)
        if ready is not None:
            ready.set()
        await stop.wait()
        await site.stop()  # no new connections
        stop.clear()  # a second signal (set again) cuts the drain short
        await app[lifecycle_key].drain(running.client, cfg.shutdown_timeout, skip=stop)
    finally:
        await runner.cleanup()
        await running.stop()
        log.info("stopped")
