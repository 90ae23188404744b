"""Test support: tiny random Llama checkpoints and StepPlan builders.

Used by the gpu tests, and handy for integration tests that need a real (tiny, fast) model directory."""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
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

    def out_loc(self, rows, prefix_lens, extend_lens, replay) -> list[int]:
        return self.alloc(sum(extend_lens))

    def plan(
        self,
        rows,
        prefix_lens,
        extend_lens,
        input_ids,
        use_last=None,
        sample=None,
        added=(),
        released=(),
        replay=(),
    ):
        self.step += 1
        return StepPlan(
            step=self.step,
            added=list(added),
            released=list(released),
            rows=list(rows),
            prefix_lens=list(prefix_lens),
            extend_lens=list(extend_lens),
            use_last=list(use_last) if use_last is not None else [False] * len(rows),
            input_ids=list(input_ids),
            out_loc=self.out_loc(rows, prefix_lens, extend_lens, list(replay) or [0] * len(rows)),
            sample=list(sample) if sample is not None else [True] * len(rows),
            replay=list(replay),
        )


class PagedPlanBuilder(PlanBuilder):
    """StepPlans with the scheduler's slot layout: position p of a row at offset p % page_size of the
    row's (p // page_size)-th page, pages handed out in a shuffled order (so no test relies on contiguous
    slots). A row restarting at position 0 gets fresh pages; `share` starts a row on another row's first
    pages, as a prefix-cache hit does."""

    def __init__(self, page_size: int, num_slots: int = 1024, seed: int = 0) -> None:
        super().__init__([])
        self.page_size = page_size
        self.free_pages = list(range(1, num_slots // page_size))
        random.Random(seed).shuffle(self.free_pages)
        self.pages: dict[int, list[int]] = {}

    def slot(self, row: int, pos: int) -> int:
        pages, ps = self.pages.setdefault(row, []), self.page_size
        while len(pages) <= pos // ps:
            pages.append(self.free_pages.pop())
        return pages[pos // ps] * ps + pos % ps

    def share(self, row: int, src: int, tokens: int) -> list[int]:
        """Row `row` starts on the first `tokens` positions (whole pages) of row `src`: its prefix slots."""
        assert tokens % self.page_size == 0
        self.pages[row] = list(self.pages[src][: tokens // self.page_size])
        return [self.slot(row, p) for p in range(tokens)]

    def out_loc(self, rows, prefix_lens, extend_lens, replay) -> list[int]:
        out = []
        for row, p, e, rp in zip(rows, prefix_lens, extend_lens, replay, strict=True):
            if p == 0 and not rp:
                self.pages.pop(row, None)  # a new request in this row
            out.extend(self.slot(row, pos) for pos in range(p, p + e))
        return out


def seq_start(
    row: int,
    prompt: list[int],
    params: SamplingParams = GREEDY,
    stop_ids=(),
    prefix_slots=(),
    output_ids=(),
) -> SeqStart:
    """`output_ids`: what a request re-admitted after a retraction had generated."""
    return SeqStart(
        row=row,
        params=params,
        prompt_ids=list(prompt),
        prefix_slots=list(prefix_slots),
        stop_ids=list(stop_ids),
        output_ids=list(output_ids),
    )


# ---------------------------------------------------------------------------------------- DeepSeek-V3

YARN_ROPE = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=8.0,
    original_max_position_embeddings=32,  # x 8 = max_position_embeddings
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=0.8,
)


_TINY_MLA = dict(  # MLA and MoE shapes shared by the tiny V2 and V3 configs
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,  # the reference's eager path repeats K/V heads // this
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_deepseek_v3_config(**overrides):
    """Every V3 feature at toy sizes: q LoRA, interleaved rope, 1 dense + 2 MoE layers, 4 expert groups."""
    from transformers import DeepseekV3Config

    kw = dict(
        _TINY_MLA,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_nextn_predict_layers=0,
        architectures=["DeepseekV3ForCausalLM"],
    )
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def tiny_deepseek_v2_config(**overrides):
    """V2 at toy sizes: V3's shapes with V2 routing (softmax, top-3 experts within the best 2 of 4 groups
    by their maximum score, no correction bias, unnormalised weights times 16 as in V2)."""
    from transformers import DeepseekV2Config

    kw = dict(
        _TINY_MLA,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=16.0,
        norm_topk_prob=False,
        architectures=["DeepseekV2ForCausalLM"],
    )
    kw.update(overrides)
    return DeepseekV2Config(**kw)


def _randomized(model):
    """Every weight random, including the norms, the router and V3's correction bias (transformers'
    init leaves them at one and zero, which would hide norm and routing bugs)."""
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.2, 0.2)
    return model


def random_deepseek_v3(seed: int = 0, **overrides):
    """transformers' DeepseekV3ForCausalLM (float32, eager attention) with every weight random."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = tiny_deepseek_v3_config(**overrides)
    config._attn_implementation = "eager"
    return _randomized(DeepseekV3ForCausalLM(config))


def save_tiny_deepseek_v3(path: Path, seed: int = 0, **overrides):
    """A real checkpoint directory (config.json + model.safetensors, per-expert tensor names as the
    released checkpoints) of a random tiny DeepSeek-V3; returns the transformers model."""
    model = random_deepseek_v3(seed, **overrides)
    model.save_pretrained(path)
    return model


def save_tiny_deepseek_v2(path: Path, seed: int = 0, **overrides):
    """As `save_tiny_deepseek_v3`, for transformers' DeepseekV2ForCausalLM (float32, eager attention)."""
    from transformers import DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    config = tiny_deepseek_v2_config(**overrides)
    config._attn_implementation = "eager"
    model = _randomized(DeepseekV2ForCausalLM(config))
    model.save_pretrained(path)
    return model


def decode_scenario(runner, seed: int = 0) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill rows of different lengths, then decode steps whose batch shrinks and grows (padded
    buckets), mixing fed-back tokens (use_last) with explicit ones, and one mixed prefill+decode step.
    Returns every decode step's float32 logits on the host and every step's greedy tokens."""
    g = torch.Generator().manual_seed(seed)
    vocab = runner.vocab_size
    prompts = {r: torch.randint(3, vocab, (n,), generator=g).tolist() for r, n in ((1, 5), (2, 9), (3, 13))}
    pb = PlanBuilder()
    lens = {r: len(p) for r, p in prompts.items()}
    added = [seq_start(r, p) for r, p in prompts.items()]
    out = runner.execute(
        pb.plan(list(prompts), [0, 0, 0], list(lens.values()), sum(prompts.values(), []), added=added)
    )
    logits, tokens = [], [out.tokens]
    schedule = [[1, 2, 3], [1, 2, 3], [1, 3], [2], [1, 2, 3], [1, 2, 3]]
    for i, rows in enumerate(schedule):
        use_last = [(r + i) % 2 == 0 for r in rows]
        ids = [int(torch.randint(3, vocab, (1,), generator=g)) for last in use_last if not last]
        plan = pb.plan(rows, [lens[r] for r in rows], [1] * len(rows), ids, use_last=use_last)
        logits.append(runner.forward_logits(plan).float().cpu())
        for r in rows:
            lens[r] += 1
    # a mixed step (row 4 prefills while the others decode) runs eagerly, then decoding resumes
    new = torch.randint(3, vocab, (6,), generator=g).tolist()
    rows = [1, 2, 3, 4]
    out = runner.execute(pb.plan(rows, [lens[1], lens[2], lens[3], 0], [1, 1, 1, 6], new,
                                 use_last=[True, True, True, False], added=[seq_start(4, new)]))  # fmt: skip
    tokens.append(out.tokens)
    lens.update({1: lens[1] + 1, 2: lens[2] + 1, 3: lens[3] + 1, 4: 6})
    for _ in range(3):
        out = runner.execute(pb.plan(rows, [lens[r] for r in rows], [1] * 4, [], use_last=[True] * 4))
        tokens.append(out.tokens)
        for r in rows:
            lens[r] += 1
    return logits, tokens


def shuffled_slots(seed: int, num_slots: int = 1024) -> list[int]:
    """KV slots 1..num_slots-1 in a seeded random order: tests must not rely on contiguous KV."""
    slots = list(range(1, num_slots))
    random.Random(seed).shuffle(slots)
    return slots


def random_prompt(n: int, seed: int, vocab: int = 128) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


# ---------------------------------------------------------------------------------------- DeepSeek-V4

V4_LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
             "compressed_sparse_attention"]  # fmt: skip


def tiny_deepseek_v4_config(**overrides):
    """V4 at toy sizes with every layer kind: sliding, CSA (rate 4, top-2 of the indexer), HCA (rate 8),
    a hash-routed MoE layer first; window 8, 2 mHC streams."""
    from transformers import DeepseekV4Config

    kw = dict(
        vocab_size=128,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        num_hidden_layers=4,
        head_dim=32,
        partial_rotary_factor=0.25,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        sliding_window=8,
        hc_mult=2,
        hc_sinkhorn_iters=3,
        index_n_heads=16,  # ReLU scores tie at exactly 0 when every head is negative: keep that rare
        index_head_dim=16,
        index_topk=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        layer_types=V4_LAYERS,
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        num_nextn_predict_layers=0,
        max_position_embeddings=256,
        swiglu_limit=0.5,  # small enough that the clamps bite at these sizes
        bos_token_id=1,
        eos_token_id=2,
        architectures=["DeepseekV4ForCausalLM"],
    )
    kw.update(overrides)
    return DeepseekV4Config(**kw)


def random_deepseek_v4(seed: int = 0, **overrides):
    """transformers' DeepseekV4ForCausalLM (float32) with every weight random, including what its init
    leaves at zero or one: sinks, position biases, mHC base/scale, correction bias, and `tid2eid`."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    config = tiny_deepseek_v4_config(**overrides)
    model = DeepseekV4ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif leaf in ("sinks", "position_bias"):
                p.normal_(0.0, 1.0)
            elif leaf in ("base", "hc_base"):
                p.normal_(0.0, 0.5)
            elif leaf in ("scale", "hc_scale"):
                p.uniform_(0.5, 1.5)
            elif leaf in ("fn", "hc_fn") or name.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.2, 0.2)
            elif name.endswith("tid2eid"):
                experts = torch.rand(b.shape[0], config.n_routed_experts).argsort(-1)
                b.copy_(experts[:, : b.shape[1]])
    return model


V4_SLIDING, V4_CSA, V4_HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
# The tiny V4 configs the parity and prefix tests (and `loadgen.v4_replay`) run, as overrides of
# `random_deepseek_v4`'s defaults: "v4" = sliding, CSA (rate 4, indexer top-2), HCA (rate 8), CSA with
# hash MoE then learned routing, window 8; "wide_topk" = HCA first, the indexer keeps every causal
# entry, window 5, 3 mHC streams, two hash layers.
V4_TINY_CONFIGS: dict[str, dict] = {
    "v4": dict(),
    "wide_topk": dict(
        layer_types=[V4_HCA, V4_CSA, V4_SLIDING],
        mlp_layer_types=["hash_moe", "hash_moe", "moe"],
        num_hidden_layers=3,
        index_topk=64,
        sliding_window=5,
        hc_mult=3,
    ),
}


def save_tiny_deepseek_v4(path: Path, seed: int = 0, **overrides):
    """A real checkpoint directory of a random tiny DeepSeek-V4 (transformers saves the upstream tensor
    names: `attn.wq_a`, `ffn.experts.N.w1`, `hc_attn_fn`...); returns the transformers model."""
    model = random_deepseek_v4(seed, **overrides)
    model.save_pretrained(path)
    return model


# ---------------------------------------------------------------------------------------- text oracles

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


# ---------------------------------------------------------------------------------------- V4 prefix hits


@dataclass
class HitVsCold:
    """One request computed cold and as a prefix hit: logits of the positions past the hit and of the
    greedy decodes, the two greedy continuations, and whether the cached entries stayed untouched."""

    hit: torch.Tensor
    cold: torch.Tensor
    hit_tokens: list[int]
    cold_tokens: list[int]
    cache_untouched: bool
    prompt_rows: int  # the first rows of hit / cold: prompt positions (same inputs in both runs)

    @property
    def max_diff(self) -> float:
        return (self.hit - self.cold).abs().max().item()

    @property
    def prompt_max_diff(self) -> float:
        n = self.prompt_rows
        return (self.hit[:n] - self.cold[:n]).abs().max().item()


def _every_position(runner, plan: StepPlan) -> torch.Tensor:
    runner._check_layout(plan)
    runner._update_table(plan)
    batch, _, _ = runner._build_batch(plan)
    with torch.inference_mode():
        return runner.model.compute_logits(runner.model(batch.input_ids, batch.positions, batch))


def _prefill_and_decode(runner, pb, row, ids, hit, replay, decode, prefix_slots=()):
    """Row `row` computes ids[hit:] after replaying the `replay` tokens before `hit`, in two chunks, then
    decodes greedily; logits of positions hit.. and of the decodes, and the greedy tokens."""
    start, mid = hit - replay, hit + (len(ids) - hit) // 2
    added = [seq_start(row, ids, prefix_slots=prefix_slots)]
    first = pb.plan(
        [row], [start], [mid - start], ids[start:mid], added=added, replay=[replay] if replay else []
    )
    logits = [_every_position(runner, first)[replay:]]
    logits.append(_every_position(runner, pb.plan([row], [mid], [len(ids) - mid], ids[mid:])))
    tokens = [int(logits[-1][-1].argmax())]
    for pos in range(len(ids), len(ids) + decode - 1):
        logits.append(runner.forward_logits(pb.plan([row], [pos], [1], tokens[-1:])))
        tokens.append(int(logits[-1][-1].argmax()))
    return torch.cat(logits), tokens


def _cached_entries(runner, pb: PagedPlanBuilder, row: int, n: int) -> list[torch.Tensor]:
    """Copies of the pool entries (and indexer keys) of row's first n positions, per compressed layer."""
    cache, layers, out = runner.kv_cache, runner.model.attention_layers(), []
    for pools in (cache.entries, cache.index_keys):
        for lid, pool in pools.items():
            rate = layers[lid].compressor.rate
            out.append(pool[[pb.slot(row, p) // rate for p in range(0, n, rate)]].clone())
    return out


def v4_hit_vs_cold(
    runner, prefix_len: int, replay: int, seed: int, page: int = 8, decode: int = 8
) -> HitVsCold:
    """On a DeepSeek-V4 runner (rows 1-3, position-aligned pages): request A = P + its own 7 tokens
    caches the prefix P of `prefix_len` tokens; request B = P + 9 other tokens runs cold in row 2 and as
    a hit on A's pages in row 3 (a reused row), replaying `replay` tokens before the hit."""
    prefix = random_prompt(prefix_len, seed, runner.vocab_size)
    a = prefix + random_prompt(7, seed + 1, runner.vocab_size)
    b = prefix + random_prompt(9, seed + 2, runner.vocab_size)
    pb = PagedPlanBuilder(page, runner.cfg.num_kv_slots, seed)
    runner.execute(pb.plan([1], [0], [len(a)], a, added=[seq_start(1, a)]))
    before = _cached_entries(runner, pb, 1, prefix_len)
    cold, cold_tokens = _prefill_and_decode(runner, pb, 2, b, 0, 0, decode)
    slots = pb.share(3, 1, prefix_len)
    hit, hit_tokens = _prefill_and_decode(runner, pb, 3, b, prefix_len, replay, decode, slots)
    after = _cached_entries(runner, pb, 1, prefix_len)
    untouched = all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    return HitVsCold(hit, cold[prefix_len:], hit_tokens, cold_tokens, untouched, len(b) - prefix_len)
