"""The exchange through DeepEP's `Buffer` (deepseek-ai/DeepEP): its normal kernels (`dispatch` /
`combine`, a token sent once to each rank holding any of its experts, prefill) and low-latency kernels
(`low_latency_dispatch` / `low_latency_combine`: fixed per-expert receive buffers, no host sync, CUDA
graph safe; decode). Expert ids are physical slots: DeepEP's experts are contiguous per rank, as our
slots are. One buffer per mode and hidden size, made on first use over the EP group.

`use_buffer_class` swaps in a stand-in with the same methods (the CPU test runs this adapter over gloo
with `runtime/gpu/testing/fake_deep_ep.py`)."""

from __future__ import annotations

import importlib

import torch

from runtime.gpu import distributed
from runtime.gpu.kernels.moe_exchange import Experts, stand_in

LOW_LATENCY_TOKENS = 256  # DeepEP's num_max_dispatch_tokens_per_rank: fixed per low-latency buffer

_buffers: dict[tuple, object] = {}


def use_buffer_class(cls) -> None:  # noqa: ANN001
    """The Buffer class to use (None: `deep_ep.Buffer`); drops the buffers made so far. Call
    `MOE_EXCHANGE.clear_cache()` after, so the op chooses again."""
    stand_in.install(cls)
    _buffers.clear()


def _buffer(low_latency: bool, hidden: int, itemsize: int, num_experts: int):  # noqa: ANN202
    key = (low_latency, hidden, itemsize, num_experts)
    if key not in _buffers:
        cls = stand_in.buffer_class or importlib.import_module("deep_ep").Buffer
        group = distributed.ep()
        if low_latency:
            rdma = cls.get_low_latency_rdma_size_hint(LOW_LATENCY_TOKENS, hidden, group.size, num_experts)
            _buffers[key] = cls(
                group.handle, 0, rdma, low_latency_mode=True, num_qps_per_rank=num_experts // group.size
            )
        else:
            nvl = 0
            for config in (cls.get_dispatch_config(group.size), cls.get_combine_config(group.size)):
                nvl = max(nvl, config.get_nvl_buffer_size_hint(hidden * itemsize, group.size))
            _buffers[key] = cls(group.handle, nvl, 0)
    return _buffers[key]


def exchange(
    x: torch.Tensor,
    weights: torch.Tensor,
    slots: torch.Tensor,
    per_rank: int,
    experts: Experts,
    max_tokens: int,
    low_latency: bool,
) -> torch.Tensor:
    group = distributed.ep()
    # nothing to exchange (DeepEP needs a group of ranks); or fixed blocks larger than the low-latency
    # buffer holds (a verify graph's bucket x (K + 1) tokens): all_to_all_single's blocks, capturable too
    if group.size == 1 or (low_latency and max_tokens > LOW_LATENCY_TOKENS):
        from runtime.gpu.kernels.moe_exchange.reference import exchange as plain

        return plain(x, weights, slots, per_rank, experts, max_tokens, low_latency)
    num_experts, d = per_rank * group.size, x.shape[1]
    if low_latency:
        buf = _buffer(True, d, x.element_size(), num_experts)
        recv, counts, handle, _, _ = buf.low_latency_dispatch(
            x, slots, LOW_LATENCY_TOKENS, num_experts, use_fp8=False
        )
        local, rows, _ = recv.shape  # [local experts, ranks * LOW_LATENCY_TOKENS, D]
        ids = torch.arange(local, device=x.device).repeat_interleave(rows)
        used = torch.arange(rows, device=x.device)[None, :] < counts[:, None]  # rows holding a token
        y = experts(recv.reshape(-1, d), used.reshape(-1, 1).float(), ids[:, None])
        out, _, _ = buf.low_latency_combine(y.view(local, rows, d), slots, weights.float(), handle)
        return out.to(x.dtype)
    buf = _buffer(False, d, x.element_size(), num_experts)
    per_rank_tokens, per_rdma_tokens, per_expert, in_rank, _ = buf.get_dispatch_layout(slots, num_experts)
    recv, recv_ids, recv_w, _, handle, _ = buf.dispatch(
        x, topk_idx=slots, topk_weights=weights.float(), num_tokens_per_rank=per_rank_tokens,
        num_tokens_per_rdma_rank=per_rdma_tokens, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
    )  # fmt: skip
    # a received token's pairs: local expert ids, or -1 for pairs another rank holds
    here = recv_ids >= 0
    y = experts(recv, torch.where(here, recv_w, 0.0), recv_ids.clamp(min=0)) if recv.shape[0] else recv
    out, _, _ = buf.combine(y, handle)
    return out.to(x.dtype)
