"""The `deepseek-v4-flash` dummy preset has the released model's shape, `--hf-overrides` cuts it down
(fewer layers for one GPU), and a cut-down dummy V4-Flash builds and runs prefill and decode on CPU."""

from __future__ import annotations

import pytest
import torch

from runtime.cli import build_parser, config_from_args
from runtime.config import RunnerConfig, ServerConfig, apply_hf_overrides
from runtime.gpu import loader, presets
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.models import get_model_class
from runtime.gpu.testing import PlanBuilder, seq_start
from runtime.model_info import load_model_info

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# the released checkpoint's parameter count (main model + MTP block; FP4 experts counted unpacked), as
# reported by hebo1221/nano-deepseek-v4 references/DeepSeek-V4-Flash-validation.summary.json
V4_FLASH_PARAMS = 290_942_289_362


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(tmp_path))


def meta_params(config) -> int:
    with torch.device("meta"):
        model = get_model_class(config)(config, max_positions=8192)
    return sum(p.numel() for name, p in model.named_parameters() if not name.endswith("tid2eid"))


def test_v4_flash_preset_has_the_released_shape_and_parameter_count():
    c = loader.load_config("deepseek-v4-flash")
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.head_dim) == (43, 4096, 64, 512)
    assert (c.qk_rope_head_dim, c.sliding_window, c.hc_mult, c.n_routed_experts) == (64, 128, 4, 256)
    assert c.layer_types[:4] == [SLIDING, SLIDING, CSA, HCA] and c.layer_types[-1] == CSA
    assert c.layer_types.count(CSA) == 21 and c.layer_types.count(HCA) == 20
    assert c.mlp_layer_types[:4] == ["hash_moe"] * 3 + ["moe"]
    assert c.compress_rates == {CSA: 4, HCA: 128}
    assert c.rope_parameters["compress"]["factor"] == 16
    assert meta_params(c) == V4_FLASH_PARAMS


def test_hf_overrides_keep_the_first_layers_for_one_gpu():
    c = loader.load_config("deepseek-v4-flash", {"num_hidden_layers": 8})
    assert c.num_hidden_layers == 8 and c.layer_types == [SLIDING, SLIDING] + [CSA, HCA] * 3
    # 8 layers + the MTP block: 60.4B parameters, 120.7 GB in bfloat16 (107.5 GB without the MTP block)
    assert meta_params(c) == 60_350_720_432


def test_apply_hf_overrides_merges_nested_dicts_and_cuts_per_layer_lists():
    cfg = {
        "num_hidden_layers": 4,
        "layer_types": ["a", "b", "c", "d"],
        "rope_scaling": {"factor": 16, "type": "yarn"},
    }
    out = apply_hf_overrides(cfg, {"num_hidden_layers": 2, "rope_scaling": {"factor": 4}})
    assert out == {
        "num_hidden_layers": 2,
        "layer_types": ["a", "b"],
        "rope_scaling": {"factor": 4, "type": "yarn"},
    }
    assert cfg["num_hidden_layers"] == 4 and apply_hf_overrides(cfg, None) is cfg


def test_hf_overrides_flag_in_both_spellings_reaches_the_server_config():
    for flag in ("--hf-overrides", "--json-model-override-args"):
        args = build_parser().parse_args(
            ["serve", "--model", "deepseek-v4-flash", flag, '{"num_hidden_layers": 8}']
        )
        assert config_from_args(args).hf_overrides == {"num_hidden_layers": 8}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--hf-overrides", "[8]"])


# Real V4-Flash attention geometry (head_dim 512, rope 64, 8 output groups, window 128, CSA 4 / HCA 128,
# 4 mHC streams, 20 Sinkhorn iterations, index top-512, 6 of the experts, hash layers first) at a width
# and expert count a 2-core CPU runs in seconds.
SHRINK = {
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "num_attention_heads": 8,
    "q_lora_rank": 128,
    "o_lora_rank": 64,
    "index_n_heads": 8,
    "n_routed_experts": 8,
    "moe_intermediate_size": 128,
    "vocab_size": 49152,
}


def test_cut_down_dummy_v4_flash_runs_prefill_and_decode_on_cpu():
    runner = ModelRunner(
        RunnerConfig(
            "deepseek-v4-flash",
            load_format="dummy",
            hf_overrides=SHRINK,
            num_kv_slots=1024,
            max_reqs=2,
            max_model_len=512,
        )  # fmt: skip
    )
    model = runner.model
    assert [layer.self_attn.layer_type for layer in model.model.layers] == [
        SLIDING,
        SLIDING,
        CSA,
        HCA,
        SLIDING,
    ]
    tid2eid = model.model.layers[0].mlp.gate.tid2eid
    assert tid2eid.unique().numel() == 8 and (tid2eid.sort(-1).values.diff(dim=-1) > 0).all()  # 6 distinct
    ids = torch.randint(
        3, 49152, (300,), generator=torch.Generator().manual_seed(0)
    ).tolist()  # 2 HCA windows
    pb = PlanBuilder(list(range(512, 1024)))  # slot = 512 + position: position-aligned pages of 128
    logits = [runner.forward_logits(pb.plan([1], [0], [300], ids, added=[seq_start(1, ids)]))]
    for pos in range(300, 303):
        logits.append(runner.forward_logits(pb.plan([1], [pos], [1], [int(logits[-1].argmax())])))
    logits = torch.cat(logits)
    assert logits.shape == (4, 49152) and torch.isfinite(logits).all() and logits.std() > 0
    cfg = ServerConfig(model="deepseek-v4-flash", load_format="dummy", hf_overrides=SHRINK)
    assert (
        load_model_info(cfg, str(presets.preset_dir("deepseek-v4-flash"))).vocab_size == 49152
    )  # the frontend
