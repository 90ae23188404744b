"""Prefill/decode disaggregation through the gateway (`--pd-disaggregation --prefill URL ... --decode
URL ...`), SGLang's flow: each request goes to one prefill and one decode server at once, with a fresh
`bootstrap_room`. The decode server reserves KV pages for the room and streams the answer; the prefill
server computes the prompt and sends its KV and first token to the decode server's transfer address
(`bootstrap_addr`, from the decode server's GET /disaggregation), then answers (non-streaming, one
token), and that answer is only read for errors.

Failures: a prefill answer that is an error, or a prefill server that goes away, ends the request with
that error (an SSE error event once the stream began) and closes the decode request, which frees its
reserved pages; a decode server that goes away ends the stream as a lost worker does. Either server is
marked unhealthy at once on a broken connection, so new requests go to the others. No retries: the
two servers of a request are bound to each other by the transfer."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass

import aiohttp
import structlog
from aiohttp import web

from runtime.errors import BadGateway, InvalidRequest
from runtime.http.formatting import DONE, sse
from runtime.http.gateway.request_text import request_text
from runtime.http.gateway.router import Router
from runtime.http.gateway.upstream import REQUEST_HEADERS, RESPONSE_HEADERS, Lost, copy_headers, sse_events
from runtime.http.gateway.workers import Worker

log = structlog.get_logger("conduit.gateway")


class _PrefillFailed(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(body.decode(errors="replace")[:500])
        self.status, self.body = status, body


@dataclass
class _State:
    resp: web.StreamResponse | None = None  # the client's stream, once its first event went out


def _error_message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:500]


class PDProxy:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.bootstrap: dict[str, str] = {}  # decode url -> its KV transfer address

    async def _bootstrap_of(self, decode: Worker) -> str:
        addr = self.bootstrap.get(decode.url)
        if addr is not None:
            return addr
        session = self.router.session
        assert session is not None
        try:
            async with session.get(f"{decode.url}/disaggregation", timeout=aiohttp.ClientTimeout(10)) as r:
                info = await r.json() if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            self.router.failed(decode, "connect", str(e))
            raise BadGateway(
                f"The decode server {decode.url} did not answer: {e}", code="worker_unreachable"
            ) from None
        if not info or info.get("mode") != "decode":
            raise BadGateway(f"{decode.url} is not a decode server (--disaggregation-mode decode)")
        self.bootstrap[decode.url] = info["bootstrap"]
        return info["bootstrap"]

    async def forward(self, request: web.Request, endpoint: str, body: bytes) -> web.StreamResponse:
        router = self.router
        try:
            payload = json.loads(body)
            assert isinstance(payload, dict)
        except (ValueError, AssertionError):
            raise InvalidRequest("The body is not a JSON object.") from None
        text = request_text(endpoint, body) if router.policy.needs_text else ""
        prefill = router.pick(text)
        decode = router.pick_decode()
        addr = await self._bootstrap_of(decode)
        room = random.getrandbits(63)
        to_prefill = {**payload, "bootstrap_room": room, "bootstrap_addr": addr, "stream": False}
        to_prefill.pop("stream_options", None)
        to_decode = {**payload, "bootstrap_room": room}
        headers = copy_headers(request.headers, REQUEST_HEADERS)
        log.debug("pd_pair", prefill=prefill.url, decode=decode.url, room=room)
        state = _State()
        prefill_task = asyncio.create_task(self._prefill(prefill, request.path_qs, to_prefill, headers))
        decode_task = asyncio.create_task(self._decode(request, decode, to_decode, headers, state))
        try:
            await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
            if decode_task.done() or prefill_task.exception() is None:
                return await decode_task
            decode_task.cancel()  # closes the decode request: the decode server frees its reservation
            await asyncio.gather(decode_task, return_exceptions=True)
            return await self._prefill_failed(request, prefill_task.exception(), state)
        finally:
            for t in (prefill_task, decode_task):
                t.cancel()
            await asyncio.gather(prefill_task, decode_task, return_exceptions=True)

    async def _prefill(self, worker: Worker, path: str, body: dict, headers: dict[str, str]) -> None:
        router = self.router
        assert router.session is not None
        worker.load += 1
        try:
            async with router.session.post(
                worker.url + path, json=body, headers=headers, timeout=router.request_timeout
            ) as r:
                data = await r.read()
                if r.status != 200:
                    raise _PrefillFailed(r.status, data)
        except (aiohttp.ClientError, ConnectionError) as e:
            router.failed(worker, "midstream", f"{type(e).__name__}: {e}")
            err = BadGateway(
                f"The prefill server {worker.url} failed: {type(e).__name__}: {e}", code="worker_failed"
            )
            raise _PrefillFailed(502, json.dumps(err.body()).encode()) from None
        finally:
            worker.load -= 1

    async def _prefill_failed(
        self, request: web.Request, exc: BaseException | None, state: _State
    ) -> web.StreamResponse:
        assert isinstance(exc, _PrefillFailed), exc
        log.warning("prefill failed", status=exc.status, error=str(exc))
        if state.resp is None:
            return web.Response(status=exc.status, body=exc.body, content_type="application/json")
        err = BadGateway(f"Prefill failed: {_error_message(exc.body)}", code="worker_failed")
        try:
            await state.resp.write(sse(err.body()) + DONE)
            await state.resp.write_eof()
        except ConnectionResetError:
            pass
        return state.resp

    async def _decode(
        self, request: web.Request, worker: Worker, body: dict, headers: dict[str, str], state: _State
    ) -> web.StreamResponse:
        router = self.router
        assert router.session is not None
        worker.load += 1
        try:
            try:
                upstream = await router.session.post(
                    worker.url + request.path_qs, json=body, headers=headers, timeout=router.request_timeout
                )
            except aiohttp.ClientConnectionError as e:
                router.failed(worker, "connect", str(e))
                self.bootstrap.pop(worker.url, None)
                raise BadGateway(
                    f"The decode server {worker.url} is unreachable: {e}", code="worker_unreachable"
                ) from None
            async with upstream:
                if not (upstream.status == 200 and upstream.content_type == "text/event-stream"):
                    data = await upstream.read()
                    return web.Response(
                        status=upstream.status,
                        body=data,
                        headers=copy_headers(upstream.headers, RESPONSE_HEADERS),
                    )
                try:
                    async for chunk in sse_events(upstream):
                        if state.resp is None:
                            state.resp = web.StreamResponse(
                                headers=copy_headers(upstream.headers, RESPONSE_HEADERS)
                            )
                            await state.resp.prepare(request)
                        await state.resp.write(chunk)
                except Lost as e:
                    router.failed(worker, "midstream", str(e))
                    self.bootstrap.pop(worker.url, None)
                    err = BadGateway(f"The decode server failed mid-stream: {e}", code="worker_failed")
                    if state.resp is None:
                        raise err from None
                    await state.resp.write(sse(err.body()) + DONE)
                assert state.resp is not None
                await state.resp.write_eof()
                return state.resp
        except (aiohttp.ClientError, ConnectionError) as e:
            if isinstance(e, ConnectionResetError) and state.resp is not None:
                return state.resp  # the client went away
            router.failed(worker, "midstream", str(e))
            raise BadGateway(f"The decode server failed: {e}", code="worker_failed") from None
        finally:
            worker.load -= 1
