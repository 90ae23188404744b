"""SmolLM2 with an Engram block added by `--hf-overrides` (tables and Engram weights from the seed),
served by `conduit serve` on the CPU: the greedy text equals an oracle built from transformers' Llama
with the reference Engram (runtime/engram/reference.py) hooked in before the attention of each Engram
layer; every placement gives the same tokens and logprobs; and they differ from the model without
Engram."""

from __future__ import annotations

import json
import time

import numpy as np
import openai
import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtime.engram.compression import cached_compression_table
from runtime.engram.config import EngramConfig
from runtime.engram.hashing import NgramHasher
from runtime.engram.layer import EngramLayer
from runtime.engram.reference import ReferenceEngram, ReferenceHash
from runtime.engram.tables import generate_rows

BLOCK = {"layer_ids": [1, 15], "n_embed_per_ngram": 64, "n_head_per_ngram": 4,
         "engram_vocab_size": [20011, 20011], "seed": 3}  # fmt: skip
OVERRIDES = json.dumps({"engram": BLOCK})
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
MAX_TOKENS = 16


def _with_reference_engram(model, cfg: EngramConfig, lookup: np.ndarray):
    """Hooks the reference Engram into transformers' Llama: h = engram(h, ids) + h before each Engram
    layer. Its weights are the seeded ones the server generates; `state["ids"]` is the input [1, T]."""
    ref_hash, hasher, state = ReferenceHash(cfg, lookup), NgramHasher(cfg, lookup), {}
    hidden = model.config.hidden_size
    for layer_id in cfg.layer_ids:
        ref = ReferenceEngram(cfg, ref_hash, layer_id, hidden, 1)
        seeded = EngramLayer(cfg, layer_id, hidden, 1)
        seeded.init_from_seed()
        ref.load_state_dict(seeded.state_dict(), strict=False)
        lo, hi = hasher.layer_rows(layer_id)
        with torch.no_grad():
            ref.embedding.weight.copy_(generate_rows(cfg.seed, lo, hi, cfg.head_dim, torch.float32))

        def hook(module, args, kwargs, ref=ref):
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            h = h + ref(h[:, :, None], state["ids"])[:, :, 0]
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": h}
            return (h, *args[1:]), kwargs

        model.model.layers[layer_id].register_forward_pre_hook(hook, with_kwargs=True)
    return state


def _greedy(model, tok, state, prompt: str) -> str:
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(text, add_special_tokens=False).input_ids
    out = []
    for _ in range(MAX_TOKENS):  # full forwards: the reference convolution sees the whole sequence
        state["ids"] = np.array([ids + out])
        with torch.no_grad():
            nxt = int(model(torch.tensor(state["ids"]), use_cache=False).logits[0, -1].argmax())
        if nxt == tok.eos_token_id:
            break
        out.append(nxt)
    return tok.decode(out, skip_special_tokens=True)


@pytest.fixture(scope="module")
def oracle(smollm2_path):
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, torch_dtype=torch.float32).eval()
    cfg = EngramConfig.from_dict(BLOCK)
    state = _with_reference_engram(
        model, cfg, cached_compression_table(smollm2_path, model.config.vocab_size)
    )
    return [_greedy(model, tok, state, p) for p in PROMPTS]


def _answers(server) -> list[tuple[str, list[float]]]:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    out = []
    for prompt in PROMPTS:
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", temperature=0, max_tokens=MAX_TOKENS, logprobs=True,
            messages=[{"role": "user", "content": prompt}],
        )  # fmt: skip
        out.append((r.choices[0].message.content, [t.logprob for t in r.choices[0].logprobs.content]))
    return out


@pytest.fixture(scope="module")
def plain(server):
    return _answers(server)


@pytest.fixture(scope="module")
def device_answers(server_runner, tmp_path_factory):
    args = ("--hf-overrides", OVERRIDES, "--engram-placement", "device")
    with server_runner(tmp_path_factory.mktemp("engram-device"), *args) as s:
        return _answers(s)


@pytest.fixture(scope="module")
def host_server(server_runner, tmp_path_factory):
    args = ("--hf-overrides", OVERRIDES, "--engram-placement", "host", "--engram-shards", "2")
    with server_runner(tmp_path_factory.mktemp("engram-host"), *args) as s:
        yield s


def test_engram_greedy_text_equals_reference_oracle(device_answers, oracle):
    assert [text for text, _ in device_answers] == oracle


def test_engram_changes_the_model(device_answers, plain):
    assert [lp for _, lp in device_answers] != [lp for _, lp in plain]


def test_host_shards_give_identical_tokens_and_logprobs(host_server, device_answers):
    assert _answers(host_server) == device_answers
    m = host_server.wait_idle()
    assert m["conduit_engram_lookups_total"] > 0 and m["conduit_engram_rows_fetched_total"] > 0
    assert m["conduit_engram_fetch_seconds_total"] > 0


def test_split_placement_gives_identical_tokens_and_logprobs(server_runner, tmp_path_factory, device_answers):
    """One rank: the split group is this engine alone (2-rank splitting: tests/unit/engram)."""
    args = ("--hf-overrides", OVERRIDES, "--engram-placement", "split")
    with server_runner(tmp_path_factory.mktemp("engram-split"), *args) as s:
        assert _answers(s) == device_answers


def test_split_placement_over_two_tensor_parallel_ranks(server_runner, tmp_path_factory, device_answers):
    """`--tp-size 2` (gloo): each rank holds half the table's rows and the two sum their lookups on a
    group of their own (the lookup thread's all-reduce runs beside the model's; on the model's group the
    two ranks' collectives crossed and the engines aborted). Same text as one rank; the logprobs agree
    to float32 rounding (the model's all-reduces add in another order)."""
    args = ("--hf-overrides", OVERRIDES, "--engram-placement", "split", "--tp-size", "2")
    with server_runner(tmp_path_factory.mktemp("engram-split-tp"), *args) as s:
        got = _answers(s)
    assert [text for text, _ in got] == [text for text, _ in device_answers]
    for (_, lp), (_, want) in zip(got, device_answers, strict=True):
        assert np.allclose(lp, want, atol=1e-3)


def test_crashed_shard_fails_its_requests_then_serves_again(host_server, device_answers):
    """A shard killed between requests: the next request fails with a clear 503; the shard is
    restarted and requests succeed again with the same answers."""
    shards = [
        p for p in psutil.Process(host_server.proc.pid).children(recursive=True)
        if "runtime.actors.engram_shard" in " ".join(p.cmdline())
    ]  # fmt: skip
    assert len(shards) == 2
    shards[0].kill()
    shards[0].wait(10)
    client = openai.OpenAI(base_url=host_server.base_url, api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )
    assert err.value.status_code == 503 and "Engram shard" in str(err.value)
    deadline = time.monotonic() + 120
    while True:  # the restart takes a back-off and the shard's start-up; no event reaches the client
        try:
            answers = _answers(host_server)
            break
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and time.monotonic() < deadline, exc
            time.sleep(0.5)
    # the same text; logprobs to float32 rounding: the prompts now hit the radix cache (their first
    # answers cached them), so the prefill adds up in another order
    assert [t for t, _ in answers] == [t for t, _ in device_answers]
    for (_, got), (_, want) in zip(answers, device_answers, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)
    assert host_server.wait_idle()["conduit_engram_shard_restarts_total"] == 1
