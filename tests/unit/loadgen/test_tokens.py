"""--tokenizer: exact lengths, and server usage checked against the retokenized answers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from loadgen.cli import main
from loadgen.datasets import random_prompts, shared_prefix_prompts
from loadgen.tokens import WORDS, HFCodec, WordCodec


@pytest.fixture
def tokenizer_dir(tmp_path):
    """A word-level tokenizer: one token per whitespace-separated word, unknown words -> [UNK]."""
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(dict.fromkeys(WORDS))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    return str(tmp_path / "tok")


def test_random_prompts_have_the_requested_lengths(tokenizer_dir):
    codec = HFCodec(tokenizer_dir)
    ps = random_prompts(50, 40, 10, 0.5, codec, np.random.default_rng(0))
    for p in ps:
        assert 20 <= p.input_len <= 40 and 5 <= p.output_len <= 10
        assert len(codec.encode(p.prompt)) == p.input_len


def test_shared_prefix_groups_share_their_system_prompt():
    ps = shared_prefix_prompts(3, 4, 30, 5, 7, WordCodec(), np.random.default_rng(0))
    prefixes = {p.prompt.split("\n\n")[0] for p in ps}
    assert len(ps) == 12 and len(prefixes) == 3
    assert all(p.input_len == 35 and p.output_len == 7 for p in ps)


def test_usage_is_checked_against_the_tokenizer(fake_server, tokenizer_dir, tmp_path):
    out = tmp_path / "r.json"
    rc = main(["serve", "--base-url", fake_server.url, "--tokenizer", tokenizer_dir, "--num-prompts", "5",
               "--random-input-len", "12", "--random-output-len", "6", "--random-range-ratio", "1", "--disable-tqdm", "--out", str(out)])  # fmt: skip
    assert rc == 0
    m = json.loads(out.read_text())["metrics"]
    assert m["retokenized_output_tokens"] == m["total_output_tokens"] == 30
    assert m["token_mismatches"] == 0


def test_a_missing_tokenizer_is_a_one_line_error(tmp_path, capsys):
    assert main(["serve", "--tokenizer", str(tmp_path / "nope"), "--num-prompts", "1"]) == 2
    assert capsys.readouterr().err.startswith("error: cannot load tokenizer")
