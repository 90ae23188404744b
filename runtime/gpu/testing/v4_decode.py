"""DeepSeek-V4 decode and verify steps in every situation the batched path (models/deepseek_v4/attention_decode.py)
must handle, for comparing it with the request-by-request path (CPU) and CUDA graphs with eager (GPU)."""

from __future__ import annotations

import random

import torch

from runtime.gpu.testing.plans import PagedPlanBuilder, random_prompt, seq_start

PAGE = 8


def v4_decode_scenario(runner) -> list[torch.Tensor]:  # noqa: ANN001 - a ModelRunner
    """Logits of every step (a runner with max_reqs >= 4, pages of 8): rows 1-3 prefilled (2, 14 and 31
    tokens: row 1 closes its first CSA and HCA windows while decoding), 12 decode steps; then row 2
    takes a new request (prefilled beside the others' decodes: a mixed step) and row 4 a prefix hit on
    row 3's first 16 tokens, replaying 8 (its state starts at position 8); then 14 decode steps of all
    four rows. 26 decode steps in all."""
    vocab, pb, out = runner.vocab_size, PagedPlanBuilder(PAGE, runner.kv_pool.num_slots, seed=3), []
    prompts = {row: random_prompt(n, 10 + row, vocab) for row, n in ((1, 2), (2, 14), (3, 31))}
    seqs = {row: list(p) for row, p in prompts.items()}

    def step(plan) -> None:
        logits = runner.forward_logits(plan)
        out.append(logits)
        sampled = [r for r, s in zip(plan.rows, plan.sample, strict=True) if s]
        for row, token in zip(sampled, logits.argmax(-1).tolist(), strict=True):
            seqs[row].append(token)

    def decode(rows: list[int]) -> None:
        step(pb.plan(rows, [len(seqs[r]) - 1 for r in rows], [1] * len(rows), [seqs[r][-1] for r in rows]))

    rows = sorted(prompts)
    ids = [t for r in rows for t in prompts[r]]
    step(
        pb.plan(
            rows,
            [0] * 3,
            [len(prompts[r]) for r in rows],
            ids,
            added=[seq_start(r, prompts[r]) for r in rows],
        )
    )
    for _ in range(12):
        decode(rows)
    # row 2: a new request, prefilled in a step that also decodes rows 1 and 3 (the per-row path)
    new = random_prompt(9, 20, vocab)
    seqs[2] = list(new)
    step(
        pb.plan(
            [1, 2, 3], [len(seqs[1]) - 1, 0, len(seqs[3]) - 1], [1, len(new), 1],
            [seqs[1][-1], *new, seqs[3][-1]], added=[seq_start(2, new)],
        )
    )  # fmt: skip
    # row 4: a hit on row 3's first 16 tokens, replaying 8 (its state starts at position 8)
    hit, replay = 16, 8
    seqs[4] = prompts[3][:hit] + random_prompt(5, 21, vocab)
    slots = pb.share(4, 3, hit)
    step(
        pb.plan(
            [4], [hit - replay], [len(seqs[4]) - hit + replay], seqs[4][hit - replay :],
            added=[seq_start(4, seqs[4], prefix_slots=slots)], replay=[replay],
        )
    )  # fmt: skip
    for _ in range(14):
        decode([1, 2, 3, 4])
    return out


def v4_verify_scenario(runner, q_len: int, ragged: bool = False) -> list[torch.Tensor]:  # noqa: ANN001
    """Logits of every step (a runner speculating with q_len - 1 drafts or more, max_reqs >= 4, pages of
    8): rows 1-3 prefilled (2, 14 and 31 tokens), 8 verify steps, row 2 taking a new request (its old
    state still in the row's slices), 8 more verify steps. A verify step feeds each row its last token
    and q_len - 1 drafts (`ragged`: 0..q_len - 1 drafts a row, one row q_len - 1) through the `fed`
    table, as a drafter would, then keeps a random prefix of each block of 1..k+1 tokens: what the step
    wrote of the rejected positions into the rings and tails is rolled back (`save_blocks` /
    `restore_rejected`, as the runner's acceptance does) and the next step starts after the kept ones.
    Blocks cross the sliding window and close 0, 1 or 2 windows of the compressors (rates 4 and 8)."""
    vocab, pool, device = runner.vocab_size, runner.kv_pool, runner.tables.fed.device
    pb, rng, out = PagedPlanBuilder(PAGE, pool.num_slots, seed=3), random.Random(4), []
    seqs = {row: random_prompt(n, 10 + row, vocab) for row, n in ((1, 2), (2, 14), (3, 31))}
    last: dict[int, int] = {}

    def prefill(rows: list[int]) -> None:
        ids = [t for r in rows for t in seqs[r]]
        lens = [len(seqs[r]) for r in rows]
        added = [seq_start(r, seqs[r]) for r in rows]
        logits = runner.forward_logits(pb.plan(rows, [0] * len(rows), lens, ids, added=added))
        out.append(logits)
        last.update(zip(rows, logits.argmax(-1).tolist(), strict=True))

    def verify(rows: list[int]) -> None:
        ks = [rng.randrange(q_len) for _ in rows] if ragged else [q_len - 1] * len(rows)
        ks[rng.randrange(len(rows))] = q_len - 1
        blocks = [[last[r]] + [rng.randrange(vocab) for _ in range(k)] for r, k in zip(rows, ks, strict=True)]
        for r, block in zip(rows, blocks, strict=True):
            runner.tables.fed[r, : len(block)] = torch.tensor(block, device=device)
        prefix = [len(seqs[r]) for r in rows]
        rows_t, first = (torch.tensor(c, device=device) for c in (rows, prefix))
        saved = pool.save_blocks(rows_t, first, q_len)
        plan = pb.plan(rows, prefix, [k + 1 for k in ks], [], use_last=[True] * len(rows), draft_lens=ks)
        logits = runner.forward_logits(plan)
        out.append(logits)
        kept = [rng.randrange(1, k + 2) for k in ks]
        pool.restore_rejected(saved, torch.tensor(kept, device=device))
        start = 0
        for r, block, n in zip(rows, blocks, kept, strict=True):
            seqs[r] += block[:n]
            last[r] = int(logits[start + n - 1].argmax())
            start += len(block)

    prefill([1, 2, 3])
    for _ in range(8):
        verify([1, 2, 3])
    seqs[2] = random_prompt(9, 20, vocab)
    prefill([2])
    for _ in range(8):
        verify([1, 2, 3])
    return out
