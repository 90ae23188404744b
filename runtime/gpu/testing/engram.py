"""Engram test support: a decode scenario that sends the scheduler's addresses with every plan (so the
host-hashing path runs as under a server), and a word-level tokenizer for tiny checkpoints (the
compression table needs a tokenizer; the GPU machine has none)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch

from runtime.gpu.testing.plans import plan_builder, seq_start

if TYPE_CHECKING:
    from runtime.gpu.model_runner import ModelRunner


def engram_scenario(
    runner: ModelRunner, vocab: int, seed: int = 0
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefills, decode steps whose batch shrinks and grows (padded graph buckets) mixing fed-back and
    explicit tokens, a mixed prefill + decode step, more decodes; every plan carries the addresses the
    scheduler would send (fed-back rows: the partial hash the worker completes). Returns every step's
    sampled logits (float32, on the host) and tokens."""
    g = torch.Generator().manual_seed(seed)
    hasher = runner.engram.hasher
    seqs = {r: torch.randint(3, vocab, (n,), generator=g).tolist() for r, n in ((1, 5), (2, 9), (3, 13))}
    kv = dict.fromkeys(seqs, 0)  # tokens in KV per row
    pb = plan_builder(runner)
    logits: list[torch.Tensor] = []
    sample = runner.sampler.sample
    runner.sampler.sample = lambda lg, *a, **k: (
        logits.append(lg.to("cpu", torch.float32, copy=True)) or sample(lg, *a, **k)
    )
    tokens = []

    def step(rows: list[int], use_last: list[bool], added=()) -> None:  # noqa: ANN001
        ext, ids, addr = [], [], []
        for r, last in zip(rows, use_last, strict=True):
            pos, n = kv[r], len(seqs[r]) - kv[r]
            ext.append(n)
            if last:  # the scheduler knows the predecessors; the worker completes the hash
                addr.append(hasher.partial(seqs[r], pos)[None])
            else:
                ids += seqs[r][pos:]
                addr.append(hasher.addresses(seqs[r], pos, n))
        plan = pb.plan(rows, [kv[r] for r in rows], ext, ids, use_last=use_last, added=added)
        plan = msgspec.structs.replace(plan, engram_addr=np.concatenate(addr).astype("<i8").tobytes())
        out = runner.execute(plan)
        tokens.append(out.tokens)
        for r, n, t in zip(rows, ext, out.tokens, strict=True):
            kv[r] += n
            seqs[r].append(t)

    step([1, 2, 3], [False] * 3, added=[seq_start(r, s) for r, s in seqs.items()])
    for i, rows in enumerate([[1, 2, 3], [1, 2, 3], [1, 3], [2], [1, 2, 3]]):
        use_last = [(r + i) % 2 == 0 for r in rows]
        for r, last in zip(rows, use_last, strict=True):
            if not last:  # an explicit input in place of the sampled token
                seqs[r][-1] = int(torch.randint(3, vocab, (1,), generator=g))
        step(rows, use_last)
    seqs[4], kv[4] = torch.randint(3, vocab, (6,), generator=g).tolist(), 0
    step([1, 2, 3, 4], [True, True, True, False], added=[seq_start(4, seqs[4])])
    for _ in range(3):
        step([1, 2, 3, 4], [True] * 4)
    runner.sampler.sample = sample
    return logits, tokens


def save_word_tokenizer(path: Path, vocab: int) -> None:
    """A word-level tokenizer of `vocab` distinct tokens `t0`, `t1`, ... beside a tiny checkpoint."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(path))
