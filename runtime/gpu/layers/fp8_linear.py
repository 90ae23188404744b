"""Linear layers that keep FP8 block-scaled weights (`--quantization fp8`, DeepSeek-V3's checkpoint format).

`weight` [N, K] float8_e4m3fn and `weight_scale_inv` [ceil(N/128), ceil(K/128)] float32, the names the
checkpoints use; the forward is `fp8_linear` (the activation quantized per token and 128-group, then the
`fp8_block_gemm` op). The stored dtypes survive `model.to(bfloat16)`. A float weight loaded into one
(a bf16 checkpoint, dummy weights) is quantized with `quant.fp8.quantize` by `load_float`."""

from __future__ import annotations

import torch
from torch import nn

from runtime.gpu.kernels.fp8_gemm.linear import fp8_linear
from runtime.gpu.quant import fp8


def fp8_parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=fp8.FP8), requires_grad=False)


def scale_parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)


def keep_dtypes(module: nn.Module, fn, names: tuple[str, ...]):  # noqa: ANN001, ANN201
    """`module._apply` that moves the named parameters but keeps their dtypes (fp8 weights, float32
    scales); the others (a bias) follow `fn` as usual."""
    keep = {id(getattr(module, n)) for n in names}

    def apply(t: torch.Tensor) -> torch.Tensor:
        out = fn(t)
        return out.to(t.dtype) if id(t) in keep and out.dtype != t.dtype else out

    return nn.Module._apply(module, apply, recurse=False)


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W in FP8 128 x 128 blocks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        bn, bk = fp8.BLOCK
        self.in_features, self.out_features = in_features, out_features
        self.weight = fp8_parameter(out_features, in_features)
        self.weight_scale_inv = scale_parameter(-(-out_features // bn), -(-in_features // bk))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202
        return keep_dtypes(self, fn, ("weight", "weight_scale_inv"))

    def init_dummy(self, generator: torch.Generator, std: float) -> None:
        """Dummy weights (`--load-format dummy`): normal(0, std) floats, quantized."""
        w = self.weight
        load_float(w.data, self.weight_scale_inv.data, normal(w.shape, w.device, std, generator))
        if self.bias is not None:
            self.bias.data.copy_(normal(self.bias.shape, w.device, std, generator))

    @property
    def gemm_shape(self) -> tuple[int, int]:
        """(N, K) of the GEMM the forward runs (what `fp8_linear.precompile` compiles for)."""
        return self.out_features, self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 blocks {fp8.BLOCK}"


class Fp8GroupedLinear(Fp8Linear):
    """A block-diagonal projection in FP8 (DeepSeek-V4's `o_a_proj`): input [T, g, in/g], group i through
    rows [i*out/g, (i+1)*out/g), one grouped `fp8_linear` (decode rows: one launch). Each group's rows
    fill whole 128-row scale blocks, so its scales are whole rows of the scale grid."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        if out_features % (groups * fp8.BLOCK[0]):
            raise ValueError(
                f"FP8 groups of {out_features // groups} rows must be whole {fp8.BLOCK[0]}-row blocks"
            )
        super().__init__(in_per_group, out_features)
        self.groups = groups

    @staticmethod
    def fits(out_features: int, groups: int) -> bool:
        return out_features % (groups * fp8.BLOCK[0]) == 0

    @property
    def gemm_shape(self) -> tuple[int, int]:
        return self.out_features // self.groups, self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_linear(x.flatten(1), self.weight, self.weight_scale_inv, groups=self.groups)
        return y.view(x.shape[0], self.groups, -1)


class MergedFp8Linear(Fp8Linear):
    """`MergedLinear` in FP8: parts stacked along N, and so are their scale blocks, which needs every
    part's N to be a multiple of the 128-row block (true of DeepSeek-V3's gate|up)."""

    def __init__(self, in_features: int, out_sizes: list[int], shard_names: list[str], bias: bool = False):
        bn = fp8.BLOCK[0]
        if any(n % bn for n in out_sizes):
            raise ValueError(f"merged FP8 parts {out_sizes} must be multiples of the {bn}-row scale block")
        super().__init__(in_features, sum(out_sizes), bias=bias)
        self.out_sizes = list(out_sizes)
        self.shard_names = list(shard_names)

    @staticmethod
    def fits(out_sizes: list[int]) -> bool:
        return all(n % fp8.BLOCK[0] == 0 for n in out_sizes)

    def shard_offset(self, shard: str, scale: bool = False) -> tuple[int, int]:
        """Rows of `weight` (or, `scale`, of `weight_scale_inv`) the part `shard` fills."""
        i = self.shard_names.index(shard)
        off, size = sum(self.out_sizes[:i]), self.out_sizes[i]
        bn = fp8.BLOCK[0] if scale else 1
        return off // bn, size // bn

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return super().forward(x).split(self.out_sizes, dim=-1)


def linear(in_features: int, out_features: int, bias: bool = False, fp8_weights: bool = False) -> nn.Module:
    """A projection that keeps FP8 weights under `fp8_weights` (`--quantization`), else a float one."""
    return (Fp8Linear if fp8_weights else nn.Linear)(in_features, out_features, bias=bias)


def normal(shape: torch.Size, device: torch.device, std: float, generator: torch.Generator) -> torch.Tensor:
    return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)


def load_float(weight: torch.Tensor, scale: torch.Tensor, value: torch.Tensor) -> None:
    """Quantize a float weight [..., N, K] (on the destination's device) into views of an fp8 weight and
    of its scales (a whole weight, a merged part's rows, one expert)."""
    q, s = fp8.quantize(value.to(weight.device), fp8.BLOCK)
    if q.shape != weight.shape or s.shape != scale.shape:
        raise ValueError(f"float weight {tuple(value.shape)} does not fit FP8 {tuple(weight.shape)}")
    weight.copy_(q)
    scale.copy_(s)


def weight_shapes(model: nn.Module) -> set[tuple[int, int]]:
    """(N, K) of every FP8 linear layer in `model` (what `fp8_linear.precompile` compiles for)."""
    return {m.gemm_shape for m in model.modules() if isinstance(m, Fp8Linear)}
