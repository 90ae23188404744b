"""The fused MoE's routing layout in its three forms (torch ops; one Triton program; a program per
tile), timed by CUDA-graph replay at decode and verify token counts for V2-Lite's 64 experts (top-6)
and V3's 256 (top-8). Each form's result is checked against the torch ops first.
    python -m benchmarks.kernels.moe_layout"""

from __future__ import annotations

import functools

import torch

from benchmarks.kernels.timing import bench_ms
from runtime.gpu.kernels.fused_moe import triton_layout
from runtime.gpu.kernels.fused_moe.layout import moe_layout
from runtime.gpu.kernels.fused_moe.triton import choose_config

FORMS = {
    "torch": moe_layout,
    "one_program": triton_layout.moe_layout_triton,
    "tiled": triton_layout.moe_layout_tiled,
    "fast": triton_layout.moe_layout_fast,
}


def main() -> None:
    dev = torch.device("cuda")
    print(
        f"{'experts':>7} {'k':>2} {'tokens':>6} {'pairs':>6} {'bm':>3} " + " ".join(f"{n:>12}" for n in FORMS)
    )
    for experts, k in ((64, 6), (256, 8)):
        for tokens in (1, 8, 32, 64, 128, 256, 512, 1024, 2048):
            g = torch.Generator(device=dev).manual_seed(tokens)
            ids = torch.rand(tokens, experts, device=dev, generator=g).topk(k, dim=-1).indices.to(torch.int32)
            bm = choose_config(tokens * k, experts, dev, torch.bfloat16).block_m
            want = moe_layout(ids, experts, bm)
            times = []
            for fn in FORMS.values():
                got = fn(ids, experts, bm)
                assert torch.equal(got.sorted_pairs, want.sorted_pairs) and torch.equal(
                    got.num_rows, want.num_rows
                )
                call = functools.partial(fn, ids, experts, bm)
                times.append(bench_ms(call, dev, graph=True) * 1e3)
            cells = " ".join(f"{t:>9.1f} us" for t in times)
            print(f"{experts:>7} {k:>2} {tokens:>6} {tokens * k:>6} {bm:>3} {cells}", flush=True)


if __name__ == "__main__":
    main()
