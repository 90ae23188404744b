"""Sweep the Triton decode kernel's block size, warps, pipeline stages and split count on CUDA, each
configuration checked against the reference: `python -m runtime.gpu.kernels.decode_attention.sweep`."""

from __future__ import annotations

import itertools

import torch
import triton

from runtime.gpu.kernels.decode_attention import triton as kernel
from runtime.gpu.kernels.decode_attention.reference import decode_attention as reference
from runtime.gpu.kernels.testing import paged_case

SHAPES = [(256, 1024, (1, 2)), (64, 4096, (1, 2, 4)), (1, 1024, (4, 8, 16, 32, 64))]  # (B, context, splits)


def main() -> None:
    defaults = (kernel.BLOCK_N, kernel.NUM_WARPS, kernel.NUM_STAGES)
    for batch, ctx, splits in SHAPES:
        case = paged_case([ctx - 1] * batch, [1] * batch, 32, 8, 128, torch.bfloat16, "cuda", q_strided=False)
        args = case.decode_args()
        want = reference(*args).float()
        kv_bytes = 2 * batch * ctx * 8 * 128 * 2
        results = []
        for bn, warps, stages, sp in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), splits):
            kernel.BLOCK_N, kernel.NUM_WARPS, kernel.NUM_STAGES = bn, warps, stages
            err = (kernel.decode_attention(*args, num_splits=sp).float() - want).abs().max().item()
            ms = triton.testing.do_bench(lambda sp=sp, args=args: kernel.decode_attention(*args, num_splits=sp), rep=40)
            results.append((ms, bn, warps, stages, sp, err))
        for ms, bn, warps, stages, sp, err in sorted(results)[:3]:
            print(f"B={batch} ctx={ctx} BLOCK_N={bn} warps={warps} stages={stages} splits={sp}: "
                  f"{ms * 1e3:.1f} us, {kv_bytes / ms / 1e6:.0f} GB/s, max err {err:.1e}")
    kernel.BLOCK_N, kernel.NUM_WARPS, kernel.NUM_STAGES = defaults


if __name__ == "__main__":
    main()
