"""DeepSeekMoE: a router picking top-k routed experts per token, and the routed experts themselves.

The experts' weights are stacked ([E, 2I, D] gate|up and [E, D, I] down) so grouped kernels take them
as they are. The routed experts run through the `fused_moe` op (`runtime/gpu/kernels/fused_moe/`): on
CUDA two Triton GEMMs over a device-built layout, with no host sync, so a decode step can be captured
in a CUDA graph; on the CPU the PyTorch reference (expert-sorted, one matmul pair per expert).
Routing runs the `moe_route` op: one Triton program per token on CUDA, the PyTorch reference elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.gpu.kernels import registry
from runtime.gpu.kernels.fused_moe.reference import swiglu
from runtime.gpu.kernels.moe_route.reference import score

__all__ = ["HashRouter", "RoutedExperts", "TopkRouter", "score", "swiglu"]


class TopkRouter(nn.Module):
    """Scores, group-limited top-k on scores (+ correction bias), weights from the plain scores,
    optionally normalised, times `routed_scaling_factor`. `topk_method` picks the variant:

    - "noaux_tc" (V3, V4; the default): sigmoid (V4: sqrt-softplus) scores plus a correction bias; a
      group's score is the sum of its best two.
    - "group_limited_greedy" (V2, V2.5): softmax scores, no bias; top-k within the `topk_group` groups
      with the highest maximum score.
    - "greedy" (V2-Lite): softmax scores, no bias, plain top-k (any `n_group` is ignored).

    Kept in float32 whatever the model dtype (like the reference's `_keep_in_fp32_modules_strict`):
    selection is decided by small differences of the correction bias."""

    METHODS = ("noaux_tc", "group_limited_greedy", "greedy")

    def __init__(self, config) -> None:
        super().__init__()
        method = getattr(config, "topk_method", None) or "noaux_tc"
        if method not in self.METHODS:
            raise ValueError(f"topk_method {method!r} is not supported; supported: {self.METHODS}")
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.num_groups = 1 if method == "greedy" else getattr(config, "n_group", None) or 1
        self.topk_group = getattr(config, "topk_group", None) or self.num_groups
        self.scaling = getattr(config, "routed_scaling_factor", 1.0)
        self.has_bias = method == "noaux_tc"
        default_scoring = "sigmoid" if self.has_bias else "softmax"
        self.scoring = getattr(config, "scoring_func", None) or default_scoring
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size, dtype=torch.float32))
        if self.has_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts, dtype=torch.float32))
        # V2's configs say False (transformers' V2 router never normalises; DeepSeek's own code does when
        # True); V3's say True
        self.norm_topk_prob = bool(getattr(config, "norm_topk_prob", self.has_bias))

    def _apply(self, fn, recurse=True):
        # `.to(bfloat16)` on the model must not demote the router; moves and `to_empty` still apply.
        return super()._apply(lambda t: fn(t).float() if t.is_floating_point() else fn(t), recurse)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] -> (weights [T, k] float32, expert ids [T, k]), through the `moe_route` op."""
        logits = F.linear(x.float(), self.weight)
        bias = self.e_score_correction_bias if self.has_bias else None
        args = (self.top_k, self.num_groups, self.topk_group, self.scoring, self.norm_topk_prob, self.scaling)
        return registry.get("moe_route", x.device)(logits, bias, *args)


class RoutedExperts(nn.Module):
    """E SwiGLU experts with stacked weights; checkpoint tensors `experts.{e}.{gate,up,down}_proj.weight`
    land in slices of them (see `checkpoint_slice`)."""

    def __init__(
        self, num_experts: int, hidden: int, intermediate: int, swiglu_limit: float | None = None
    ) -> None:
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.swiglu_limit = swiglu_limit  # V4: silu(min(gate, L)) * clamp(up, -L, L)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    PARTS = ("gate_proj", "up_proj", "down_proj")

    def checkpoint_slice(self, expert: int, part: str) -> tuple[str, torch.Tensor]:
        """(our parameter leaf, the view of it that `experts.{expert}.{part}.weight` fills)."""
        i = self.intermediate
        if part == "down_proj":
            return "down_proj", self.down_proj.data[expert]
        off = 0 if part == "gate_proj" else i
        return "gate_up_proj", self.gate_up_proj.data[expert, off : off + i]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, D]; weights, ids: [T, k]. Returns sum_k weights[t, k] * expert_{ids[t, k]}(x[t])."""
        fn = registry.get("fused_moe", x.device)
        return fn(x, self.gate_up_proj, self.down_proj, weights, ids, self.swiglu_limit)


class HashRouter(nn.Module):
    """V4's first layers: experts fixed per token id (`tid2eid[input_id]`), weighted by the learned
    scores of those experts (normalised, times `routed_scaling_factor`). Float32 like TopkRouter."""

    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.scaling = getattr(config, "routed_scaling_factor", 1.0)
        self.scoring = getattr(config, "scoring_func", "sqrtsoftplus")
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size, dtype=torch.float32))
        tid2eid = torch.zeros(config.vocab_size, self.top_k, dtype=torch.int64)
        self.tid2eid = nn.Parameter(tid2eid, requires_grad=False)  # a parameter so the loader demands it

    def _apply(self, fn, recurse=True):
        return super()._apply(lambda t: fn(t).float() if t.is_floating_point() else fn(t), recurse)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D], input_ids: [T] -> (weights [T, k] float32, expert ids [T, k])."""
        scores = score(F.linear(x.float(), self.weight), self.scoring)
        ids = self.tid2eid[input_ids].long()
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids
