"""Sampling defaults from generation_config.json (vLLM's --generation-config), and the HTTP layer
applying them only where a request is silent."""

from __future__ import annotations

import json

import pytest

from runtime.generation_defaults import SamplingDefaults, load_sampling_defaults
from runtime.gpu.convert import default_model_path
from runtime.http.options import ServingOptions
from runtime.http.protocol import parse_chat, parse_completion

QWEN_LIKE = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def write(dir_, config: dict):
    (dir_ / "generation_config.json").write_text(json.dumps(config))
    return dir_


def test_auto_reads_the_models_file_and_vllm_ignores_it(tmp_path):
    model = write(tmp_path, {**QWEN_LIKE, "max_new_tokens": 512, "eos_token_id": 2})
    d = load_sampling_defaults("auto", str(model))
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty, d.max_tokens) == (0.7, 0.8, 20, 1.05, 512)
    assert load_sampling_defaults("vllm", str(model)) == SamplingDefaults()
    assert load_sampling_defaults("auto", str(tmp_path / "absent")) == SamplingDefaults()


def test_a_path_and_overrides(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    write(other, {"temperature": 0.3})
    assert load_sampling_defaults(str(other), str(tmp_path)).temperature == 0.3
    assert load_sampling_defaults(str(other / "generation_config.json"), str(tmp_path)).temperature == 0.3
    d = load_sampling_defaults("vllm", str(tmp_path), {"temperature": 0.9, "min_p": 0.05})
    assert (d.temperature, d.min_p) == (0.9, 0.05)
    with pytest.raises(FileNotFoundError):
        load_sampling_defaults(str(tmp_path / "missing"), str(tmp_path))


def test_do_sample_false_means_greedy_unless_overridden(tmp_path):
    write(tmp_path, {"do_sample": False, "temperature": 0.6})
    assert load_sampling_defaults("auto", str(tmp_path)).temperature == 0.0
    assert load_sampling_defaults("auto", str(tmp_path), {"temperature": 0.5}).temperature == 0.5


def test_the_embedded_smollm2_is_greedy_by_default(smollm2_path):
    assert default_model_path() == smollm2_path
    assert load_sampling_defaults("auto", str(smollm2_path)).temperature == 0.0


def body(**kw) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **kw}).encode()


def test_requests_get_the_defaults_only_where_they_are_silent():
    opts = ServingOptions(
        sampling_defaults=SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, max_tokens=100)
    )
    p = parse_chat(body(), served_model="m", max_model_len=4096, options=opts).requests[0].params
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.6, 0.9, 20, 100)
    p = (
        parse_chat(body(temperature=1.2, top_p=None, max_tokens=7), served_model="m", options=opts)
        .requests[0]
        .params
    )
    assert (p.temperature, p.top_p, p.max_tokens) == (1.2, 0.9, 7)
    p = parse_chat(body(temperature=0), served_model="m", options=opts).requests[0].params
    assert p.temperature == 0.0 and p.greedy
    # the default max_tokens never exceeds the context
    p = parse_chat(body(), served_model="m", max_model_len=50, options=opts).requests[0].params
    assert p.max_tokens == 50
    c = json.dumps({"prompt": "hi"}).encode()
    assert parse_completion(c, served_model="m", options=opts).requests[0].params.max_tokens == 100
    assert parse_completion(c, served_model="m").requests[0].params.max_tokens == 16  # OpenAI's default
