"""The MLA prefill op on the CPU (`mla_prefill`): the reference equals causal SDPA row by row; the MLA
backends' batched prefill equals the old row-by-row expanded attention; the Triton kernel matches the
reference under the Triton interpreter (in a subprocess, as in test_kernels_interpret.py: this file run
as a script with TRITON_INTERPRET=1 prints {case: closeness ratio}). Shapes are tiny: d_qk 24 = 16 + 8
splits like DeepSeek's 192 = 128 + 64, and d_v differs from it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.gpu.kernels import registry
from runtime.gpu.kernels.mla_prefill import reference
from runtime.gpu.kernels.mla_prefill.testing import prefill_case
from runtime.gpu.kernels.testing import InterpreterCases, close_ratio

CASES = InterpreterCases()
case = CASES.case


def _sdpa_rows(c) -> torch.Tensor:
    """Each row on its own: SDPA with the causal mask shifted by the row's prefix."""
    out = torch.zeros(c.q.shape[0], c.q.shape[1], c.v.shape[2], dtype=torch.float64)
    cols = (c.q_starts.tolist(), c.q_lens.tolist(), c.kv_starts.tolist(), c.kv_lens.tolist())
    for qs, n, ks, m in zip(*cols, strict=True):
        q = c.q[qs : qs + n].double().transpose(0, 1)
        k, v = (t[ks : ks + m].double().transpose(0, 1) for t in (c.k, c.v))
        mask = torch.arange(m)[None, :] <= (m - n + torch.arange(n))[:, None]
        out[qs : qs + n] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=c.scale).transpose(
            0, 1
        )
    return out


@pytest.mark.parametrize(
    ("prefix", "q_lens", "heads", "d_qk", "d_v"),
    [([0], [1], 2, 24, 16), ([0, 5, 30, 0], [9, 1, 20, 3], 3, 24, 16), ([100], [70], 2, 48, 40)],
)
def test_reference_equals_causal_sdpa_row_by_row(prefix, q_lens, heads, d_qk, d_v, monkeypatch) -> None:
    monkeypatch.setattr(reference, "SCORES_BUDGET", 4 * heads * 170 * 16)  # long rows in query chunks
    c = prefill_case(prefix, q_lens, heads, d_qk, d_v, torch.float32, "cpu", seed=len(q_lens), strided=True)
    got = reference.mla_prefill(*c.args())
    want = _sdpa_rows(c)
    torch.testing.assert_close(got[c.row_tokens].double(), want[c.row_tokens], atol=1e-5, rtol=1e-5)


def test_reference_leaves_tokens_of_no_row_alone() -> None:
    c = prefill_case([3, 0], [4, 2], 2, 24, 16, torch.float32, "cpu")
    out = torch.full((c.q.shape[0], 2, 16), 7.0)
    reference.mla_prefill(*c.args(), out=out)
    others = torch.ones(c.q.shape[0], dtype=torch.bool)
    others[c.row_tokens] = False
    assert others.any() and (out[others] == 7.0).all() and out[c.row_tokens].isfinite().all()


def test_registry_picks_the_reference_on_the_cpu() -> None:
    assert registry.op("mla_prefill").select("cpu").name == "reference"
    assert [i.name for i in registry.op("mla_prefill").implementations()] == ["triton", "reference"]


@pytest.mark.parametrize("calls", [1, 2])
def test_backend_prefills_in_one_call_equal_the_row_by_row_expanded_form(calls: int, monkeypatch) -> None:
    """A fresh prompt, a row with a cached prefix and a decode token between them: the rows' latents
    expanded together and attended by one op call give what `mla_expanded` gives row by row (with the
    prefix-shifted causal mask the backend used to build); so do two calls, when the expanded K/V of both
    rows would not fit EXPANDED_ELEMENTS."""
    from runtime.gpu.attention.torch_ref import _Prefill
    from runtime.gpu.models.deepseek_v3 import attention_ref as mla_ref
    from runtime.gpu.models.deepseek_v3.attention_ref import TorchMLABackend, mla_expanded

    if calls == 2:
        monkeypatch.setattr(mla_ref, "EXPANDED_ELEMENTS", 11 * 3 * (24 + 12))  # the second row alone

    g = torch.Generator().manual_seed(0)
    heads, dn, dr, dv, r = 3, 16, 8, 12, 20
    tokens, num_slots = 7 + 1 + 5, 40
    q_nope, q_pe = torch.randn(tokens, heads, dn, generator=g), torch.randn(tokens, heads, dr, generator=g)
    latent = torch.randn(tokens, 1, r + dr, generator=g)
    pool = torch.randn(num_slots, r + dr, generator=g)
    slots = torch.randperm(num_slots, generator=g)[:11]  # 6 cached + this step's 5
    pool[slots[6:]] = latent[8:, 0]
    w = torch.randn(heads, dn + dv, r, generator=g) / r**0.5
    w_uk, w_uv = w[:, :dn], w[:, dn:]  # views, as DeepseekV3Attention.up_projections gives them
    mask = torch.arange(11)[None, :] <= (6 + torch.arange(5))[:, None]
    prefills = [_Prefill(0, 7, 0, None, None), _Prefill(8, 5, 6, slots, mask)]
    backend = TorchMLABackend(heads, r, dr, 0.25, qk_nope_dim=dn, v_dim=dv)
    out = torch.full((tokens, heads, dv), 3.0)
    groups = backend.group_prefills(prefills, torch.device("cpu"))
    assert [len(g.rows) for g in groups] == ([2] if calls == 1 else [1, 1])
    backend.forward_prefills(groups, q_nope, q_pe, latent, pool, w_uk, w_uv, out)
    fresh = mla_expanded(q_nope[:7], q_pe[:7], latent[:7, 0], w_uk, w_uv, 0.25, causal=True)
    cached = mla_expanded(q_nope[8:], q_pe[8:], pool[slots], w_uk, w_uv, 0.25, mask)
    torch.testing.assert_close(out[:7], fresh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[8:], cached, atol=1e-5, rtol=1e-5)
    assert (out[7] == 3.0).all()  # the decode token is not a prefill row's


# ------------------------------------------------------------------ Triton under the interpreter


def _kernel(prefix, q_lens, heads, d_qk, d_v, dtype, max_q_len=True, **kw) -> float:
    from runtime.gpu.kernels.mla_prefill import triton

    c = prefill_case(prefix, q_lens, heads, d_qk, d_v, dtype, "cpu", seed=len(CASES), **kw)
    args = c.args() if max_q_len else (*c.args()[:-1], None)
    out = torch.zeros(c.q.shape[0], heads, d_v, dtype=dtype)  # tokens of no row stay 0 in both
    got = triton.mla_prefill(*args, out=out)
    want = reference.mla_prefill(*c.args(), out=torch.zeros_like(out))
    tol = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2)}[dtype]  # interpreter bf16 truncates
    return close_ratio(got, want, *tol)


@case
def fp32_fresh_prefixed_and_one_token_rows_dqk24_dv16():
    return _kernel([0, 5, 21, 0], [9, 1, 40, 1], 2, 24, 16, torch.float32)


@case
def bf16_prefixed_rows_dqk48_dv32():
    return _kernel([37, 0, 2], [18, 33, 1], 2, 48, 32, torch.bfloat16)


@case
def fp32_pow2_dqk32_padded_dv24_strided_v_grid_over_all_tokens():
    return _kernel([16, 3], [17, 30], 1, 32, 24, torch.float32, max_q_len=False, strided=True)


@case
def bf16_small_dims_dqk12_dv8_padded_to_16():
    return _kernel([50], [3], 2, 12, 8, torch.bfloat16)


test_triton_mla_prefill_matches_reference_under_interpreter = CASES.pytest_test(__file__)


if __name__ == "__main__":
    CASES.main()
