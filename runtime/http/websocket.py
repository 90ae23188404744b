"""GET /v1/ws: many generations multiplexed on one WebSocket, by client-chosen id.

Schema (JSON text frames; docs/websocket.md has examples):

    client -> server  {"type": "generate", "id": str, "endpoint": "chat" | "completions", "request": {...}}
                      {"type": "abort", "id": str}
    server -> client  {"type": "delta", "id", "index", "text", "token_ids", ["logprobs"],
                       ["reasoning_content"], ["tool_calls"]}     (chat with --reasoning-parser / tools)
                      {"type": "done", "id", "finish_reason", "finish_reasons", "usage"}     exactly one of
                      {"type": "error", "id", "error": {message, type, param, code}}         these per id

`request` is the body of the matching OpenAI endpoint, validated by the same rules (`stream` and
`stream_options` are ignored: the socket always streams). One task per live id; an abort ends that id
with `done`/`finish_reason: "abort"`; closing the socket aborts every live request.
"""

from __future__ import annotations

import asyncio
import functools
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import structlog
from aiohttp import WSMsgType, web

from runtime.errors import ConduitError, InvalidRequest, Overloaded
from runtime.http.chat_output import ChoiceOutput
from runtime.http.engine import Engine
from runtime.http.formatting import chat_logprobs, completion_logprobs
from runtime.http.generation import Choice, run_job, usage
from runtime.http.lifecycle import LIFECYCLE_KEY, Lifecycle
from runtime.http.metrics import Metrics
from runtime.http.options import ServingOptions
from runtime.http.protocol import Job, build_job, decode_body, validation_error
from runtime.http.security import WS_PROTOCOL

log = structlog.get_logger("conduit.http.ws")

MAX_LIVE_PER_SOCKET = 256  # live ids per socket (`--max-requests-per-websocket`)
MAX_MESSAGE_BYTES = 1 << 20  # the app passes its body limit
SEND_TIMEOUT_S = 60.0  # a client that reads nothing for this long is disconnected (its requests aborted)


class WsGenerate(msgspec.Struct, tag="generate", tag_field="type", kw_only=True):
    id: str
    request: msgspec.Raw
    endpoint: Literal["chat", "completions"] = "chat"


class WsAbort(msgspec.Struct, tag="abort", tag_field="type", kw_only=True):
    id: str


_decode_client = msgspec.json.Decoder(WsGenerate | WsAbort).decode
_encode = msgspec.json.Encoder().encode


class WebSocketRoutes:
    def __init__(
        self,
        engine: Engine,
        metrics: Metrics,
        served_model: str,
        options: ServingOptions | None = None,
        *,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        max_live: int = MAX_LIVE_PER_SOCKET,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.served_model = served_model
        self.options = options
        self.max_message_bytes = max_message_bytes
        self.max_live = max_live
        self.lifecycle: Lifecycle | None = None

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/ws", self.handle)

    async def handle(self, request: web.Request) -> web.WebSocketResponse:
        self.lifecycle = request.app.get(LIFECYCLE_KEY)
        if self.lifecycle is not None and self.lifecycle.draining:
            raise self.lifecycle.refuse()
        # A message over the limit gets an error frame naming it and the socket stays open; aiohttp reads
        # at most 4x the limit of one message, and closes the socket (code 1009) on a larger one.
        # the `conduit` subprotocol: browsers offer it beside the API key's (runtime/http/security.py)
        ws = web.WebSocketResponse(max_msg_size=4 * self.max_message_bytes, protocols=(WS_PROTOCOL,))
        await ws.prepare(request)
        session = _Session(self, ws, request.transport)
        if self.lifecycle is not None:
            self.lifecycle.websockets.add(ws)
        log.debug("websocket opened", remote=request.remote)
        try:
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    if len(msg.data) > self.max_message_bytes:
                        await session.send_error(None, self._too_large(len(msg.data)))
                    else:
                        await session.on_message(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    await session.send_error(None, InvalidRequest("Send JSON text frames, not binary."))
        finally:
            if self.lifecycle is not None:
                self.lifecycle.websockets.discard(ws)
            await session.close()
            log.debug("websocket closed")
        return ws

    def _too_large(self, size: int) -> InvalidRequest:
        return InvalidRequest(
            f"The message is {size} characters; the limit is {self.max_message_bytes} bytes.",
            code="message_too_large",
        )


@dataclass
class _Live:
    task: asyncio.Task
    aborted: bool = False  # True: the client asked; the task ends with done/abort instead of vanishing


@dataclass
class _Session:
    routes: WebSocketRoutes
    ws: web.WebSocketResponse
    transport: asyncio.BaseTransport | None = None
    gone: bool = False  # the client cannot be written to any more
    live: dict[str, _Live] = field(default_factory=dict)
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    senders: set[asyncio.Task] = field(default_factory=set)

    async def send(self, obj: dict) -> None:
        async with self.send_lock:
            if self.ws.closed:
                return
            if self.gone:
                return
            try:
                async with asyncio.timeout(SEND_TIMEOUT_S):  # in this task, as openai_routes._write
                    await self.ws.send_str(_encode(obj).decode())
            except TimeoutError:  # a reader that stalls: drop it, which ends the socket's requests
                log.warning("websocket client stopped reading; closing", timeout_s=SEND_TIMEOUT_S)
                self.gone = True
                if self.transport is not None:
                    self.transport.abort()
            except ConnectionError:
                self.gone = True  # the reader loop sees the socket close and aborts every live request

    async def send_error(self, cid: str | None, err: ConduitError) -> None:
        await self.send({"type": "error", "id": cid, "error": err.body()["error"]})

    async def on_message(self, data: str) -> None:
        try:
            msg = _decode_client(data)
        except msgspec.ValidationError as e:
            await self.send_error(_loose_id(data), validation_error(e))
            return
        except msgspec.DecodeError as e:
            await self.send_error(
                None, InvalidRequest(f"The message is not valid JSON: {e}", code="invalid_json")
            )
            return
        if isinstance(msg, WsAbort):
            if (live := self.live.get(msg.id)) is not None and not live.aborted:
                live.aborted = True
                live.task.cancel()
            return  # aborting an unknown or finished id is a no-op: its final message was already sent
        if msg.id in self.live:
            await self.send_error(
                msg.id, InvalidRequest(f"Request id `{msg.id}` is already live.", param="id")
            )
            return
        max_live = self.routes.max_live
        if len(self.live) >= max_live:
            await self.send_error(
                msg.id,
                Overloaded(
                    f"At most {max_live} live requests per socket (--max-requests-per-websocket).",
                    param="id",
                    code="too_many_requests_on_socket",
                ),
            )
            return
        if (lifecycle := self.routes.lifecycle) is not None and lifecycle.draining:
            await self.send_error(msg.id, lifecycle.refuse())
            return
        routes = self.routes
        try:
            body = decode_body(msg.endpoint, bytes(msg.request), path="request")
            job = build_job(
                msg.endpoint,
                body,
                served_model=routes.served_model,
                max_model_len=getattr(routes.engine, "max_model_len", 0) or 0,
                stream=True,
                options=routes.options,
            )
        except ConduitError as err:
            await self.send_error(msg.id, err)
            return
        task = asyncio.create_task(self._run(msg.id, job), name=f"ws-{job.id}")
        task.add_done_callback(functools.partial(self._on_task_done, msg.id, job))
        self.live[msg.id] = _Live(task)

    def _on_task_done(self, cid: str, job: Job, task: asyncio.Task) -> None:
        """A task cancelled before it first ran never reached its own `finally`: finish it here."""
        live = self.live.pop(cid, None)
        if live is not None and live.aborted:
            choices = [Choice(i) for i in range(len(job.requests))]
            sender = asyncio.create_task(self.send(self._done(cid, job, choices)))
            self.senders.add(sender)
            sender.add_done_callback(self.senders.discard)

    async def _run(self, cid: str, job: Job) -> None:
        metrics = self.routes.metrics
        choices = [Choice(i) for i in range(len(job.requests))]
        outputs = [ChoiceOutput(job.output) for _ in choices] if job.output else None
        with (
            structlog.contextvars.bound_contextvars(rid=job.id, ws_id=cid),
            metrics.request(len(job.requests)),
        ):
            try:
                async with aclosing(run_job(self.routes.engine, job)) as events:
                    async for i, delta in events:
                        metrics.on_delta(choices[i], delta)
                        choices[i].update(delta)
                        if delta.text or delta.token_ids or delta.logprobs:
                            frame = self._delta(cid, job, choices[i], delta)
                            if outputs is not None:  # reasoning and tool calls split from the text
                                piece = outputs[i].feed(delta.text, final=delta.finish_reason is not None)
                                frame["text"] = piece.content
                                frame.update({k: v for k, v in piece.delta().items() if k != "content"})
                            await self.send(frame)
                final = self._done(cid, job, choices)
                if outputs is not None:
                    final["finish_reasons"] = [
                        o.finish_reason(r) for o, r in zip(outputs, final["finish_reasons"], strict=True)
                    ]
                    final["finish_reason"] = final["finish_reasons"][0]
            except asyncio.CancelledError:
                if not self.live[cid].aborted:
                    raise  # the socket is closing: nobody to tell
                log.debug("aborted by client")
                final = self._done(cid, job, choices)
            except ConduitError as err:
                metrics.on_error(len(job.requests))
                final = {"type": "error", "id": cid, "error": err.body()["error"]}
            except Exception:
                log.exception("unhandled error in websocket request")
                metrics.on_error(len(job.requests))
                final = {
                    "type": "error",
                    "id": cid,
                    "error": ConduitError("Internal server error").body()["error"],
                }
            finally:
                self.live.pop(cid, None)
            await self.send(final)

    @staticmethod
    def _delta(cid: str, job: Job, choice: Choice, delta) -> dict:
        out = {
            "type": "delta",
            "id": cid,
            "index": choice.index,
            "text": delta.text,
            "token_ids": delta.token_ids,
        }
        if job.logprobs is not None:
            out["logprobs"] = (
                {"content": chat_logprobs(delta)}
                if job.endpoint == "chat"
                else completion_logprobs(delta, choice)
            )
        return out

    @staticmethod
    def _done(cid: str, job: Job, choices: list[Choice]) -> dict:
        reasons = [c.finish_reason or "abort" for c in choices]
        return {
            "type": "done",
            "id": cid,
            "finish_reason": reasons[0],
            "finish_reasons": reasons,
            "usage": usage(choices, job.n),
        }

    async def close(self) -> None:
        """The socket is gone: cancel every live request (closing its stream aborts it in the engine)."""
        tasks = [live.task for live in self.live.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _loose_id(data: str) -> str | None:
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    cid = obj.get("id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) else None
