"""One request function per protocol. Each sends one Prompt, times it, and returns a RequestResult;
failures are recorded in the result (never raised) so a failing server still gives a report."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import msgspec

from loadgen.records import Prompt, RequestResult
from loadgen.ws import WSPool

BACKENDS = ("chat", "completions", "ws")


@dataclass
class RequestConfig:
    base_url: str
    model: str
    ignore_eos: bool = True
    temperature: float = 0.0
    ws_endpoint: str = "chat"  # which OpenAI endpoint the ws backend's requests imitate
    request_timeout: float = 600.0
    ws: WSPool | None = None  # the ws backend's shared sockets


class StreamError(Exception):
    """A failure while reading an answer; the message goes into RequestResult.error."""


class _Timer:
    """Collects content-chunk arrival times for one request."""

    def __init__(self, res: RequestResult, t0: float):
        self.res, self.t0 = res, t0
        self.start = time.perf_counter()
        self.last = 0.0
        res.start_s = self.start - t0

    def content(self, text: str) -> None:
        if not text:
            return
        now = time.perf_counter()
        if self.res.output_chunks == 0:
            self.res.ttft_s = now - self.start
        else:
            self.res.itl_s.append(now - self.last)
        self.last = now
        self.res.output_chunks += 1
        self.res.text += text

    def usage(self, usage: dict | None) -> None:
        if usage:
            self.res.prompt_tokens = usage.get("prompt_tokens")
            self.res.completion_tokens = usage.get("completion_tokens")

    def finish(self) -> None:
        now = time.perf_counter()
        self.res.e2e_s = now - self.start
        self.res.end_s = now - self.t0
        if self.res.output_chunks == 0:
            self.res.ttft_s = self.res.e2e_s


def openai_body(endpoint: str, cfg: RequestConfig, p: Prompt) -> dict:
    body: dict = {"model": cfg.model, "max_tokens": p.output_len, "temperature": cfg.temperature}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": p.prompt}]
    else:
        body["prompt"] = p.prompt
    return body


async def _sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """The JSON objects of an SSE stream, up to `data: [DONE]`."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        try:
            yield msgspec.json.decode(data)
        except msgspec.DecodeError:
            raise StreamError(f"bad JSON in stream: {data[:80].decode(errors='replace')!r}") from None


def _chunk_text(endpoint: str, event: dict) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if endpoint == "chat":
        delta = c.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return c.get("text") or ""


def connect_error(url: str, e: aiohttp.ClientConnectorError) -> str:
    reason = "connection refused" if isinstance(e.os_error, ConnectionRefusedError) else str(e.os_error)
    return f"cannot connect to {url}: {reason}"


async def error_message(resp: aiohttp.ClientResponse) -> str:
    """`HTTP 500: <message>` from an OpenAI error body, or the start of whatever the body was."""
    body = (await resp.read()).decode(errors="replace")
    try:
        d = msgspec.json.decode(body)
        err = d.get("error", d) if isinstance(d, dict) else d
        msg = err.get("message") or err.get("detail") or body if isinstance(err, dict) else str(err)
    except msgspec.DecodeError:
        msg = body
    return f"HTTP {resp.status}: {' '.join(str(msg).split())[:200]}"


async def _openai_request(
    endpoint: str,
    session: aiohttp.ClientSession,
    cfg: RequestConfig,
    p: Prompt,
    res: RequestResult,
    t0: float,
) -> None:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    body = openai_body(endpoint, cfg, p) | {"stream": True, "stream_options": {"include_usage": True}}
    timer = _Timer(res, t0)
    try:
        async with session.post(cfg.base_url + path, json=body, allow_redirects=False) as resp:
            res.status = resp.status
            if resp.status != 200:
                raise StreamError(await error_message(resp))
            async for event in _sse_events(resp):
                if "error" in event:
                    raise StreamError(f"error in stream: {event['error']}")
                timer.content(_chunk_text(endpoint, event))
                timer.usage(event.get("usage"))
        res.success = True
    finally:
        timer.finish()


async def chat_request(session, cfg, p, res, t0) -> None:
    await _openai_request("chat", session, cfg, p, res, t0)


async def completions_request(session, cfg, p, res, t0) -> None:
    await _openai_request("completions", session, cfg, p, res, t0)


async def ws_request(
    session: aiohttp.ClientSession, cfg: RequestConfig, p: Prompt, res: RequestResult, t0: float
) -> None:
    """Conduit's WebSocket protocol (loadgen/ws.py): one `generate` message, `delta`s, then `done`."""
    rid = f"loadgen-{res.index}"
    msg = {
        "type": "generate",
        "id": rid,
        "endpoint": cfg.ws_endpoint,
        "request": openai_body(cfg.ws_endpoint, cfg, p),
    }
    if cfg.ws is None:
        cfg.ws = WSPool(session, cfg.base_url, 1, cfg.request_timeout)
    timer = _Timer(res, t0)
    try:
        async for d in cfg.ws.stream(rid, msg):
            res.status = 101
            kind = d.get("type")
            if kind == "delta":
                timer.content(d.get("text") or "")
            elif kind == "done":
                timer.usage(d.get("usage"))
                res.success = True
            elif kind == "error":
                raise StreamError(f"websocket error: {d.get('message') or d.get('error') or d}")
    finally:
        timer.finish()


REQUEST_FNS: dict[str, Callable[..., Awaitable[None]]] = {
    "chat": chat_request,
    "completions": completions_request,
    "ws": ws_request,
}


async def send(
    backend: str, session: aiohttp.ClientSession, cfg: RequestConfig, p: Prompt, index: int, t0: float
) -> RequestResult:
    """Send one prompt; any failure becomes `success=False` with a one-line `error`."""
    res = RequestResult(index=index, input_len=p.input_len, output_len_requested=p.output_len)
    try:
        await REQUEST_FNS[backend](session, cfg, p, res, t0)
    except StreamError as e:
        res.error = str(e)
    except aiohttp.ClientConnectorError as e:
        res.error = connect_error(cfg.base_url, e)
    except aiohttp.WSServerHandshakeError as e:
        res.status = e.status
        res.error = f"websocket handshake failed: HTTP {e.status} {e.message}"
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as e:
        res.error = f"server closed the connection mid-answer ({type(e).__name__})"
    except TimeoutError:
        res.error = "timed out"
    except aiohttp.ClientError as e:
        res.error = f"{type(e).__name__}: {e}"
    res.success = res.success and not res.error
    return res
