"""The batched sampler: greedy, truncation, penalties, min_tokens, seeds and logprobs."""

from __future__ import annotations

import torch

from runtime.gpu.sampler import Sampler
from runtime.gpu.testing import seq_start
from runtime.mailbox.messages import SamplingParams as P

V = 32


def make(params_by_row: dict[int, P], prompts: dict[int, list[int]] | None = None, stops=None) -> Sampler:
    s = Sampler(max_rows=8, vocab_size=V, device="cpu", seed=0)
    for row, p in params_by_row.items():
        s.register(seq_start(row, (prompts or {}).get(row, []), p, (stops or {}).get(row, ())))
    return s


def sample(s: Sampler, logits: torch.Tensor, rows: list[int]):
    return s.sample(logits, rows, torch.tensor(rows))


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    s = make({1: P(temperature=0.0), 2: P(top_k=1, temperature=1.5), 3: P(temperature=0.0, top_p=0.1)})
    out = sample(s, logits, [1, 2, 3])
    assert out.tokens.tolist() == logits.argmax(-1).tolist()


def test_greedy_and_sampled_rows_mix_in_one_batch():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    s = make({1: P(temperature=0.0), 2: P(temperature=1.0)})
    assert sample(s, logits, [1, 2]).tokens[0] == logits[0].argmax()


def test_same_seed_gives_same_tokens_regardless_of_batch_neighbours():
    g = torch.Generator().manual_seed(2)
    steps = [torch.randn(4, V, generator=g) for _ in range(6)]
    seeded = P(temperature=1.0, seed=1234)

    alone = make({5: seeded})
    crowd = make({1: P(temperature=1.0), 2: P(temperature=0.7, seed=9), 5: seeded, 7: P(top_p=0.9)})
    a = [sample(alone, x[2:3], [5]).tokens.item() for x in steps]
    b = [sample(crowd, x, [1, 2, 5, 7]).tokens[2].item() for x in steps]
    assert a == b
    # and a different seed gives a different stream (flat-ish logits make a collision very unlikely)
    other = make({5: P(temperature=1.0, seed=4321)})
    assert [sample(other, x[2:3], [5]).tokens.item() for x in steps] != a


def test_top_p_and_min_p_never_pick_outside_the_allowed_set():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.05] + [0.05 / (V - 4)] * (V - 4))
    logits = probs.log().repeat(4, 1)
    # top_p=0.7: nucleus {0, 1}; min_p=0.25: keep p >= 0.125 -> {0, 1}; top_k=3 -> {0, 1, 2}; top_k=3 then top_p=0.8 of the renormalized top 3 -> {0, 1}
    s = make({1: P(top_p=0.7), 2: P(min_p=0.25), 3: P(top_k=3), 4: P(top_k=3, top_p=0.8)})
    seen = {1: set(), 2: set(), 3: set(), 4: set()}
    for _ in range(300):
        for row, tok in zip([1, 2, 3, 4], sample(s, logits, [1, 2, 3, 4]).tokens.tolist(), strict=True):
            seen[row].add(tok)
    assert seen[1] == {0, 1}
    assert seen[2] == {0, 1}
    assert seen[3] == {0, 1, 2}
    assert seen[4] == {0, 1}


def test_top_k_only_batches_take_the_partial_sort_path_and_stay_in_the_top_k():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    s = make({1: P(top_k=2), 2: P(top_k=5, top_p=0.9), 3: P(temperature=0.0)})
    allowed = [set(logits[0].topk(2).indices.tolist()), set(logits[1].topk(5).indices.tolist())]
    for _ in range(200):
        toks = sample(s, logits, [1, 2, 3]).tokens.tolist()
        assert toks[0] in allowed[0] and toks[1] in allowed[1] and toks[2] == logits[2].argmax()


def test_sampling_follows_the_softmax_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0] + [-30.0] * (V - 3)]).repeat(8, 1)
    s = make({r: P(temperature=1.0) for r in range(1, 9)})
    n = 400
    counts = torch.zeros(V)
    for _ in range(n):
        counts += torch.bincount(sample(s, logits, list(range(1, 9))).tokens, minlength=V)
    freq = counts[:3] / counts.sum()
    torch.testing.assert_close(freq, torch.softmax(logits[0, :3], -1), atol=0.03, rtol=0)


def test_repetition_frequency_presence_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0] + [0.0] * (V - 4)])
    # row 1: prompt has token 0 and 1; repetition 2.0
    s = make({1: P(temperature=0.0, repetition_penalty=2.0)}, prompts={1: [0, 1]})
    got = s._penalize(logits, s.table[torch.tensor([1])], torch.tensor([1]), [s.rows[1]])
    expected = logits.clone()
    expected[0, 0] = 2.0 / 2.0
    expected[0, 1] = -1.0 * 2.0
    torch.testing.assert_close(got, expected)

    # row 2: frequency 0.5, presence 0.25, over outputs only (prompt tokens don't count)
    s = make({2: P(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25)}, prompts={2: [2]})
    for tok in (3, 3, 0):  # outputs, as if sampled
        sample(s, torch.nn.functional.one_hot(torch.tensor([tok]), V).float() * 100, [2])
    got = s._penalize(logits, s.table[torch.tensor([2])], torch.tensor([2]), [s.rows[2]])
    expected = logits.clone()
    expected[0, 3] -= 0.5 * 2 + 0.25
    expected[0, 0] -= 0.5 * 1 + 0.25
    torch.testing.assert_close(got, expected)


def test_min_tokens_bans_stop_ids_until_reached():
    logits = torch.zeros(1, V)
    logits[0, 2] = 10.0  # the stop token is by far the best
    s = make({1: P(temperature=0.0, min_tokens=3)}, stops={1: [2, 5]})
    toks = [sample(s, logits, [1]).tokens.item() for _ in range(4)]
    assert toks[:3] != [2, 2, 2] and 2 not in toks[:3] and 5 not in toks[:3]
    assert toks[3] == 2


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    s = make({1: P(temperature=0.0, logprobs=3, repetition_penalty=1.5), 2: P(temperature=0.0)}, {1: [0]})
    out = sample(s, logits, [1, 2])
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.tokens[:, None]).squeeze(1))
    top, ids = ref[0].topk(3)
    assert out.top_ids[0].tolist() == ids.tolist()
    torch.testing.assert_close(out.top_logprobs[0], top)
    assert out.top_counts == [3, 0]


def test_released_row_state_is_reset_on_reregistration():
    s = make({1: P(temperature=0.0, frequency_penalty=1.0)})
    sample(s, torch.nn.functional.one_hot(torch.tensor([4]), V).float() * 100, [1])
    s.release(1)
    s.register(seq_start(1, [], P(temperature=0.0, frequency_penalty=1.0)))
    assert int(s.counts[1].sum()) == 0 and s.rows[1].n_out == 0


# ---------------------------------------------------------------- re-admission after a retraction

RESUMED = P(
    temperature=1.0,
    top_p=0.95,
    seed=77,
    repetition_penalty=1.5,
    frequency_penalty=0.5,
    presence_penalty=0.3,
    min_tokens=6,
)


def test_a_row_restarted_with_its_outputs_samples_like_a_row_that_never_stopped():
    g = torch.Generator().manual_seed(11)
    steps = [torch.randn(2, V, generator=g) * 2 for _ in range(12)]
    steps = [x[[0, 0, 1]] for x in steps]  # both request rows see the same logits; a neighbour others
    for x in steps:
        x[:, 3] += 3.0  # the stop token is likely: the min_tokens ban decides
    prompt, stops = [0, 1, 2, 5], [3]
    s = make({1: RESUMED, 2: RESUMED, 4: P(temperature=1.0)}, {1: prompt, 2: prompt}, {1: stops, 2: stops})
    never, restarted, penalized = [], [], []
    for i, x in enumerate(steps):
        if i == 4:  # row 2 is retracted and comes back in row 6 with what it had generated
            s.release(2)
            s.register(seq_start(6, prompt, RESUMED, stops, output_ids=restarted))
        rows = [1, 2 if i < 4 else 6, 4]
        rows_t = torch.tensor(rows)
        penalized.append(s._penalize(x, s.table[rows_t], rows_t, [s.rows[r] for r in rows]))
        toks = sample(s, x, rows).tokens.tolist()
        never.append(toks[0])
        restarted.append(toks[1])
    assert restarted == never
    for p in penalized:  # both rows saw the same logits, so their penalized logits must agree exactly
        assert torch.equal(p[0], p[1])
    assert torch.equal(s.counts[1], s.counts[6]) and s.rows[6].n_out == len(steps)
    assert 3 not in never[:6]  # banned until min_tokens

    # without its outputs, the restarted row would draw, penalize and ban differently
    fresh = make({1: RESUMED}, {1: prompt}, {1: stops})
    assert [sample(fresh, x[:1], [1]).tokens.item() for x in steps[4:]] != never[4:]


def test_min_tokens_counts_the_outputs_before_a_retraction():
    logits = torch.zeros(1, V)
    logits[0, 2] = 10.0  # the stop token is by far the best
    s = Sampler(max_rows=8, vocab_size=V, device="cpu")
    s.register(seq_start(1, [], P(temperature=0.0, min_tokens=5), [2], output_ids=[7, 8, 9]))
    assert [sample(s, logits, [1]).tokens.item() for _ in range(3)] == [0, 0, 2]


def test_seeded_rows_follow_the_softmax_distribution():
    # each draw has its own seed (seed, token index): the draws must still be softmax samples
    logits = torch.tensor([[2.0, 1.0, 0.0] + [-30.0] * (V - 3)]).repeat(8, 1)
    s = make({r: P(temperature=1.0, seed=r) for r in range(1, 9)})
    counts = torch.zeros(V)
    for _ in range(150):
        counts += torch.bincount(sample(s, logits, list(range(1, 9))).tokens, minlength=V)
    freq = counts[:3] / counts.sum()
    torch.testing.assert_close(freq, torch.softmax(logits[0, :3], -1), atol=0.04, rtol=0)


def test_bf16_logits_greedy_argmax_as_is_and_everything_else_in_float32():
    """The CUDA graphs hand the sampler bf16 logits (Llama): greedy rows take the argmax unwidened,
    sampled rows, penalties and logprobs compute on the float32 widening."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(7)).bfloat16()
    widened = logits.float()
    greedy = make({1: P(temperature=0.0), 2: P(temperature=0.0), 3: P(top_k=1)})
    assert sample(greedy, logits, [1, 2, 3]).tokens.tolist() == widened.argmax(-1).tolist()
    with_logprobs = make({1: P(temperature=0.0, logprobs=2)})
    out = sample(with_logprobs, logits[:1], [1])
    assert out.logprobs.dtype == torch.float32
    assert torch.allclose(out.logprobs, torch.log_softmax(widened[:1], -1).max(-1).values)
    mixed = make({1: P(temperature=0.0), 2: P(temperature=1.0, top_p=0.9), 3: P(repetition_penalty=1.3)})
    tokens = sample(mixed, logits, [1, 2, 3]).tokens
    assert tokens[0] == widened[0].argmax() and ((0 <= tokens) & (tokens < V)).all()


def test_min_tokens_yields_to_a_grammar_that_allows_only_a_stop_token():
    """Structured output whose answer is complete allows only the stop token: min_tokens' ban would leave
    the row no token at all (an argmax over -inf everywhere picks token 0, outside the grammar), so the
    row ends instead; rows with another allowed token keep the ban."""
    from runtime.gpu.grammar import TokenMask

    words = (V + 31) // 32
    bitmask = torch.zeros(2, words, dtype=torch.int32)
    bitmask[0, 0] = 1 << 2  # row 1: only the stop token 2
    bitmask[1, 0] = (1 << 2) | (1 << 7)  # row 3: the stop token or token 7
    mask = TokenMask(torch.tensor([0, 1]), bitmask)
    logits = torch.zeros(2, V)
    logits[:, 2] = 10.0
    s = make(
        {1: P(temperature=0.0, min_tokens=5), 3: P(temperature=0.0, min_tokens=5)}, stops={1: [2], 3: [2]}
    )
    assert s.sample(logits, [1, 3], torch.tensor([1, 3]), mask).tokens.tolist() == [2, 7]
