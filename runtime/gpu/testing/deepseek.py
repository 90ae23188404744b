"""Tiny random DeepSeek-V2 / V3 / V4 checkpoints and configs, saved by transformers, with every weight
random (norms, routers and biases included, so routing bugs show), and a V3 decode scenario."""

from __future__ import annotations

from pathlib import Path

import torch

from runtime.gpu.testing.plans import plan_builder, seq_start

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


def save_tiny_deepseek_v3(path: Path, seed: int = 0, mtp_layers: int = 0, **overrides):
    """A real checkpoint directory (config.json + model.safetensors, per-expert tensor names as the
    released checkpoints) of a random tiny DeepSeek-V3; returns the transformers model (which has no MTP
    layers). `mtp_layers=n`: the config says n nextn layers and the checkpoint holds n random ones
    (`_append_mtp_layers`; transformers alone saves none)."""
    if mtp_layers:
        overrides["num_nextn_predict_layers"] = mtp_layers
    model = random_deepseek_v3(seed, **overrides)
    model.save_pretrained(path)
    if mtp_layers:
        _append_mtp_layers(Path(path), model.config, mtp_layers, seed)
    return model


def _append_mtp_layers(path: Path, config, n_mtp: int, seed: int) -> None:  # noqa: ANN001
    """Random MTP layers in a saved tiny V3 checkpoint, named as DeepSeek's releases name them:
    `model.layers.{N + i}.*` holds a decoder layer (MoE), `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`
    and copies of the embedding and head (`embed_tokens`, `shared_head.head`)."""
    import tempfile

    from safetensors.torch import load_file, save_file

    n = config.num_hidden_layers
    extended = random_deepseek_v3(seed + 1, num_hidden_layers=n + n_mtp, num_nextn_predict_layers=0)
    file = path / "model.safetensors"
    tensors = load_file(file)
    with tempfile.TemporaryDirectory() as tmp:
        extended.save_pretrained(tmp)
        layers = {k: v for k, v in load_file(Path(tmp) / "model.safetensors").items() if _layer_index(k) >= n}
    tensors.update(layers)
    gen = torch.Generator().manual_seed(seed + 2)
    d = config.hidden_size
    for i in range(n, n + n_mtp):
        p = f"model.layers.{i}."
        tensors[p + "enorm.weight"] = torch.rand(d, generator=gen) + 0.5
        tensors[p + "hnorm.weight"] = torch.rand(d, generator=gen) + 0.5
        tensors[p + "shared_head.norm.weight"] = torch.rand(d, generator=gen) + 0.5
        tensors[p + "eh_proj.weight"] = torch.randn(d, 2 * d, generator=gen) * (2 * d) ** -0.5
        tensors[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[p + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, file, metadata={"format": "pt"})


def _layer_index(name: str) -> int:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else -1


def save_tiny_deepseek_v2(path: Path, seed: int = 0, **overrides):
    """As `save_tiny_deepseek_v3`, for transformers' DeepseekV2ForCausalLM (float32, eager attention)."""
    from transformers import DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    config = tiny_deepseek_v2_config(**overrides)
    config._attn_implementation = "eager"
    model = _randomized(DeepseekV2ForCausalLM(config))
    model.save_pretrained(path)
    return model


def _fp8_quantized(name: str, t: torch.Tensor) -> bool:
    """What DeepSeek quantizes: every linear of attention, dense MLP and experts (not the router, the
    embedding, the head or norms)."""
    return t.ndim == 2 and name.endswith("_proj.weight") or name.endswith("_proj_with_mqa.weight")


def write_fp8_checkpoint(src: Path, dst: Path, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Quantize checkpoint `src`'s linear weights into `dst` as DeepSeek-V3's released checkpoints store
    them (e4m3 + `weight_scale_inv` in `block`s, two shards + index, `quantization_config`); returns the
    dequantized state dict (checkpoint names), what an exact loader computes with."""
    import json

    from safetensors.torch import load_file, save_file

    from runtime.gpu.quant import fp8

    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    out, dequantized = {}, {}
    for name, t in tensors.items():
        if _fp8_quantized(name, t):
            q, s = fp8.quantize(t, block)
            out[name], out[name.replace(".weight", ".weight_scale_inv")] = q, s
            dequantized[name] = fp8.dequantize(q, s, block)
        else:
            out[name] = dequantized[name] = t
    names = sorted(out)
    # Split so that some weights and their scales land in different shards.
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: out[k].contiguous() for k in keys}, dst / fname)
        weight_map.update({k: fname for k in keys})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (dst / "config.json").write_text(json.dumps(config))
    return dequantized


def load_into_reference(ref, tensors: dict[str, torch.Tensor]) -> None:
    """Checkpoint names into transformers' V2/V3 model, whose experts are fused in memory."""
    import re

    params = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
    with torch.no_grad():
        for name, t in tensors.items():
            m = re.match(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
            if m is None:
                params[name].copy_(t)
                continue
            e, part = int(m[2]), m[3]
            if part == "down":
                params[f"{m[1]}.down_proj"][e].copy_(t)
            else:
                half = t.shape[0]
                params[f"{m[1]}.gate_up_proj"][e, (0 if part == "gate" else half) :][:half].copy_(t)


def decode_scenario(runner, seed: int = 0) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill rows of different lengths, then decode steps whose batch shrinks and grows (padded
    buckets), mixing fed-back tokens (use_last) with explicit ones, and one mixed prefill+decode step.
    Returns every decode step's float32 logits on the host and every step's greedy tokens."""
    g = torch.Generator().manual_seed(seed)
    vocab = runner.vocab_size
    prompts = {r: torch.randint(3, vocab, (n,), generator=g).tolist() for r, n in ((1, 5), (2, 9), (3, 13))}
    pb = plan_builder(runner)
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


def assert_router_matches(ref: torch.nn.Module, config) -> None:  # noqa: ANN001 - a transformers config
    """Our `TopkRouter` with the weights of transformers' router `ref` picks the same experts with the
    same weights on random hidden states (matched by expert id: the top-k order is unspecified)."""
    from runtime.gpu.layers.moe import TopkRouter

    ours = TopkRouter(config)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(50, config.hidden_size)
    _, ref_w, ref_ids = ref(x)
    w, ids = ours(x)
    ref_ids, order = ref_ids.sort(-1)
    ids, our_order = ids.sort(-1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w.gather(1, our_order), ref_w.gather(1, order), atol=1e-6, rtol=0)


def assert_same_decode(got: tuple, want: tuple, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """Two `decode_scenario` results: the same greedy tokens at every step, logits within tolerance."""
    (logits, tokens), (ref_logits, ref_tokens) = got, want
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


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


def save_tiny_deepseek_v4(path: Path, seed: int = 0, mtp_layers: int = 0, **overrides):
    """A real checkpoint directory of a random tiny DeepSeek-V4 (transformers saves the upstream tensor
    names: `attn.wq_a`, `ffn.experts.N.w1`, `hc_attn_fn`...); returns the transformers model (which drops
    MTP). `mtp_layers=1`: the config says one MTP block and `mtp.safetensors` holds it, upstream names
    `mtp.0.*`: layer 0's sliding attention and mHC, layer 1's learned-routing MoE, and random
    enorm / hnorm / e_proj / h_proj / hyper-head / norm."""
    if mtp_layers:
        if mtp_layers != 1:
            raise ValueError("the tiny V4 checkpoint has one MTP block at most")
        overrides["num_nextn_predict_layers"] = 1
    model = random_deepseek_v4(seed, **overrides)
    model.save_pretrained(path)
    if mtp_layers:
        from safetensors.torch import load_file, save_file

        main, mtp = load_file(Path(path) / "model.safetensors"), {}
        for name, t in main.items():
            if name.startswith("model.layers.0.") and ".ffn." not in name:
                mtp["mtp.0." + name.removeprefix("model.layers.0.")] = t.clone()
            elif name.startswith("model.layers.1.ffn."):
                mtp["mtp.0." + name.removeprefix("model.layers.1.")] = t.clone()
        d, n = model.config.hidden_size, model.config.hc_mult
        g = torch.Generator().manual_seed(seed + 1)
        shapes = {"enorm.weight": [d], "hnorm.weight": [d], "e_proj.weight": [d, d], "h_proj.weight": [d, d],
                  "hc_head_fn": [n, n * d], "hc_head_base": [n], "hc_head_scale": [1], "norm.weight": [d]}  # fmt: skip
        for name, shape in shapes.items():
            t = torch.randn(shape, generator=g) * 0.1
            mtp[f"mtp.0.{name}"] = t + 1.0 if "norm" in name or "scale" in name else t
        save_file(mtp, str(Path(path) / "mtp.safetensors"))
    return model
