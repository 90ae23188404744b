"""Token masks of constrained requests on the worker: the mask itself, the sampler under it, the
per-row matchers (advancing by tokens still on their way, replaying a retracted request's output), and
a real runner's overlapped steps (plan N+1 launched before step N's results are read)."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoTokenizer

from runtime.config import RunnerConfig
from runtime.gpu.grammar import GrammarTable, TokenMask
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.sampler import Sampler
from runtime.gpu.testing import PlanBuilder, copy_tokenizer, save_tiny_llama, seq_start
from runtime.mailbox.messages import GrammarSpec, SamplingParams, SeqStart
from runtime.structured.grammar import GrammarCompiler

VOCAB = 49152
EOS = 2
FOUR_DIGITS = GrammarSpec(kind="regex", spec="[0-9]{4}")


def bitmask_of(allowed: list[set[int]], vocab: int = VOCAB) -> torch.Tensor:
    words = torch.zeros(len(allowed), (vocab + 31) // 32, dtype=torch.int64)
    for i, tokens in enumerate(allowed):
        for t in tokens:
            words[i, t // 32] |= 1 << (t % 32)
    return words.to(torch.int32)  # two's complement: bit 31 set is a negative int32, as xgrammar writes it


def test_the_mask_sets_exactly_the_disallowed_tokens_of_its_rows_to_minus_infinity():
    logits = torch.randn(3, 100)
    allowed = [{0, 31, 32, 99}, {63}]  # bit 31 of a word (the sign bit) and the last word's tail
    out = TokenMask(torch.tensor([2, 0]), bitmask_of(allowed, 100)).apply(logits)
    assert torch.equal(out[1], logits[1])  # an unconstrained row is untouched
    for row, tokens in ((2, allowed[0]), (0, allowed[1])):
        finite = set(torch.isfinite(out[row]).nonzero().flatten().tolist())
        assert finite == tokens
        assert torch.equal(out[row, sorted(tokens)], logits[row, sorted(tokens)])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_sampler_draws_only_allowed_tokens(temperature):
    sampler = Sampler(max_rows=4, vocab_size=VOCAB, device="cpu")
    for row in (1, 2):
        sampler.register(SeqStart(row, SamplingParams(temperature=temperature, seed=row), [5], [], []))
    allowed = {7, 4000, 40000}
    rows = torch.tensor([1, 2])
    for _ in range(12):
        logits = torch.randn(2, VOCAB) * 5
        mask = TokenMask(torch.tensor([1]), bitmask_of([allowed]))
        result = sampler.sample(logits, [1, 2], rows, mask)
        assert result.tokens[1].item() in allowed
    # greedy under the mask is the best allowed token
    if temperature == 0.0:
        logits = torch.randn(2, VOCAB)
        result = sampler.sample(logits, [1, 2], rows, TokenMask(torch.tensor([1]), bitmask_of([allowed])))
        assert result.tokens[1].item() == max(allowed, key=lambda t: logits[1, t].item())
        assert result.tokens[0].item() == logits[0].argmax().item()


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path, local_files_only=True)


def allowed_text(table: GrammarTable, row: int, tokenizer) -> set[str]:
    mask = table.mask([row])
    logits = torch.zeros(1, VOCAB)
    ok = torch.isfinite(mask.apply(logits)[0]).nonzero().flatten().tolist()
    return {tokenizer.decode([t]) for t in ok}


def test_matchers_advance_by_pending_tokens_replay_retractions_and_end_at_eos(tokenizer):
    table = GrammarTable(lambda: GrammarCompiler(tokenizer, VOCAB, [EOS]), VOCAB, torch.device("cpu"))
    digit = {str(d): tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    table.add(1, FOUR_DIGITS, [])
    assert table.mask([5]) is None  # no constrained row in this batch
    first = allowed_text(table, 1, tokenizer)
    assert first and all(re.fullmatch(r"[0-9]{1,4}", t) for t in first)
    # three digits sampled over two steps, accepted only when the next mask is asked for
    table.sampled([1], torch.tensor([digit["1"]]))
    table.sampled([3, 1], torch.tensor([digit["9"], digit["2"]]))
    table.sampled([1], torch.tensor([digit["3"]]))
    assert allowed_text(table, 1, tokenizer) == {"0", "1", "2", "3", "4", "5", "6", "7", "8", "9"}
    table.sampled([1], torch.tensor([digit["4"]]))
    assert allowed_text(table, 1, tokenizer) == {tokenizer.decode([EOS])}  # complete: only the stop token
    table.sampled([1], torch.tensor([EOS]))
    mask = table.mask([1])  # terminated: anything (an overlap step's wasted token is dropped anyway)
    assert mask.bitmask.eq(-1).all()
    # a request re-admitted after a retraction continues from its earlier output
    table.add(2, FOUR_DIGITS, [digit["5"], digit["6"], digit["7"]])
    assert allowed_text(table, 2, tokenizer) == {"0", "1", "2", "3", "4", "5", "6", "7", "8", "9"}
    table.release(2)
    assert 2 not in table and table.mask([2]) is None


@pytest.fixture(scope="module")
def runner(tmp_path_factory, smollm2_path):
    path = tmp_path_factory.mktemp("tiny-vocab")
    save_tiny_llama(path, vocab_size=VOCAB, num_key_value_heads=2)
    copy_tokenizer(smollm2_path, path)
    return ModelRunner(RunnerConfig(str(path), num_kv_slots=512, max_reqs=4, max_model_len=64))


def test_overlapped_steps_keep_a_constrained_row_in_its_grammar_and_leave_the_others_alone(runner, tokenizer):
    prompts = {1: [3, 14, 15, 92, 65], 2: [35, 89, 79, 32, 38, 46, 26, 43]}

    def run(constrained: bool) -> dict[int, list[int]]:
        pb = PlanBuilder()
        sampled = SamplingParams(temperature=1.0, seed=7, grammar=FOUR_DIGITS if constrained else None)
        added = [seq_start(1, prompts[1], sampled, stop_ids=[EOS]), seq_start(2, prompts[2])]
        got: dict[int, list[int]] = {1: [], 2: []}
        pending = [runner.launch(pb.plan([1, 2], [0, 0], [5, 8], prompts[1] + prompts[2], added=added))]
        lens = {1: 5, 2: 8}
        for _ in range(5):  # plan N+1 goes in before step N's tokens are read, as with overlap on
            pending.append(
                runner.launch(pb.plan([1, 2], [lens[1], lens[2]], [1, 1], [], use_last=[True, True]))
            )
            lens = {r: n + 1 for r, n in lens.items()}
            out = pending.pop(0).result()
            for r, t in zip(out.rows, out.tokens, strict=True):
                got[r].append(t)
        out = pending.pop(0).result()
        for r, t in zip(out.rows, out.tokens, strict=True):
            got[r].append(t)
        runner.execute(pb.plan([], [], [], [], released=[1, 2]))
        return got

    free, constrained = run(False), run(True)
    text = tokenizer.decode(constrained[1][: constrained[1].index(EOS)])
    assert re.fullmatch(r"[0-9]{4}", text), constrained[1]
    assert not re.fullmatch(
        r"[0-9]+", tokenizer.decode(free[1][:2])
    )  # the random model alone makes no digits
    assert constrained[2] == free[2]  # the other row's greedy tokens are unchanged
