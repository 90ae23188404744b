"""A CPU stand-in for `deep_ep.Buffer` with the methods and results the adapter
(`runtime/gpu/kernels/moe_exchange/deep_ep.py`) uses, built from gloo collectives and Python loops:
small and slow, for testing the adapter's bookkeeping on CPU ranks. What it mimics, as DeepEP documents:
normal `dispatch` sends a token once to each rank holding any of its experts, with its top-k ids made
local there (-1 for another rank's), and `combine` sums what the ranks send back per token;
`low_latency_dispatch` packs each local expert's received tokens at the front of a
[local experts, ranks * max tokens, D] buffer with their count, and `low_latency_combine` weights each
returned row by its pair's top-k weight and sums per token."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _Config:
    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


def _a2a_list(parts: list[torch.Tensor], group) -> list[torch.Tensor]:  # noqa: ANN001
    """Send parts[r] to rank r; returns what each rank sent here (any first-dim sizes)."""
    size = dist.get_world_size(group)
    send = torch.tensor([p.shape[0] for p in parts], dtype=torch.int64)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    flat = torch.cat(parts) if parts else parts
    out = flat.new_empty((int(recv.sum()), *flat.shape[1:]))
    dist.all_to_all_single(out, flat.contiguous(), recv.tolist(), send.tolist(), group=group)
    return list(out.split(recv.tolist())) if size else []


class FakeBuffer:
    def __init__(self, group, num_nvl_bytes: int, num_rdma_bytes: int, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 1) -> None:  # noqa: ANN001 # fmt: skip
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.low_latency_mode = low_latency_mode

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> _Config:
        return _Config()

    @staticmethod
    def get_combine_config(num_ranks: int) -> _Config:
        return _Config()

    @staticmethod
    def get_low_latency_rdma_size_hint(max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> int:
        return 0

    # ------------------------------------------------------------------ normal

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):  # noqa: ANN201
        per = num_experts // self.size
        in_rank = torch.zeros(topk_idx.shape[0], self.size, dtype=torch.bool)
        for t, row in enumerate(topk_idx.tolist()):
            for e in row:
                in_rank[t, e // per] = True
        per_expert = torch.bincount(topk_idx.reshape(-1), minlength=num_experts)
        return in_rank.sum(0), None, per_expert, in_rank, None

    def dispatch(self, x, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_rdma_rank,
                 is_token_in_rank, num_tokens_per_expert):  # noqa: ANN001, ANN201 # fmt: skip
        per = int(num_tokens_per_expert.numel()) // self.size
        xs, ids, ws, sent = [], [], [], []
        for r in range(self.size):
            tokens = is_token_in_rank[:, r].nonzero().flatten()
            local = topk_idx[tokens] - r * per
            mine = (local >= 0) & (local < per)
            xs.append(x[tokens])
            ids.append(torch.where(mine, local, -1))
            ws.append(torch.where(mine, topk_weights[tokens], 0.0))
            sent.append(tokens)
        recv_x = torch.cat(_a2a_list(xs, self.group))
        recv_ids = torch.cat(_a2a_list(ids, self.group))
        recv_w = torch.cat(_a2a_list(ws, self.group))
        counts = [int((recv_ids == e).sum()) for e in range(per)]
        handle = (
            sent,
            [len(p) for p in _a2a_list([s.float()[:, None] for s in sent], self.group)],
            x.shape[0],
        )
        return recv_x, recv_ids, recv_w, counts, handle, None

    def combine(self, y, handle):  # noqa: ANN001, ANN201
        sent, recv_sizes, tokens = handle
        back = _a2a_list(list(y.split(recv_sizes)), self.group)
        out = torch.zeros(tokens, y.shape[1], dtype=torch.float32)
        for idx, part in zip(sent, back, strict=True):
            out.index_add_(0, idx, part.float())
        return out.to(y.dtype), None, None

    # ------------------------------------------------------------------ low latency

    def low_latency_dispatch(self, x, topk_idx, max_tokens: int, num_experts: int, use_fp8: bool = False):  # noqa: ANN001, ANN201
        per = num_experts // self.size
        # to each rank: (token, local expert, pair) of every pair it holds, and the token's row
        rows, meta = [], []
        for r in range(self.size):
            pairs = [(t, e - r * per, j) for t, row in enumerate(topk_idx.tolist()) for j, e in enumerate(row)
                     if e // per == r]  # fmt: skip
            meta.append(torch.tensor(pairs, dtype=torch.int64).reshape(-1, 3))
            rows.append(x[[p[0] for p in pairs]] if pairs else x[:0])
        got_rows, got_meta = _a2a_list(rows, self.group), _a2a_list(meta, self.group)
        recv = x.new_zeros(per, self.size * max_tokens, x.shape[1])
        counts = torch.zeros(per, dtype=torch.int64)
        where = []  # per packed row: (source rank, token, pair)
        for src, (r_rows, r_meta) in enumerate(zip(got_rows, got_meta, strict=True)):
            for row, (t, e, j) in zip(r_rows, r_meta.tolist(), strict=True):
                recv[e, counts[e]] = row
                where.append((e, int(counts[e]), src, t, j))
                counts[e] += 1
        return recv, counts, (where, x.shape[0]), None, None

    def low_latency_combine(self, y, topk_idx, topk_weights, handle):  # noqa: ANN001, ANN201
        where, tokens = handle
        parts = [[] for _ in range(self.size)]
        meta = [[] for _ in range(self.size)]
        for e, pos, src, t, j in where:
            parts[src].append(y[e, pos])
            meta[src].append((t, j))
        d = y.shape[-1]
        rows = [torch.stack(p) if p else y.new_zeros(0, d) for p in parts]
        metas = [torch.tensor(m, dtype=torch.int64).reshape(-1, 2) for m in meta]
        out = torch.zeros(tokens, d, dtype=torch.float32)
        for r_rows, r_meta in zip(_a2a_list(rows, self.group), _a2a_list(metas, self.group), strict=True):
            for row, (t, j) in zip(r_rows, r_meta.tolist(), strict=True):
                out[t] += topk_weights[t, j] * row.float()
        return out.to(y.dtype), None, None
