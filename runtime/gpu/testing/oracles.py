"""Oracles nobody here wrote: transformers' logits and greedy chat text, and the tokenizer files that
let a tiny random checkpoint be served."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Put a tokenizer (e.g. SmolLM2's, ids < 49152) beside a tiny random checkpoint so it can be served."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)


def greedy_chat_texts(model, tokenizer, prompts: list[str], max_new_tokens: int, min_prompt_tokens: int = 0):
    """transformers' greedy `generate` on each prompt as a one-turn chat: the oracle for served text."""
    out = []
    for p in prompts:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        assert ids.shape[1] > min_prompt_tokens, (p, ids.shape[1])
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        out.append(tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=True))
    return out
