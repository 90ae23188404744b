"""The scheduler's record of one request. Derived lengths are properties, never stored twice."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.mailbox.messages import Disagg, SamplingParams, TokenLogprobs
from runtime.speculative.policy import SpecState


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    max_new_tokens: int
    priority: int = 0
    arrival: float = 0.0

    output_ids: list[int] = field(default_factory=list)
    # Resident state (while the request holds a row of the worker's request table):
    row: int = 0  # 0 = not resident
    slots: list[int] = field(default_factory=list)  # KV slot of every token position planned so far
    pages: list[int] = field(default_factory=list)  # pages this request allocated itself (not cache-owned)
    cached_len: int = 0  # prefix tokens reused from the radix cache at the last admission
    replay: int = 0  # tokens before the cached prefix its first chunk recomputes (StepPlan.replay)
    cache_node: object | None = None  # the radix node locked for this request's prefix
    fill_len: int = 0  # tokens that must be in KV before decoding resumes (prompt + outputs at admission)
    planned_outputs: int = 0  # outputs sampled or being sampled (in-flight steps included)
    inflight: int = 0  # planned steps that mention this request and have not come back
    verifying: int = 0  # planned steps verifying its drafts that have not come back: its length is unknown
    spec: SpecState = field(default_factory=SpecState)
    finished: str | None = None
    retractions: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    reported_cached: int = 0  # cached tokens as reported to the client (first admission)
    transfer: Disagg | None = None  # prefill/decode disaggregation (runtime/disaggregation/scheduler.py)

    @property
    def seq_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def kv_len(self) -> int:
        """Token positions whose KV is written or planned to be written."""
        return len(self.slots)

    @property
    def prefilling(self) -> bool:
        return self.kv_len < self.fill_len

    @property
    def can_decode(self) -> bool:
        return not self.finished and not self.prefilling and self.planned_outputs < self.max_new_tokens

    @property
    def remaining_tokens(self) -> int:
        return self.max_new_tokens - len(self.output_ids)
