"""Speculative decoding: drafters propose a block of tokens per request, the target verifies the block
in one forward, and acceptance keeps the longest valid prefix plus one token of the target's own.

- `drafter.py`: the drafter contract; `ngram.py` (prompt lookup on the device); `drafters.py` makes the
  one a config names;
- `verify.py`: lossless acceptance of sampled blocks;
- `policy.py`: how many drafts each request verifies (scheduler side: adaptive from acceptance and load);
- `worker.py`: the worker's speculation state (the drafts between steps, the drafter).

How a step verifies (docs/speculative.md): a row with k drafts feeds [its last token, d1..dk] at k + 1
positions; the target samples every position with the request's own sampling rule; draft d_j is accepted
while the sample at position j - 1 equals it, and the sample after the last accepted draft is the row's
bonus token. Drafts are proposals only (their probability is not used), so acceptance is rejection
sampling with a one-hot draft distribution: the output follows the target's distribution exactly, and a
seeded request emits the same tokens with and without speculation."""

from __future__ import annotations

ALGORITHMS = ("ngram", "draft-model", "mtp", "dspark")
