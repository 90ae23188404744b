"""The detokenizer actor: token ids -> text deltas, incrementally, never splitting a UTF-8 character, with
stop strings trimmed from the output (and never streamed in part)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runtime.actors import addresses
from runtime.actors.base import Actor
from runtime.mailbox.messages import AbortRequest, Message, TextDelta, TextDeltas, TokenBatch, TrackRequest

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
    def __init__(self, info: ModelInfo, scheduler: str = addresses.scheduler(0)) -> None:
        super().__init__(addresses.DETOKENIZER)
        self.scheduler = scheduler  # where stop-string aborts go
        self.tokenizer = info.load_tokenizer()
        self.states: dict[str, DecodeState] = {}

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
            )
        elif isinstance(msg, TokenBatch):
            await self._on_batch(msg)

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

    async def _on_batch(self, batch: TokenBatch) -> None:
        items: list[TextDelta] = []
        for i, rid in enumerate(batch.rids):
            st = self.states.get(rid)
            if st is None:
                continue  # already finished here (stop string) or never tracked
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
                        await self.send(self.scheduler, AbortRequest(rid, reason="stop"))
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
        if items:
            await self.send(addresses.CLIENT, TextDeltas(items))
