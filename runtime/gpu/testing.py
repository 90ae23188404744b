"""Test support: tiny random Llama checkpoints and StepPlan builders.

Used by the gpu tests, and handy for integration tests that need a real (tiny, fast) model directory."""

from __future__ import annotations

from pathlib import Path

import torch

from runtime.mailbox.messages import SamplingParams, SeqStart, StepPlan

GREEDY = SamplingParams(temperature=0.0)


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=1,
        architectures=["LlamaForCausalLM"],
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def save_tiny_llama(path: Path, seed: int = 0, **overrides):
    """A real checkpoint directory (config.json + model.safetensors) of a random tiny Llama."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = tiny_llama_config(**overrides)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # default init leaves norms at 1; randomize so a norm bug shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


class PlanBuilder:
    """Builds StepPlans with step numbers and a simple slot allocator (slot 0 never handed out)."""

    def __init__(self, slots: list[int] | None = None) -> None:
        self.step = 0
        self.free = list(slots) if slots is not None else list(range(1, 4096))

    def alloc(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        return out

    def plan(
        self, rows, prefix_lens, extend_lens, input_ids, use_last=None, sample=None, added=(), released=()
    ):
        self.step += 1
        n = sum(extend_lens)
        return StepPlan(
            step=self.step,
            added=list(added),
            released=list(released),
            rows=list(rows),
            prefix_lens=list(prefix_lens),
            extend_lens=list(extend_lens),
            use_last=list(use_last) if use_last is not None else [False] * len(rows),
            input_ids=list(input_ids),
            out_loc=self.alloc(n),
            sample=list(sample) if sample is not None else [True] * len(rows),
        )


def seq_start(row: int, prompt: list[int], params: SamplingParams = GREEDY, stop_ids=()) -> SeqStart:
    return SeqStart(row=row, params=params, prompt_ids=list(prompt), prefix_slots=[], stop_ids=list(stop_ids))
