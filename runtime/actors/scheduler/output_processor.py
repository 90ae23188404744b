"""Collects one step's new tokens into a columnar TokenBatch for the detokenizer."""

from __future__ import annotations

from runtime.actors.scheduler.request import Req
from runtime.mailbox.messages import StepOutput, TokenBatch, TokenLogprobs


class OutputProcessor:
    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.rids: list[str] = []
        self.tokens: list[list[int]] = []
        self.finished: list[str | None] = []
        self.prompt_tokens: list[int] = []
        self.completion_tokens: list[int] = []
        self.cached_tokens: list[int] = []
        self.logprobs: list[list[TokenLogprobs] | None] = []

    @staticmethod
    def logprob_of(out: StepOutput, i: int, req: Req) -> TokenLogprobs | None:
        if req.params.logprobs is None or out.logprobs is None:
            return None
        return TokenLogprobs(
            out.tokens[i],
            out.logprobs[i],
            out.top_ids[i] if out.top_ids else [],
            out.top_logprobs[i] if out.top_logprobs else [],
        )

    def add(
        self, req: Req, tokens: list[int], finished: str | None, lps: list[TokenLogprobs] | None = None
    ) -> None:
        """The request's new tokens of this step (several after a verify step), with their logprobs."""
        self.rids.append(req.rid)
        self.tokens.append(tokens)
        self.finished.append(finished)
        self.prompt_tokens.append(len(req.prompt_ids))
        self.completion_tokens.append(len(req.output_ids))
        self.cached_tokens.append(req.reported_cached)
        self.logprobs.append(lps[: len(tokens)] if lps and tokens else None)

    def take(self) -> TokenBatch | None:
        if not self.rids:
            return None
        batch = TokenBatch(
            self.rids,
            self.tokens,
            self.finished,
            self.prompt_tokens,
            self.completion_tokens,
            self.cached_tokens,
            self.logprobs,
        )
        self._reset()
        return batch
