"""How many DeepSeek-V4-Flash layers fit one GPU, weights in bf16 or as the checkpoints store them (FP8
projections, packed FP4 routed experts: `--quantization fp8`). docs/deepseek_v4.md, "Weights as stored".

The model is built on the meta device from the `deepseek-v4-flash` preset (no memory, no GPU) and its
parameter and buffer bytes are summed per decoder layer and outside them (embedding, head, mHC head,
norm). The first N layers fit when those bytes plus the rest stay under the GPU's memory less a reserve
for the KV pools, per-row state, activations, CUDA graphs and the CUDA context. Prints the table and the
`loadgen steps` command that loads the largest cut with dummy weights.

    python -m benchmarks.v4_layers_fit                        # H200: 140 GiB, 12 GiB reserved
    python -m benchmarks.v4_layers_fit --capacity-gib 140 --reserve-gib 16
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch
from torch import nn

GIB = 1 << 30


def module_bytes(module: nn.Module) -> int:
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def layer_bytes(fp8_weights: bool, dtype: torch.dtype = torch.bfloat16) -> tuple[list[int], int, list[str]]:
    """(bytes of each decoder layer, bytes outside them, each layer's attention type) of V4-Flash's 43
    layers in `dtype` (quantized weights keep their own dtypes)."""
    from runtime.gpu import loader
    from runtime.gpu.models import get_model_class

    config = loader.load_config("deepseek-v4-flash", {"num_nextn_predict_layers": 0})
    with torch.device("meta"):
        model = get_model_class(config)(config, max_positions=8192, fp8_weights=fp8_weights).to(dtype)
    layers = [module_bytes(layer) for layer in model.model.layers]
    return layers, module_bytes(model) - sum(layers), list(config.layer_types)


def fitting_layers(layers: list[int], rest: int, budget: float) -> int:
    """The most leading layers whose bytes, with `rest`, stay within `budget`."""
    total, n = rest, 0
    for size in layers:
        if total + size > budget:
            break
        total, n = total + size, n + 1
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--capacity-gib", type=float, default=140.0, help="GPU memory (H200: 143,771 MiB)")
    p.add_argument(
        "--reserve-gib", type=float, default=12.0, help="kept for KV, activations, graphs, context"
    )
    p.add_argument("--layers-only", action="store_true", help="print only the largest cut as stored")
    a = p.parse_args(argv)
    budget = (a.capacity_gib - a.reserve_gib) * GIB
    if a.layers_only:
        layers, rest, _ = layer_bytes(fp8_weights=True)
        print(fitting_layers(layers, rest, budget))
        return 0
    print(f"budget {budget / 1e9:.1f} GB for weights ({a.capacity_gib} GiB less {a.reserve_gib} GiB)")
    largest = {}
    for name, fp8_weights in (("bf16", False), ("as stored (FP8 + FP4 experts)", True)):
        layers, rest, types = layer_bytes(fp8_weights)
        per_type = {t: size for t, size in zip(types, layers, strict=True)}
        n = fitting_layers(layers, rest, budget)
        largest[fp8_weights] = n
        kinds = Counter(types[:n])
        print(f"\n{name}: outside the layers {rest / 1e9:.2f} GB; per layer " + ", ".join(
            f"{t.split('_')[0]} {size / 1e9:.2f} GB" for t, size in per_type.items()
        ))  # fmt: skip
        print(f"  all 43 layers: {(rest + sum(layers)) / 1e9:.1f} GB; {n} layers fit: "
              f"{(rest + sum(layers[:n])) / 1e9:.1f} GB ({dict(kinds)})")  # fmt: skip
    overrides = json.dumps({"num_hidden_layers": largest[True], "num_nextn_predict_layers": 0})
    print(
        "\nthe largest cut as stored, dummy weights, a few decode steps:\n"
        f"  python -m loadgen steps --model-path deepseek-v4-flash --quantization fp8 --hf-overrides '{overrides}' "
        '--page-size 128 --batch-sizes 1,16,64 --context-len 1024 --prefill-tokens "" --steps 5'
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
