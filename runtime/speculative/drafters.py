"""The drafter a config names."""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch

from runtime.config import RunnerConfig
from runtime.gpu import loader, presets
from runtime.gpu.attention import default_backend
from runtime.gpu.forward_batch import StepTables
from runtime.gpu.model_builder import build_model
from runtime.gpu.models.base import CausalLM
from runtime.speculative import ALGORITHMS
from runtime.speculative.draft_model import DraftModelDrafter
from runtime.speculative.drafter import Drafter
from runtime.speculative.dspark import DSparkDrafter
from runtime.speculative.mtp import MTPDrafter
from runtime.speculative.ngram import NgramDrafter


def make_drafter(
    cfg: RunnerConfig,
    tables: StepTables,
    num_slots: int,
    vocab_size: int,
    dtype: torch.dtype,
    target: CausalLM | None = None,
) -> Drafter:
    """The drafter `cfg.speculative_algorithm` names, for the target's request tables and KV pool size
    (hidden-state drafters also take the target model)."""
    name, k = cfg.speculative_algorithm, cfg.speculative_num_draft_tokens
    rows, device = tables.req_to_token.shape[0], tables.req_to_token.device
    if k < 1:
        raise ValueError(f"--speculative-num-draft-tokens must be at least 1, got {k}")
    if name == "ngram":
        lo, hi = cfg.speculative_ngram_sizes
        return NgramDrafter(k, rows, cfg.max_model_len, device, min_n=lo, max_n=hi)
    if name == "draft-model":
        if not cfg.speculative_draft_model_path:
            raise ValueError("--speculative-algorithm draft-model needs --speculative-draft-model-path")
        path = Path(presets.resolve(cfg.speculative_draft_model_path))
        config = loader.load_config(path)
        if config.vocab_size != vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({config.vocab_size}) differs from the target's ({vocab_size}): "
                "a draft model must share the target's tokenizer"
            )
        draft_cfg = msgspec.structs.replace(cfg, model_path=str(path), hf_overrides=None)
        model = build_model(draft_cfg, config, path, device, dtype)
        backend = cfg.attention_backend or default_backend(device)
        return DraftModelDrafter(model, backend, tables, num_slots, k, cfg.max_model_len, dtype)
    if name == "mtp":
        if target is None:
            raise ValueError("the mtp drafter needs the target model")
        backend = cfg.attention_backend or default_backend(device)
        return MTPDrafter(target, backend, tables, num_slots, k, cfg.max_model_len, dtype)
    if name == "dspark":
        if target is None:
            raise ValueError("the dspark drafter needs the target model")
        path = Path(presets.resolve(cfg.model_path))
        return DSparkDrafter(target, tables, num_slots, k, cfg.max_model_len, dtype, path, seed=cfg.seed)
    if name in ALGORITHMS:
        raise ValueError(
            f"--speculative-algorithm {name} is not available yet; choose ngram, draft-model, mtp or dspark"
        )
    raise ValueError(f"unknown --speculative-algorithm {name!r}; choose from {', '.join(ALGORITHMS)}")
