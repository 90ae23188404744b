"""The page at `/`: a chat playground over `/v1/ws` and a live view of `/metrics`. Plain HTML, JS and
CSS files shipped in the package (runtime/http/static/), served as they are: no build step."""

from __future__ import annotations

from importlib import resources

from aiohttp import web

STATIC = resources.files("runtime.http") / "static"
TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}


def _file(name: str) -> web.Response:
    suffix = "." + name.rsplit(".", 1)[-1] if "." in name else ""
    if "/" in name or name.startswith(".") or suffix not in TYPES:
        raise web.HTTPNotFound()
    res = STATIC / name
    if not res.is_file():
        raise web.HTTPNotFound()
    return web.Response(
        body=res.read_bytes(),
        content_type=TYPES[suffix],
        charset="utf-8",
        headers={"Cache-Control": "no-cache"},
    )


async def index(request: web.Request) -> web.Response:
    return _file("index.html")


async def static(request: web.Request) -> web.Response:
    return _file(request.match_info["name"])


def add_page_routes(app: web.Application) -> None:
    app.router.add_get("/", index)
    app.router.add_get("/static/{name}", static)
