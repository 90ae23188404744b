"""Where every failure becomes an HTTP answer: `ConduitError` -> its status and OpenAI error body
(Overloaded adds Retry-After), aiohttp's 404/405/413 -> OpenAI-style bodies, anything else -> a
logged 500. Also counts requests by route and status for /metrics."""

from __future__ import annotations

import math
import re

import structlog
from aiohttp import web

from runtime.errors import ConduitError, Overloaded
from runtime.http.metrics import Metrics

log = structlog.get_logger("conduit.http")

METRICS_KEY: web.AppKey[Metrics] = web.AppKey("metrics", Metrics)


def error_response(err: ConduitError) -> web.Response:
    headers = {}
    if isinstance(err, Overloaded):
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after)))
    return web.json_response(err.body(), status=err.status, headers=headers)


def _too_large(exc: web.HTTPException) -> str:
    """aiohttp's 413 says "Maximum request body size N exceeded, actual body size M"."""
    m = re.search(r"size (\d+) exceeded", exc.text or "")
    limit = f" of {m[1]} bytes" if m else ""
    return f"The request body is over the server's limit{limit} (--max-body-bytes)."


def _http_error(exc: web.HTTPException, request: web.Request) -> web.Response:
    types = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}
    messages = {
        404: f"Not found: {request.method} {request.path}",
        405: f"Method {request.method} is not allowed on {request.path}",
        413: _too_large(exc),
    }
    body = {
        "error": {
            "message": messages.get(exc.status, exc.reason),
            "type": types.get(exc.status, "invalid_request_error" if exc.status < 500 else "server_error"),
            "param": None,
            "code": exc.reason.lower().replace(" ", "_"),
        }
    }
    headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
    return web.json_response(body, status=exc.status, headers=headers)


@web.middleware
async def errors_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        resp = await handler(request)
    except ConduitError as err:
        if err.status >= 500:
            log.error("request failed", path=request.path, status=err.status, error=err.message)
        resp = error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        resp = _http_error(exc, request)
    except ConnectionResetError:
        log.info("client disconnected", path=request.path)
        raise
    except Exception:
        log.exception("unhandled error", path=request.path)
        resp = error_response(ConduitError("Internal server error"))
    _count(request, resp.status)
    return resp


def _count(request: web.Request, status: int) -> None:
    metrics = request.app.get(METRICS_KEY)
    if metrics is None:
        return
    route = request.match_info.route.resource
    name = route.canonical if route is not None else "unmatched"
    metrics.http_requests.labels(name, str(status)).inc()
