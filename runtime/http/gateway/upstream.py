"""What the gateway's proxies (plain and prefill/decode) share about a worker's answer: the headers that
pass through, and reading its SSE stream event by event with a clear error when it breaks off."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import aiohttp

from runtime.http.formatting import DONE

REQUEST_HEADERS = ("Content-Type", "Authorization", "Accept", "X-Request-Id")
RESPONSE_HEADERS = ("Content-Type", "Cache-Control", "X-Request-Id", "Retry-After")


class Lost(Exception):
    """The worker's answer broke off (`timed_out`: it ran past --request-timeout-secs)."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def copy_headers(headers, names) -> dict[str, str]:
    return {k: headers[k] for k in names if k in headers}


async def sse_events(upstream: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The worker's SSE bytes, each read cut after its last complete event; raises `Lost` if the
    stream breaks off or ends without `data: [DONE]`."""
    pending = b""
    done = False
    started = time.monotonic()
    try:
        async for chunk in upstream.content.iter_any():
            data = pending + chunk if pending else chunk
            cut = data.rfind(b"\n\n") + 2
            if cut < 2:
                pending = data
                continue
            out, pending = data[:cut], data[cut:]
            done = out.endswith(DONE)
            yield out
    except TimeoutError:
        raise Lost(f"timed out after {time.monotonic() - started:.1f}s", timed_out=True) from None
    except aiohttp.ClientError as e:
        raise Lost(f"{type(e).__name__}: {e} after {time.monotonic() - started:.1f}s") from None
    if not done:
        raise Lost("the stream ended without `data: [DONE]`")
