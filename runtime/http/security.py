"""Who may call the server: the API key (`--api-key`) and browsers of other origins (CORS,
`--allowed-origins`).

API key: every route but `/health` and the page's own files (`/`, `/static/...`, which hold no data
and ask for the key themselves) needs `Authorization: Bearer KEY`, compared in constant time (both
sides hashed first, so not even the length leaks); otherwise 401 with an OpenAI error body
(`invalid_api_key`) and `WWW-Authenticate: Bearer`. Browsers cannot set headers on a WebSocket, so
`/v1/ws` also takes the key as a subprotocol, `conduit.key.<base64url(KEY)>`, offered beside
`conduit`, which the server selects.

CORS: a preflight (`OPTIONS` with `Access-Control-Request-Method`) from an allowed origin is answered
204 with the allowed methods and headers; from any other origin 403, without CORS headers. Responses to
allowed origins carry `Access-Control-Allow-Origin`. A WebSocket opened by a page of another origin
that is not allowed is refused (403): browsers do not apply CORS to WebSockets, so without this any
site could drive a local server through its visitors' browsers.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from urllib.parse import urlsplit

from aiohttp import hdrs, web

from runtime.errors import ConduitError, Unauthorized

PUBLIC_PATHS = ("/health", "/", "/favicon.ico")
PUBLIC_PREFIXES = ("/static/",)
WS_PROTOCOL = "conduit"
WS_KEY_PREFIX = "conduit.key."
ALLOW_METHODS = "GET, POST, OPTIONS"
ALLOW_HEADERS = "Authorization, Content-Type"
MAX_AGE_S = "600"


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()


def _presented_keys(request: web.Request) -> list[str]:
    keys = []
    auth = request.headers.get(hdrs.AUTHORIZATION, "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token:
        keys.append(token.strip())
    for proto in request.headers.get(hdrs.SEC_WEBSOCKET_PROTOCOL, "").split(","):
        proto = proto.strip()
        if proto.startswith(WS_KEY_PREFIX):
            encoded = proto[len(WS_KEY_PREFIX) :]
            try:
                keys.append(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode())
            except (binascii.Error, UnicodeDecodeError):
                continue
    return keys


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def auth_middleware(api_key: str):
    want = _digest(api_key)

    @web.middleware
    async def check_key(request: web.Request, handler) -> web.StreamResponse:
        if is_public(request.path) or _is_preflight(request):
            return await handler(request)
        # every presented key is compared, each in constant time
        ok = False
        for key in _presented_keys(request):
            ok |= hmac.compare_digest(_digest(key), want)
        if not ok:
            err = Unauthorized(
                "Invalid or missing API key: send `Authorization: Bearer <key>`.", code="invalid_api_key"
            )
            return web.json_response(err.body(), status=401, headers={hdrs.WWW_AUTHENTICATE: "Bearer"})
        return await handler(request)

    return check_key


def _is_preflight(request: web.Request) -> bool:
    return request.method == hdrs.METH_OPTIONS and hdrs.ACCESS_CONTROL_REQUEST_METHOD in request.headers


class Cors:
    """CORS for `origins` ("*": any origin)."""

    def __init__(self, origins: tuple[str, ...]) -> None:
        self.any = "*" in origins
        self.origins = frozenset(o.rstrip("/") for o in origins if o != "*")

    def allows(self, origin: str | None) -> bool:
        return origin is not None and (self.any or origin.rstrip("/") in self.origins)

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        origin = request.headers.get(hdrs.ORIGIN)
        if _is_preflight(request):
            if not self.allows(origin):
                return _forbidden(f"Origin {origin} is not allowed (see --allowed-origins).")
            asked = request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_HEADERS)
            return web.Response(
                status=204,
                headers={
                    hdrs.ACCESS_CONTROL_ALLOW_ORIGIN: origin,
                    hdrs.ACCESS_CONTROL_ALLOW_METHODS: ALLOW_METHODS,
                    hdrs.ACCESS_CONTROL_ALLOW_HEADERS: asked or ALLOW_HEADERS,
                    hdrs.ACCESS_CONTROL_MAX_AGE: MAX_AGE_S,
                    hdrs.VARY: "Origin",
                },
            )
        if (
            origin is not None
            and request.headers.get(hdrs.UPGRADE, "").lower() == "websocket"
            and urlsplit(origin).netloc != request.host  # the server's own page may always connect
            and not self.allows(origin)
        ):
            return _forbidden(f"WebSocket from origin {origin} refused (see --allowed-origins).")
        return await handler(request)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """Adds the CORS headers to every answer to an allowed origin (streams included: this runs
        before the headers are sent)."""
        origin = request.headers.get(hdrs.ORIGIN)
        if self.allows(origin) and hdrs.ACCESS_CONTROL_ALLOW_ORIGIN not in response.headers:
            response.headers[hdrs.ACCESS_CONTROL_ALLOW_ORIGIN] = origin
            response.headers[hdrs.ACCESS_CONTROL_EXPOSE_HEADERS] = "X-Request-Id"
            response.headers.add(hdrs.VARY, "Origin")


def _forbidden(message: str) -> web.Response:
    err = ConduitError(message, code="origin_not_allowed")
    body = err.body()
    body["error"]["type"] = "permission_error"
    return web.json_response(body, status=403)
