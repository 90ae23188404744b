"""The device-side pieces of speculative decoding on their own: acceptance of sampled blocks, n-gram
lookup over each row's token history, and the scheduler's draft-length policy."""

from __future__ import annotations

import torch

from runtime.mailbox.messages import SamplingParams, SeqStart
from runtime.speculative.drafter import StepTokens
from runtime.speculative.ngram import NgramDrafter
from runtime.speculative.policy import DraftPolicy, SpecState
from runtime.speculative.verify import accept


def test_accept_keeps_the_longest_matching_prefix_and_the_sample_after_it():
    # row 0: 3 drafts, samples match the first two -> emits s0, s1, s2; row 1: plain (no drafts);
    # row 2: 2 drafts, the first rejected -> emits s0 only; row 3: all 2 accepted -> 3 tokens
    samples = torch.tensor([5, 6, 9, 4, 11, 7, 8, 20, 21, 22])
    block_start = torch.tensor([0, 4, 5, 7])
    drafts = torch.tensor([[5, 6, 7], [0, 0, 0], [1, 8, 0], [20, 21, 0]])
    draft_lens = torch.tensor([3, 0, 2, 2])
    tokens, counts, index = accept(samples, block_start, drafts, draft_lens)
    assert counts.tolist() == [3, 1, 1, 3]
    got = [tokens[i, :c].tolist() for i, c in enumerate(counts.tolist())]
    assert got == [[5, 6, 9], [11], [7], [20, 21, 22]]
    assert index[0, :3].tolist() == [0, 1, 2] and index[3, :3].tolist() == [7, 8, 9]


def start(row: int, ids: list[int]) -> SeqStart:
    return SeqStart(row, SamplingParams(temperature=0), ids, [], [])


def test_ngram_drafts_the_continuation_of_the_latest_longest_match():
    d = NgramDrafter(3, rows=4, max_len=64, device=torch.device("cpu"), min_n=1, max_n=3)
    # row 1: "1 2 3 4 9 1 2 3 5 ... 1 2 3" -> the latest "1 2 3" is followed by 5 6 7
    d.register(start(1, [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 8, 1, 2]))
    # row 2: no token repeats -> no drafts
    d.register(start(2, [10, 11, 12]))
    step = StepTokens(torch.tensor([1, 2]), torch.tensor([[3, 0], [13, 14]]), torch.tensor([1, 2]))
    drafts = d.observe(step)
    assert drafts.counts.tolist() == [3, 0]
    assert drafts.tokens[0].tolist() == [5, 6, 7]
    assert (
        d.history.length[1].item() == 15 and d.history.length[2].item() == 5
    )  # the emitted tokens were appended
    assert d.history.ids[2, :5].tolist() == [10, 11, 12, 13, 14]


def test_ngram_match_near_the_end_proposes_only_what_follows_it():
    d = NgramDrafter(4, rows=2, max_len=32, device=torch.device("cpu"), min_n=2, max_n=2)
    d.register(start(1, [7, 8, 9, 7]))
    drafts = d.observe(StepTokens(torch.tensor([1]), torch.tensor([[8]]), torch.tensor([1])))
    assert drafts.counts.tolist() == [3] and drafts.tokens[0, :3].tolist() == [9, 7, 8]


def test_policy_verifies_fewer_drafts_under_load_and_switches_off_when_they_fail():
    policy = DraftPolicy(max_draft=4)
    s = SpecState()
    policy.drafts(s, 4, [1.0, 1.0, 1.0, 1.0])
    idle, busy = policy.draft_len(s, 1, 10), policy.draft_len(s, 1024, 10)
    assert idle > busy >= 0
    assert policy.draft_len(s, 1, 2) <= 2  # never past the request's limit
    while not s.off_steps:  # every draft rejected
        policy.observe(s, policy.draft_len(s, 1, 10), 0)
    off = s.off_steps
    assert all(policy.draft_len(s, 1, 10) == 0 for _ in range(off))
    assert policy.draft_len(s, 1, 10) == 1  # the probe after the cooldown
    policy.observe(s, 1, 0)
    assert s.off_steps == 2 * off  # failing again doubles the cooldown
    for _ in range(s.off_steps):
        policy.draft_len(s, 1, 10)
    policy.observe(s, policy.draft_len(s, 1, 10), 1)  # the probe's draft accepted: back to speculating
    assert s.off_steps == 0 and s.cooldown == 0 and policy.draft_len(s, 1, 10) >= 1


def test_each_further_draft_counts_in_the_load_it_is_judged_at():
    """Draft j is judged at the step every row verifying j drafts would make: where a few tokens already
    cost compute (one CPU thread: full load at 4 tokens) a request at the prior estimate verifies one
    draft, where the step stays bound by the weights' reads (a GPU at one row) it verifies four, and a
    request whose drafts keep being accepted verifies them all in both."""
    certain = [1.0] * 4
    for full_load, prior_k in [(4, 1), (256, 4)]:
        policy = DraftPolicy(max_draft=4, full_load_tokens=full_load)
        s = SpecState()
        policy.drafts(s, 4, certain)
        assert policy.draft_len(s, 1, 10) == prior_k
        s.acceptance = 0.9
        assert policy.draft_len(s, 1, 10) == 4
    policy = DraftPolicy(max_draft=4, full_load_tokens=256)
    s = SpecState()
    policy.drafts(s, 4, certain)
    assert policy.draft_len(s, 64, 10) == 1  # 64 rows: the second draft would make the step 192 tokens


def test_drafts_are_made_only_where_they_may_be_verified():
    """`wants_drafts` (StepPlan.propose): no drafting through a cooldown nor while a request's estimate
    is below the load's threshold, but the probe after a cooldown finds drafts even when each plan goes
    out before the previous step's drafts reach the host (overlap: a plan sees the drafts made two
    steps back)."""
    policy = DraftPolicy(max_draft=3, full_load_tokens=64)
    s = SpecState()
    assert policy.wants_drafts(s, 1)  # a new request: the prior estimate
    s.acceptance = 0.3
    assert policy.wants_drafts(s, 1) and not policy.wants_drafts(s, 64)  # threshold 0.6 at full load
    for _ in range(4):  # every draft rejected: a cooldown starts
        policy.observe(s, 1, 0)
    assert s.off_steps > 1
    made = []  # per plan: drafts the step it plans makes (3 when asked for, else none)
    verified = []
    for step in range(s.off_steps + 3):
        s.available = made[step - 2] if step >= 2 else 0  # overlap: the drafts of two steps back
        verified.append(policy.draft_len(s, 1, 10))
        made.append(3 if policy.wants_drafts(s, 1) else 0)
    assert verified[-3:].count(1) == 1 and sum(verified) == 1  # the probe, with drafts to verify
    assert made.count(3) <= 3  # drafting only around the probe, not through the cooldown


def test_a_drafter_that_finds_nothing_stops_looking_for_a_growing_cooldown():
    """Text that never repeats gives the n-gram drafter nothing to propose, so no draft is verified and
    the estimate never moves: `min_evidence` empty lookups in a row start a cooldown instead (no drafting
    through it), after which the drafter looks again, and a longer cooldown follows more empty ones."""
    policy = DraftPolicy(max_draft=3)
    s = SpecState()
    lookups = 0
    cooldowns = []
    for _ in range(200):
        policy.draft_len(s, 1, 10)
        if policy.wants_drafts(s, 1):
            lookups += 1
            was_off = s.off_steps
            policy.drafts(s, 0, [])
            if s.off_steps > was_off:
                cooldowns.append(s.off_steps)
    assert cooldowns[:3] == [policy.first_cooldown, 2 * policy.first_cooldown, 4 * policy.first_cooldown]
    assert lookups < 40  # of 200 steps
    policy.drafts(s, 2, [1.0, 1.0])  # something to draft again: the count of empty lookups restarts
    assert s.dry == 0 and s.available == 2


def test_the_fixed_policy_verifies_every_draft_held():
    """`--speculative-draft-policy fixed`: all the drafts the drafter holds, up to the most and the
    request's limit, whatever the estimate, the load or a run of rejections."""
    policy = DraftPolicy(max_draft=3, full_load_tokens=4, fixed=True)
    s = SpecState()
    policy.drafts(s, 4, [0.01] * 4)
    for _ in range(10):
        assert policy.draft_len(s, 64, 10) == 3 and policy.wants_drafts(s, 64)
        policy.observe(s, 3, 0)
    assert policy.draft_len(s, 1, 2) == 2
    policy.drafts(s, 1, [0.01])
    assert policy.draft_len(s, 1, 10) == 1
