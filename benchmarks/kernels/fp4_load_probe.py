"""How fast can a warp stream the FP4 experts' codes into registers, with nothing else to do? Load-only
kernels over a V4-Flash-sized gate/up weight (2 GiB, rows of 2,048 code bytes) in the access pattern of
`fused_moe/fp4_warp.cuh` ("frag": thread (g, t) reads 16 bytes of rows g, g + 8, g + 16, g + 24 at byte
16 t + 64 step, so a warp instruction touches 8 rows x 64 B) against a contiguous one ("wide": a warp
instruction reads 512 contiguous bytes of one row), with STAGES loads of 64 B a thread in flight and the
CTAs an SM capped by a shared-memory reservation (the mma kernels fit 3-4 CTAs of 4 warps an SM by their
registers). It separates the access pattern and the bytes in flight from the mma kernels' compute.
    python -m benchmarks.kernels.fp4_load_probe"""

# No `from __future__ import annotations`: TileLang reads the prim_func parameter annotations.
import functools
import itertools

import torch
import triton.testing

from benchmarks.kernels.timing import ceilings

ROWS, ROW_BYTES, WARPS = 256 * 4096, 2048, 4

_SOURCE = r"""
#include <cstdint>
namespace probe {
__device__ __forceinline__ uint4 ldg_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
// WIDE: step s reads row s of the warp's 32 (4 x 512 B); else 16 B of rows g, g+8, g+16, g+24 at 16 t + 64 s
template <bool WIDE, int STAGES>
__device__ void stream(const uint8_t* W, uint32_t* out, uint8_t* smem, int bx, int tx) {
  const int warp = tx >> 5, lane = tx & 31, g = lane >> 2, t = lane & 3;
  const uint8_t* base = W + (int64_t(bx) * 128 + warp * 32) * 2048;
  uint4 st[STAGES][4];
  auto addr = [&](int s, int r) -> const uint8_t* {
    return WIDE ? base + int64_t(s) * 2048 + r * 512 + lane * 16 : base + int64_t(g + 8 * r) * 2048 + 16 * t + 64 * s;
  };
  constexpr int steps = 32;
#pragma unroll
  for (int p = 0; p < STAGES; ++p)
#pragma unroll
    for (int r = 0; r < 4; ++r) st[p][r] = ldg_stream(addr(p, r));
  uint32_t acc = 0;
  for (int s0 = 0; s0 < steps; s0 += STAGES) {
#pragma unroll
    for (int p = 0; p < STAGES; ++p) {
#pragma unroll
      for (int r = 0; r < 4; ++r) acc ^= st[p][r].x ^ st[p][r].y ^ st[p][r].z ^ st[p][r].w;
      if (s0 + p + STAGES < steps)
#pragma unroll
        for (int r = 0; r < 4; ++r) st[p][r] = ldg_stream(addr(s0 + p + STAGES, r));
    }
  }
  if (acc == 0x12345678u) smem[tx] = 1;  // keeps the loads and the reservation
  out[int64_t(bx) * 128 + tx] = acc;
}
}  // namespace probe
"""


@functools.cache
def _kernel(wide: bool, stages: int, smem: int):
    import tilelang
    import tilelang.language as T

    blocks = ROWS // (32 * WARPS)

    @T.prim_func
    def probe(W: T.Tensor([ROWS, ROW_BYTES], "uint8"), Out: T.Tensor([blocks * 32 * WARPS], "uint32")):
        with T.Kernel(blocks, threads=32 * WARPS) as bx:
            T.import_source(_SOURCE)
            pad = T.alloc_shared([smem], "uint8")
            T.call_extern(
                "handle", f"probe::stream<{str(wide).lower()}, {stages}>", T.address_of(W[0, 0]),
                T.address_of(Out[0]), T.address_of(pad[0]), bx, T.get_thread_binding(),
            )  # fmt: skip

    return tilelang.compile(probe, target="cuda")


def main() -> None:
    dev = torch.device("cuda")
    print(f"copy ceiling {ceilings(dev, small=False)[0] / 1e9:.0f} GB/s")
    w = torch.randint(0, 256, (ROWS, ROW_BYTES), device=dev, dtype=torch.uint8)
    out = torch.empty(ROWS, device=dev, dtype=torch.int32).view(torch.uint32)
    # CTAs an SM: 228 KB shared a H100/H200 SM; a reservation of 220 KB / n leaves n (less 1 KB each)
    for wide, stages, ctas in itertools.product((False, True), (2, 4), (3, 8)):
        smem = 220 * 1024 // ctas - 1024
        k = _kernel(wide, stages, smem)
        ms = triton.testing.do_bench(functools.partial(k, w, out), warmup=10, rep=50)
        name = "wide" if wide else "frag"
        print(
            f"{name} stages {stages} ctas/SM {ctas:2d}: {ms * 1e3:7.1f} us {w.numel() / ms / 1e6:6.0f} GB/s"
        )


if __name__ == "__main__":
    main()
