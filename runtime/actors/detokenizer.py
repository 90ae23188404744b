"""The detokenizer actor: token ids -> text deltas, incrementally, never splitting a UTF-8 character, with
stop strings trimmed from the output (and never streamed in part).

Each step's TokenBatch is decoded by one call on the actor's own thread, off the event loop. If decoding
fails the actor crashes: every request it tracks ends with an error and is aborted in the scheduler (so
its KV is freed), and a fresh instance takes over. When the engine dies, its requests are forgotten."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runtime import envs
from runtime.actors import addresses
from runtime.actors.base import Actor
from runtime.mailbox.messages import (
    AbortRequest,
    Message,
    NodeFailed,
    TextDelta,
    TextDeltas,
    TokenBatch,
    TrackRequest,
)

if TYPE_CHECKING:
    from runtime.model_info import ModelInfo


@dataclass
class DecodeState:
    stop: list[str]
    skip_special_tokens: bool
    logprobs: int | None
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0  # ids[prefix_offset:read_offset] decode to text already accounted for
    read_offset: int = 0
    text: str = ""  # all decoded output text so far
    sent: int = 0  # characters of `text` already sent
    doomed: bool = False  # fault injection: decoding this request crashes the actor


def held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of `text` that could be the start of a stop string."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


class DetokenizerActor(Actor):
    restart_on_crash = True

    def __init__(self, info: ModelInfo, scheduler: str = addresses.scheduler(0)) -> None:
        super().__init__(addresses.DETOKENIZER)
        self.info = info
        self.scheduler = scheduler  # where stop-string aborts go
        self.tokenizer = info.load_tokenizer()
        self.states: dict[str, DecodeState] = {}
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="detokenize")
        self._fault = envs.injected_fault("detokenizer")

    def fresh(self) -> DetokenizerActor:
        return DetokenizerActor(self.info, self.scheduler)

    async def on_stop(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def on_crash(self, msg: Message, exc: BaseException) -> None:
        rids = list(self.states)
        self.states.clear()
        await self.fail(rids, f"the detokenizer failed: {exc}")
        for rid in rids:  # free their KV: the scheduler would otherwise run them to the end
            await self.send(self.scheduler, AbortRequest(rid))

    async def handle(self, msg: Message) -> None:
        if isinstance(msg, TrackRequest):
            # the prompt's tail seeds the window (already "read"), so only output text is ever emitted
            tail = list(msg.prompt_tail)
            self.states[msg.rid] = DecodeState(
                list(msg.stop),
                msg.skip_special_tokens,
                msg.logprobs,
                tail,
                prefix_offset=0,
                read_offset=len(tail),
                doomed=bool(self._fault and self._fault in self.tokenizer.decode(tail)),
            )
        elif isinstance(msg, TokenBatch):
            loop = asyncio.get_running_loop()
            items, stops = await loop.run_in_executor(self._thread, self._decode_batch, msg)
            for rid in stops:
                await self.send(self.scheduler, AbortRequest(rid, reason="stop"))
            if items:
                await self.send(addresses.CLIENT, TextDeltas(items))
        elif isinstance(msg, NodeFailed):
            self.states.clear()  # the engine died: the client failed every request it ran

    def _decode_new(self, st: DecodeState) -> str:
        """vLLM-style incremental decoding: decode a short window and emit only what it adds, holding back
        while the window ends in an incomplete UTF-8 sequence (decoded as U+FFFD)."""
        skip = st.skip_special_tokens
        prefix = self.tokenizer.decode(st.ids[st.prefix_offset : st.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(st.ids[st.prefix_offset :], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            st.prefix_offset = st.read_offset
            st.read_offset = len(st.ids)
            return full[len(prefix) :]
        return ""

    def _decode_batch(self, batch: TokenBatch) -> tuple[list[TextDelta], list[str]]:
        """The batch's deltas, and the requests a stop string ended (to abort in the scheduler)."""
        items: list[TextDelta] = []
        stops: list[str] = []
        for i, rid in enumerate(batch.rids):
            st = self.states.get(rid)
            if st is None:
                continue  # already finished here (stop string) or never tracked
            if st.doomed:
                raise RuntimeError("injected detokenizer fault")
            finish = batch.finished[i]
            st.ids.extend(batch.tokens[i])
            start = len(st.text)
            st.text += self._decode_new(st)
            if finish is not None and st.read_offset < len(st.ids):
                # flush whatever the window still holds (e.g. a dangling partial character)
                rest = self.tokenizer.decode(
                    st.ids[st.prefix_offset :], skip_special_tokens=st.skip_special_tokens
                )
                prev = self.tokenizer.decode(
                    st.ids[st.prefix_offset : st.read_offset], skip_special_tokens=st.skip_special_tokens
                )
                st.text += rest[len(prev) :]
            end = len(st.text)
            if st.stop:
                search_from = max(0, start - max(len(s) for s in st.stop))
                hits = [p for p in (st.text.find(s, search_from) for s in st.stop) if p >= 0]
                if hits and finish != "abort":
                    end = min(hits)
                    st.text = st.text[:end]
                    if finish is None:
                        stops.append(rid)
                    finish = "stop"
                elif finish is None:
                    end -= held_back(st.text, st.stop)
            lps = batch.logprobs[i] if st.logprobs is not None else None
            tokens_text = [self.tokenizer.decode([lp.token_id]) for lp in lps] if lps else None
            top_text = [[self.tokenizer.decode([t]) for t in lp.top_ids] for lp in lps] if lps else None
            delta = st.text[st.sent : end]
            st.sent = max(st.sent, end)
            if delta or finish is not None or batch.tokens[i]:
                items.append(
                    TextDelta(
                        rid,
                        delta,
                        list(batch.tokens[i]),
                        finish,
                        batch.prompt_tokens[i],
                        batch.completion_tokens[i],
                        batch.cached_tokens[i],
                        lps,
                        tokens_text,
                        top_text,
                    )
                )
            if finish is not None:
                del self.states[rid]
        return items, stops
