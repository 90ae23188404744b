from __future__ import annotations

import pytest

from loadgen.metrics import Metrics, compute, tpot_s
from loadgen.records import RequestResult


def _req(i, start, ttft, itl, out, prompt=10, success=True) -> RequestResult:
    e2e = ttft + sum(itl)
    return RequestResult(index=i, input_len=prompt, output_len_requested=out, success=success, start_s=start,
                         end_s=start + e2e, e2e_s=e2e, ttft_s=ttft, itl_s=list(itl), prompt_tokens=prompt,
                         completion_tokens=out, output_chunks=len(itl) + 1)  # fmt: skip


def test_metrics_math_on_hand_made_results():
    rs = [
        _req(0, 0.0, 0.1, [0.02, 0.02, 0.02], 4),  # e2e 0.16
        _req(1, 0.5, 0.3, [0.04], 2),  # e2e 0.34
        _req(2, 1.0, 0.2, [], 1),  # e2e 0.2, no TPOT
        _req(3, 1.0, 0.0, [], 5, success=False),
    ]
    m = compute(rs, duration_s=2.0)
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_output_tokens == 7 and m.total_input_tokens == 30
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.5)
    assert m.total_throughput == pytest.approx(18.5)
    assert m.concurrency == pytest.approx((0.16 + 0.34 + 0.2) / 2.0)
    assert m.ttft_ms.mean == pytest.approx(200.0)
    assert m.ttft_ms.median == pytest.approx(200.0)
    assert m.ttft_ms.max == pytest.approx(300.0)
    assert m.itl_ms.mean == pytest.approx(25.0)
    # TPOT = (e2e - ttft) / (out - 1): 0.06/3 and 0.04/1
    assert m.tpot_ms.mean == pytest.approx((20.0 + 40.0) / 2)
    assert m.e2e_ms.max == pytest.approx(340.0)
    assert tpot_s(rs[2]) is None
    for r in rs[:3]:
        assert r.ttft_s <= r.e2e_s


def test_percentiles_interpolate_like_numpy():
    rs = [_req(i, 0.0, (i + 1) / 1000, [], 1) for i in range(100)]  # TTFT 1..100 ms
    m = compute(rs, 1.0)
    assert m.ttft_ms.median == pytest.approx(50.5)
    assert m.ttft_ms.p90 == pytest.approx(90.1)
    assert m.ttft_ms.p99 == pytest.approx(99.01)
    assert m.ttft_ms.max == pytest.approx(100.0)


def test_no_successes_gives_zeros_not_errors():
    m = compute([_req(0, 0, 0, [], 3, success=False)], 1.0)
    assert m.completed == 0 and m.ttft_ms.mean == 0.0


def test_metrics_round_trip_through_json():
    m = compute([_req(0, 0.0, 0.1, [0.02], 2)], 1.0)
    assert Metrics.from_json(m.to_json()) == m


def test_token_mismatch_counts_requests_whose_usage_differs_from_retokenization():
    a, b = _req(0, 0, 0.1, [0.1], 2), _req(1, 0, 0.1, [0.1], 2)
    a.retokenized_output_tokens, b.retokenized_output_tokens = 2, 3
    m = compute([a, b], 1.0)
    assert m.retokenized_output_tokens == 5 and m.token_mismatches == 1
