"""DeepSeekMoE: a router picking top-k routed experts per token, and the routed experts themselves.

The experts' weights are stacked ([E, 2I, D] gate|up and [E, D, I] down) so grouped kernels take them
as they are. The routed experts run through the `fused_moe` op (`runtime/gpu/kernels/fused_moe/`): on
CUDA two Triton GEMMs over a device-built layout, with no host sync, so a decode step can be captured
in a CUDA graph; on the CPU the PyTorch reference (expert-sorted, one matmul pair per expert).
Routing runs the `moe_route` op: one Triton program per token on CUDA, the PyTorch reference elsewhere.
`weight_format` "fp8": the stacked weights are e4m3 with per-expert 128 x 128 block scales (DeepSeek-V3's
checkpoint format); "fp4": packed e2m1 codes with a UE8M0 scale byte per 32 along K (DeepSeek-V4's
routed experts, `quant/fp4.py`). Either way the scales go to `fused_moe` as `w13_scale` / `w2_scale`.

Balanced routing (`balance_routing`, for benchmarks on dummy weights): random weights send nearly every
token of a step to the same few experts (their hidden states barely differ), so a decode step reads a
fraction of the experts a trained router's even load reads, and a step of 4x the tokens reaches many
more. Balanced routers keep running their op (its cost stays in the step) but send token i to row
i of a fixed table of k distinct experts drawn uniformly, so a step reaches experts as uniform random
routing does; the table is made once per (device, experts, k) before any graph is captured."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.gpu.kernels.fused_moe import FUSED_MOE
from runtime.gpu.kernels.moe_route import MOE_ROUTE
from runtime.gpu.kernels.moe_route.reference import score
from runtime.gpu.layers.fp8_linear import fp8_parameter, keep_dtypes, load_float, normal, scale_parameter
from runtime.gpu.quant import fp4, fp8

__all__ = ["HashRouter", "RoutedExperts", "TopkRouter", "balance_routing", "score"]


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
        self.balanced: torch.Tensor | None = None  # balanced routing's table (`balance_routing`)
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
        weights, ids = MOE_ROUTE.get(x.device)(logits, bias, *args)
        if self.balanced is not None:
            t, rows = x.shape[0], self.balanced.shape[0]
            table = self.balanced.to(ids.dtype)  # the op's id dtype (no copy when it is the table's)
            ids = table[:t] if t <= rows else table[torch.arange(t, device=x.device) % rows]
        return weights, ids


BALANCED_ROWS = 1 << 16  # token positions of the balanced table; steps past it wrap around
_balanced_tables: dict[tuple[str, int, int], torch.Tensor] = {}


def balance_routing(model: nn.Module, seed: int = 0) -> int:
    """Balanced routing for every top-k router of `model` (module docstring); returns how many. Call it
    before CUDA graphs are captured: the graphs keep the routing they were captured with."""
    routers = [m for m in model.modules() if isinstance(m, TopkRouter)]
    for r in routers:
        device = r.weight.device
        key = (str(device), r.num_experts, r.top_k)
        if key not in _balanced_tables:
            g = torch.Generator().manual_seed(seed)
            draws = torch.rand(BALANCED_ROWS, r.num_experts, generator=g)
            _balanced_tables[key] = draws.topk(r.top_k, dim=-1).indices.to(device)
        r.balanced = _balanced_tables[key]
    return len(routers)


class RoutedExperts(nn.Module):
    """E SwiGLU experts with stacked weights; checkpoint tensors `experts.{e}.{gate,up,down}_proj.weight`
    (and with quantized weights their `weight_scale_inv`) land in slices of them (see `checkpoint_slice`)."""

    FORMATS = ("float", "fp8", "fp4")

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        swiglu_limit: float | None = None,
        weight_format: str = "float",
        logical: list[int] | None = None,
    ) -> None:
        super().__init__()
        if weight_format not in self.FORMATS:
            raise ValueError(f"expert weight format {weight_format!r} is not one of {self.FORMATS}")
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        # under expert parallelism: the logical expert of each local one (ExpertPlacement.local)
        self.logical = logical
        self.swiglu_limit = swiglu_limit  # V4: silu(min(gate, L)) * clamp(up, -L, L)
        self.weight_format = weight_format
        w13, w2 = (num_experts, 2 * intermediate, hidden), (num_experts, hidden, intermediate)
        if weight_format == "float":
            self.gate_up_proj = nn.Parameter(torch.empty(w13))
            self.down_proj = nn.Parameter(torch.empty(w2))
            return
        if weight_format == "fp4":
            g = fp4.GROUP
            if hidden % g or intermediate % g:
                raise ValueError(f"FP4 experts need hidden and intermediate sizes % {g} == 0, got {w2[1:]}")
            self.gate_up_proj = _bytes(num_experts, 2 * intermediate, hidden // 2)
            self.down_proj = _bytes(num_experts, hidden, intermediate // 2)
            self.gate_up_proj_scale_inv = _bytes(num_experts, 2 * intermediate, hidden // g)
            self.down_proj_scale_inv = _bytes(num_experts, hidden, intermediate // g)
            return
        bn, bk = fp8.BLOCK
        if intermediate % bn:  # gate and up stack their scale blocks along 2I
            raise ValueError(f"FP8 experts need moe_intermediate_size % {bn} == 0, got {intermediate}")
        self.gate_up_proj, self.down_proj = fp8_parameter(*w13), fp8_parameter(*w2)
        self.gate_up_proj_scale_inv = scale_parameter(num_experts, 2 * intermediate // bn, -(-hidden // bk))
        self.down_proj_scale_inv = scale_parameter(num_experts, -(-hidden // bn), intermediate // bk)

    PARTS = ("gate_proj", "up_proj", "down_proj")
    _QUANTIZED_NAMES = ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")

    @property
    def quantized(self) -> bool:
        return self.weight_format != "float"

    @property
    def params_per_expert(self) -> int:
        """Logical weights of one expert (FP4 packs two in a byte)."""
        return 3 * self.hidden * self.intermediate

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202
        return keep_dtypes(self, fn, self._QUANTIZED_NAMES) if self.quantized else super()._apply(fn, recurse)

    def logical_ids(self) -> list[int]:
        """The checkpoint's expert ids this module holds, in local order."""
        return self.logical if self.logical is not None else list(range(self.num_experts))

    def checkpoint_slice(
        self, expert: int, part: str, scale: bool = False
    ) -> tuple[str, torch.Tensor] | None:
        """(our parameter leaf, the view of it that `experts.{expert}.{part}.weight` fills), or with
        `scale` the view its `weight_scale_inv` fills (None with float weights)."""
        if scale and not self.quantized:
            return None
        assert not fp4.is_tiled(self.gate_up_proj), "FP4 experts are tiled once loaded: nothing loads after"
        if self.logical is not None:  # a logical expert this rank does not hold: nothing to fill
            if expert not in self.logical:
                return None
            expert = self.logical.index(expert)
        suffix, rows = "", self.intermediate
        if scale:  # FP8: a scale row per 128-row block; FP4: per row
            suffix, rows = fp8.SCALE_SUFFIX, (rows // fp8.BLOCK[0] if self.weight_format == "fp8" else rows)
        if part == "down_proj":
            leaf = "down_proj" + suffix
            return leaf, getattr(self, leaf).data[expert]
        leaf = "gate_up_proj" + suffix
        off = 0 if part == "gate_proj" else rows
        return leaf, getattr(self, leaf).data[expert, off : off + rows]

    def init_dummy(self, generator: torch.Generator, std: float) -> None:
        """Dummy quantized weights: normal(0, std) floats quantized, one expert at a time (V3's stacked
        float32 experts would be 30 GB per layer)."""
        quantize_into = fp4.load_float if self.weight_format == "fp4" else load_float
        pairs = (self.gate_up_proj, self.gate_up_proj_scale_inv), (self.down_proj, self.down_proj_scale_inv)
        for w, s in pairs:
            rows, cols = w.shape[1], (self.hidden if w is self.gate_up_proj else self.intermediate)
            for e in range(self.num_experts):
                quantize_into(w.data[e], s.data[e], normal((rows, cols), w.device, std, generator))

    def tile_fp4(self) -> None:
        """FP4 experts into their tiled form (`fp4.tile_experts`), which the mma kernels need and every
        `fused_moe` form reads; once, after loading (`prepare_for_serving`), in place: no second copy of
        the experts. Checkpoint slices are row-major, so loading is over by then. Shapes the tiles do not
        divide stay row-major."""
        if self.weight_format != "fp4" or fp4.is_tiled(self.gate_up_proj):
            return
        if not (
            fp4.tileable(2 * self.intermediate, self.hidden) and fp4.tileable(self.hidden, self.intermediate)
        ):
            return
        for name in self._QUANTIZED_NAMES:
            cols = fp4.TILE_COLS["scales" if name.endswith(fp8.SCALE_SUFFIX) else "codes"]
            tiled = fp4.tile_experts_in_place(getattr(self, name).data, cols)
            setattr(self, name, nn.Parameter(tiled, requires_grad=False))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, D]; weights, ids: [T, k]. Returns sum_k weights[t, k] * expert_{ids[t, k]}(x[t])."""
        fn = FUSED_MOE.get(x.device)
        if not self.quantized:
            return fn(x, self.gate_up_proj, self.down_proj, weights, ids, self.swiglu_limit)
        scales = dict(w13_scale=self.gate_up_proj_scale_inv, w2_scale=self.down_proj_scale_inv)
        return fn(x, self.gate_up_proj, self.down_proj, weights, ids, self.swiglu_limit, **scales)


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


def _bytes(*shape: int) -> nn.Parameter:
    """Packed FP4 codes or their UE8M0 scale bytes (integers: `model.to(dtype)` leaves them alone)."""
    return nn.Parameter(torch.empty(*shape, dtype=fp4.PACKED), requires_grad=False)
