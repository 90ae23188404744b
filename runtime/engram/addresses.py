"""The scheduler's half of Engram: a step's table addresses, computed when the step is planned.

Addresses depend only on token ids, so the scheduler, which holds every request's ids, computes them
with the plan and sends them in it (`StepPlan.engram_addr`, int64 little-endian [tokens, columns]).
Overlap scheduling stays on: a decode row's input is the token that the step still in flight samples.
For it the scheduler sends the part of the hash it knows, the XOR of the earlier tokens' terms
(`NgramHasher.partial`), and the worker completes it once that token reaches the host. Speculative
drafts are not supported: their tokens live on the device."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from runtime.engram.compression import cached_compression_table
from runtime.engram.config import engram_config_of
from runtime.engram.hashing import NgramHasher

if TYPE_CHECKING:
    from collections.abc import Callable

    from runtime.actors.scheduler.batch_planner import PlannedStep
    from runtime.config import ServerConfig
    from runtime.mailbox.messages import StepPlan


def hasher_for_model(
    model_path: str, tokenizer_path: Callable[[], str], hf_overrides: dict | None
) -> NgramHasher | None:
    """The model's hasher (its config.json's Engram block under the overrides), or None without one.
    `tokenizer_path` is asked only for a model with Engram: finding a tokenizer may mean converting the
    embedded model, which a dummy preset on a GPU machine neither needs nor has."""
    from runtime.config import apply_hf_overrides

    config = apply_hf_overrides(json.loads((Path(model_path) / "config.json").read_text()), hf_overrides)
    cfg = engram_config_of(config.get("text_config", config))
    if cfg is None:
        return None
    return NgramHasher(cfg, cached_compression_table(tokenizer_path(), config.get("vocab_size")))


def hasher_for_server(server: ServerConfig) -> NgramHasher | None:
    from runtime.model_info import resolve_model_path, tokenizer_dir

    path = resolve_model_path(server)
    return hasher_for_model(
        path, lambda: tokenizer_dir(server.tokenizer, path, server.load_format), server.hf_overrides
    )


def plan_addresses(hasher: NgramHasher, planned: PlannedStep) -> StepPlan:
    """The planned step's plan with the addresses of all its tokens."""
    plan = planned.plan
    parts = []
    for req, start, n, fed in zip(
        planned.reqs, plan.prefix_lens, plan.extend_lens, plan.use_last, strict=True
    ):
        seq = req.seq_ids
        if len(seq) < start + (0 if fed else n) or (fed and n != 1):
            raise RuntimeError(f"Engram: request {req.rid} planned past its known tokens")
        # a decode row's input is sampled by the step still in flight: the worker completes its hash
        parts.append(hasher.partial(seq, start)[None] if fed else hasher.addresses(seq, start, n))
    if not parts:
        return plan
    addr = np.concatenate(parts).astype("<i8", copy=False)
    return msgspec.structs.replace(plan, engram_addr=addr.tobytes())
