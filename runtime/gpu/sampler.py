"""Batched sampling on the device.

Per-row sampling parameters live in one device table indexed by request row (written once at
registration), so a step reads them with one gather and never syncs per row. The host keeps only what
decides which code paths a step needs (any penalties? any top-k/top-p? who is seeded?) and how many
tokens each row has produced (for min_tokens and seeded draws).

Sampling uses the exponential race (argmax of p / Exp(1) noise), which draws from softmax exactly. A
seeded row draws the noise for its n-th output token from its generator re-seeded with `draw_seed(seed,
n)`, so its noise is a function of (seed, n) alone, not a stream whose position is state: the same tokens
whatever the batch neighbours, and a row re-registered after a retraction (`SeqStart.output_ids`, its
tokens so far) resumes exactly where it was, its penalty counts and min_tokens progress rebuilt from the
same tokens.

Speculative verification samples several positions of one row (`Block`): position j of a row's block is
its (n + j)-th output, with the block's earlier drafts counted among its outputs for penalties, so each
position is drawn exactly as plain decoding would draw it there. Which of those samples the row keeps is
only known on the device afterwards, so a block's draws change no state: `accept` then counts the kept
tokens (penalty counts, on the device) and `advance_later` the host's output counts once they are
known.

Nothing here waits on the device: host-side choices (which paths a step needs) come from host state,
host-to-device copies are non-blocking, and the runner copies the tokens back once per step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from runtime.mailbox.messages import SamplingParams, SeqStart

if TYPE_CHECKING:
    from runtime.gpu.grammar import TokenMask

# Columns of the parameter table.
TEMP, TOP_P, MIN_P, TOP_K, REP, FREQ, PRES = range(7)


@dataclass
class _Row:
    params: SamplingParams
    stop_ids: list[int]
    generator: torch.Generator | None  # seeded rows: re-seeded before every draw (draw_seed)
    n_out: int = 0  # tokens produced (before a retraction too): min_tokens progress, the next draw's index

    @property
    def penalized(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0

    @property
    def truncates(self) -> bool:
        return not self.params.greedy and (self.params.top_k > 0 or self.params.top_p < 1.0)


@dataclass(frozen=True)
class Block:
    """The sampled positions of a step with verify rows, one entry per position (rows' blocks in order):
    `offsets[p]`: how many of the block's tokens precede position p (its draw is the row's
    (n_out + offset)-th); `prior` [P, K]: those preceding drafts (-1 past them), counted as outputs by
    the penalties; `plain`: the rows of one position (no drafts), whose one token is theirs at once."""

    offsets: list[int]
    prior: torch.Tensor
    plain: list[int]


@dataclass
class SampleResult:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] chosen token's logprob, raw logits
    top_ids: torch.Tensor | None = None  # [B, kmax]
    top_logprobs: torch.Tensor | None = None
    top_counts: list[int] | None = None  # per row: how many of the kmax alternatives it asked for


class Sampler:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device | str, seed: int = 0) -> None:
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self.table = torch.zeros(max_rows + 1, 7, device=self.device)
        self.rows: dict[int, _Row] = {}
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.counts: torch.Tensor | None = None  # [rows, V] output-token counts, made on first penalty
        self.prompt_mask: torch.Tensor | None = None  # [rows, V] token occurs in the prompt

    def register(self, start: SeqStart) -> None:
        """A request enters `start.row`; after a retraction, `start.output_ids` restores where it was."""
        p = start.params
        gen = None if p.seed is None else torch.Generator(device=self.device)
        row = _Row(p, list(start.stop_ids), gen, len(start.output_ids))
        self.rows[start.row] = row
        values = [p.temperature, p.top_p, p.min_p, max(p.top_k, 0), p.repetition_penalty]
        values += [p.frequency_penalty, p.presence_penalty]
        self.table[start.row] = torch.tensor(values, dtype=torch.float32).to(self.device, non_blocking=True)
        if row.penalized:
            if self.counts is None:
                shape = (self.table.shape[0], self.vocab_size)
                self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
                self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
            self.counts[start.row].zero_()
            self.prompt_mask[start.row].zero_()
            if start.prompt_ids:
                ids = torch.tensor(start.prompt_ids, dtype=torch.int64).to(self.device, non_blocking=True)
                self.prompt_mask[start.row, ids] = True
            if start.output_ids:
                ids = torch.tensor(start.output_ids, dtype=torch.int64).to(self.device, non_blocking=True)
                ones = torch.ones_like(ids, dtype=torch.int32)
                self.counts[start.row].index_put_((ids,), ones, accumulate=True)

    def release(self, row: int) -> None:
        self.rows.pop(row, None)

    def sample(
        self,
        logits: torch.Tensor,
        rows: list[int],
        rows_t: torch.Tensor,
        mask: TokenMask | None = None,
        block: Block | None = None,
    ) -> SampleResult:
        """logits: [B, V] for `rows` (host list and the same rows as a device tensor), float32 or the
        model's 16-bit dtype: an all-greedy batch without penalties or logprobs takes the argmax as is,
        anything else computes in float32. `mask`: the tokens constrained rows may take (structured
        output, runtime/gpu/grammar.py), applied before anything else, logprobs included. With `block`,
        B counts sampled positions (a row may have several) and nothing is recorded: see `accept` and
        `advance`."""
        if mask is not None:
            logits = mask.apply(logits)
        states = [self.rows[r] for r in rows]
        offsets = block.offsets if block is not None else [0] * len(rows)
        k_asked = [s.params.logprobs for s in states]
        plain_greedy = all(s.params.greedy and not s.penalized for s in states) and all(
            k is None for k in k_asked
        )
        if not plain_greedy:
            logits = logits.float()
        raw_logprobs = None
        if any(k is not None for k in k_asked):
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # float32: logprobs are not plain greedy
        params = self.table[rows_t]
        prior = block.prior if block is not None else None
        logits = self._penalize(logits, params, rows_t, states, offsets, prior)
        if all(s.params.greedy for s in states):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, params, states, offsets)
        if block is None:
            self._count(rows_t, tokens)
            for s in states:
                s.n_out += 1
        else:  # a plain row may be in the next step before this one's counts reach the host
            for row in block.plain:
                self.rows[row].n_out += 1
        result = SampleResult(tokens)
        if raw_logprobs is not None:
            result.logprobs = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
            counts = [k or 0 for k in k_asked]
            kmax = min(max(counts), self.vocab_size)
            if kmax > 0:
                result.top_logprobs, result.top_ids = raw_logprobs.topk(kmax, dim=-1)
            result.top_counts = counts
        return result

    def accept(self, rows_t: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """A verify step's kept tokens: row rows_t[i] emitted tokens[i, :counts[i]] (penalty counts)."""
        if self.counts is None:
            return
        kept = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < counts[:, None]
        rows = rows_t[:, None].expand_as(tokens)
        self.counts.index_put_((rows[kept], tokens[kept]), kept[kept].int(), accumulate=True)

    def advance_later(self, rows: list[int]) -> Callable[[list[int]], None]:
        """For a verify step's verifying rows: the function through which the host learns, once they are
        known, how many tokens each emitted (min_tokens progress, draw index); the step's plain rows
        advanced when they sampled (`Block.plain`). It holds the rows' states as they are now, so a row
        released and given to another request meanwhile does not advance the newcomer. A row may be in
        the next step before then only when its draws do not read this count (not seeded, min_tokens
        reached: the scheduler's `BatchPlanner` checks)."""
        states = [self.rows.get(r) for r in rows]

        def advance(counts: list[int]) -> None:
            for state, n in zip(states, counts, strict=True):
                if state is not None:
                    state.n_out += n

        return advance

    def _count(self, rows_t: torch.Tensor, tokens: torch.Tensor) -> None:
        if self.counts is not None:
            self.counts.index_put_(
                (rows_t, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True
            )

    def _penalize(
        self,
        logits: torch.Tensor,
        params: torch.Tensor,
        rows_t: torch.Tensor,
        states: list[_Row],
        offsets: list[int] | None = None,
        prior: torch.Tensor | None = None,
    ) -> torch.Tensor:
        offsets = offsets or [0] * len(states)
        if self.counts is not None and any(s.penalized for s in states):
            counts = self.counts[rows_t]
            if prior is not None:  # a block's earlier drafts count as outputs at its later positions
                seen = prior >= 0
                counts = counts.index_put(
                    (torch.nonzero(seen)[:, 0], prior[seen]), seen[seen].int(), accumulate=True
                )
            seen = (counts > 0) | self.prompt_mask[rows_t]
            rep = params[:, REP, None]
            # HF repetition penalty: shrink positive logits, push negative ones further down.
            logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
            logits = logits - params[:, FREQ, None] * counts - params[:, PRES, None] * (counts > 0)
        bans = [
            (i, t)
            for i, (s, j) in enumerate(zip(states, offsets, strict=True))
            if s.n_out + j < s.params.min_tokens
            for t in s.stop_ids
        ]
        if bans:
            idx = torch.tensor(bans, dtype=torch.int64).to(logits.device, non_blocking=True)
            banned = logits.index_put((idx[:, 0], idx[:, 1]), logits.new_full((), float("-inf")))
            # a row whose grammar allows only stop tokens (its structured answer is complete) ends: the
            # ban would leave it nothing, and an argmax over nothing picks token 0 outside the grammar
            stuck = banned.amax(-1, keepdim=True) == float("-inf")
            logits = torch.where(stuck, logits, banned)
        return logits

    def _sample(
        self, logits: torch.Tensor, params: torch.Tensor, states: list[_Row], offsets: list[int]
    ) -> torch.Tensor:
        temp, top_k = params[:, TEMP], params[:, TOP_K]
        greedy = (temp <= 0) | (top_k == 1)
        scaled = logits / torch.where(greedy, 1.0, temp)[:, None]
        if any(s.truncates for s in states):
            sampled_rows = [s.params for s in states if not s.params.greedy]
            # When every sampled row has a top_k, a partial top-k replaces the full-vocabulary sort.
            kmax = max(p.top_k for p in sampled_rows) if all(p.top_k > 0 for p in sampled_rows) else None
            scaled = _top_k_top_p(scaled, top_k, params[:, TOP_P], kmax)
        probs = torch.softmax(scaled, dim=-1)
        if any(s.params.min_p > 0 for s in states):
            floor = params[:, MIN_P, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, (s, j) in enumerate(zip(states, offsets, strict=True)):
            if s.generator is not None:
                seed = draw_seed(s.params.seed, s.n_out + j)
                noise[i].exponential_(generator=s.generator.manual_seed(seed))
        sampled = (probs / noise.clamp_min_(1e-20)).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)


_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def draw_seed(seed: int, n: int) -> int:
    """The generator seed for a request's n-th output token (n from 0): `seed` and `n` folded together by
    splitmix64, the way JAX's fold_in derives a key from a key and a counter. Different draws of one
    request, and requests with nearby seeds (the choices of one request use seed + i), get unrelated
    streams."""
    return _splitmix64(_splitmix64(seed & _M64) ^ n)


def _top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, kmax: int | None = None
) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus (top_k 0: off; top_p 1: off).

    `kmax`: a bound on every row's top_k, known on the host; only that many candidates are sorted."""
    vocab = logits.shape[-1]
    if kmax is not None and kmax < vocab:
        sorted_logits, order = logits.topk(kmax, dim=-1)
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
    width = sorted_logits.shape[-1]
    ranks = torch.arange(width, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, width)[:, None]
    remove = ranks >= k
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the mass before it already reaches top_p; the first token always stays.
    remove |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
