// One warp's share of the FP4 experts' decode kernels (tilelang_fp4.py): W4A16 on mma.sync, the codes
// turned into bf16 mma operands in registers, never through shared memory.
//
// Why: Triton's `dot_scaled` on Hopper moves every weight through shared memory twice and spends about
// 9x the instructions a byte this needs; its decode kernels stop at 34-37% of DRAM bandwidth with the
// SMs' issue 70-78% busy (docs/PERF.md). Here a byte costs a few integer ops and one bf16 multiply.
//
// The product is transposed so that the weights fill the mma rows: C^T [16 weight rows x 8 tokens] +=
// W [16 x 16 k] X^T [16 k x 8 tokens] (m16n8k16, bf16 in, f32 accumulate). Thread (g = lane / 4,
// t = lane % 4) reads 16 bytes of weight rows g and g + 8 per 128-k step: elements [32 t, 32 t + 32) of
// the step, one scale group. The weights are tiled (`fp4.tile_experts`: 16 rows x 64 bytes, row-major
// inside, a 16-row group's tiles in K order), so those bytes sit at 16 lane of the step's tile for row g
// and 512 + 16 lane for row g + 8: each warp load instruction reads 512 contiguous bytes and a warp's
// m-tile streams one contiguous run (row-major rows gave 8 x 64-byte pieces an instruction, which stream
// about 2.5 TB/s on an H200 against 4.1-4.3 TB/s for 512-byte runs: benchmarks.kernels.fp4_load_probe);
// the scale bytes likewise at lane and 32 + lane of the step's 64-byte scale tile. The sum over k
// does not care which k each mma step covers, so k is permuted: each 4-byte word (8 codes, element i in
// nibble i) feeds two mma steps. A nibble at the top of a 16-bit half becomes a bf16 by two masks and a
// shift (sign stays at bit 15; the 3 magnitude bits land on the exponent's 2 low bits and the mantissa's
// top bit: the e2m1 value times 2^-126, the subnormal 0.5 included), and shifting the word by 4 brings
// the next pair up, so a word gives (e3, e7), (e2, e6), (e1, e5), (e0, e4). The activations' B fragment
// takes the same pairs from the 8 bf16 of the word's k range by byte permutes. The group's scale
// 2^(s - 127) times 2^126 is one bf16 multiply (a second one for s > 128, scales above 2).
//
// The weights stream straight from DRAM into registers (no reuse: each byte is read by one warp), STAGES
// steps in flight a thread; the activations come through L1/L2 (every warp of a CTA reads the same rows).
#pragma once
#include <cstdint>
#include <cuda_bf16.h>

namespace fp4_moe {

// bytes of one tiled 16-row x 128-k step (`fp4.tile_experts`): codes (16 x 64) and scales (16 x 4)
constexpr int CODE_TILE = 1024;
constexpr int SCALE_TILE = 64;

__device__ __forceinline__ uint4 ldg_stream(const void* p) {  // read once: no L1 allocation
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// bf16x2 multiply (both halves)
__device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

// 2^(e - 127) in both halves of a bf16x2 (e: a biased exponent, 1..254)
__device__ __forceinline__ uint32_t pow2x2(uint32_t e) { return (e << 7) | (e << 23); }

// 8 codes (element i in nibble i) times 2^(s - 127) -> bf16x2 (e3, e7), (e2, e6), (e1, e5), (e0, e4).
// `big` (warp-uniform, so a skipped branch costs no issue slots): some lane's scale is above 2, which no
// checkpoint has; kept exact by a second multiply, the rest of 2^(s - 1).
__device__ __forceinline__ void dequant8(uint32_t q, uint32_t s, bool big, uint32_t out[4]) {
  const uint32_t f = pow2x2(min(s, 128u) + 126u);  // codes carry 2^-126: 2^(s - 1) in all
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[i] = mul2((q & 0x80008000u) | ((q >> 6) & 0x01C001C0u), f);
    q <<= 4;
  }
  if (big) {
    const uint32_t f2 = pow2x2(max(s, 128u) - 1u);  // 2^0 for the lanes at or below 2
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = mul2(out[i], f2);
  }
}

__device__ __forceinline__ void mma(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One step in registers. A step is SUB tiles of 128 k (sub-steps u), thread t taking scale group t of
// each. Per m-tile i and sub-step u, 16 code bytes of rows g and g + 8 and their scale bytes; with XS,
// per token tile j and sub-step u, the thread's 32 activations (4 x 8 bf16), else loaded as used.
template <int TILES, int NT, bool XS, int SUB>
struct Step {
  uint4 w[TILES][2][SUB];
  uint32_t s[TILES][2][SUB];
  uint4 x[XS ? NT : 1][SUB][4];
};

// the thread's activations of sub-step u of `step` (x: its token row's base, already at group t)
template <int SUB>
__device__ __forceinline__ uint4 load_x(const uint4* x, int step, int u, int v) {
  return x ? __ldg(x + (step * SUB + u) * 16 + v) : make_uint4(0, 0, 0, 0);
}

template <int TILES, int NT, bool XS, int SUB>
__device__ __forceinline__ void load(Step<TILES, NT, XS, SUB>& st, const uint8_t* const (&w)[TILES][2],
                                     const uint8_t* const (&s)[TILES][2], const uint4* const (&x)[NT], int step) {
#pragma unroll
  for (int i = 0; i < TILES; ++i)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int u = 0; u < SUB; ++u) {
        st.w[i][r][u] = ldg_stream(w[i][r] + (step * SUB + u) * CODE_TILE);
        st.s[i][r][u] = __ldg(s[i][r] + (step * SUB + u) * SCALE_TILE);
      }
  if constexpr (XS) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int u = 0; u < SUB; ++u)
#pragma unroll
        for (int v = 0; v < 4; ++v) st.x[j][u][v] = load_x<SUB>(x[j], step, u, v);
  }
}

template <int TILES, int NT, bool XS, int SUB>
__device__ __forceinline__ void compute(const Step<TILES, NT, XS, SUB>& st, float (&acc)[TILES][NT][4],
                                        const bool (&live)[NT], const uint4* const (&x)[NT], int step) {
#pragma unroll
  for (int u = 0; u < SUB; ++u) {
    uint4 xs[XS ? 1 : NT][4];
    if constexpr (!XS) {
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v) xs[j][v] = live[j] ? load_x<SUB>(x[j], step, u, v) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < TILES; ++i) {
      const uint32_t* wg = reinterpret_cast<const uint32_t*>(&st.w[i][0][u]);
      const uint32_t* wh = reinterpret_cast<const uint32_t*>(&st.w[i][1][u]);
      const bool big = __any_sync(0xffffffffu, max(st.s[i][0][u], st.s[i][1][u]) > 128u);
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        uint32_t pg[4], ph[4];
        dequant8(wg[v], st.s[i][0][u], big, pg);
        dequant8(wh[v], st.s[i][1][u], big, ph);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          if (!live[j]) continue;
          const uint4 xv = XS ? st.x[j][u][v] : xs[j][v];  // (x0, x1), (x2, x3), (x4, x5), (x6, x7)
          mma(acc[i][j], pg[0], ph[0], pg[1], ph[1], __byte_perm(xv.y, xv.w, 0x7632), __byte_perm(xv.y, xv.w, 0x5410));
          mma(acc[i][j], pg[2], ph[2], pg[3], ph[3], __byte_perm(xv.x, xv.z, 0x7632), __byte_perm(xv.x, xv.z, 0x5410));
        }
      }
    }
  }
}

template <int TILES, int NT>
__device__ __forceinline__ void zero(float (&acc)[TILES][NT][4]) {
#pragma unroll
  for (int i = 0; i < TILES; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;
}

// acc[i][j] = W rows (w[i][0]: row g, w[i][1]: row g + 8) . x rows over K = 128 SUB steps.
template <int TILES, int NT, int STAGES, bool XS, int SUB>
__device__ __forceinline__ void mainloop(float (&acc)[TILES][NT][4], const uint8_t* const (&w)[TILES][2],
                                         const uint8_t* const (&s)[TILES][2], const uint4* const (&x)[NT],
                                         const bool (&live)[NT], int steps) {
  zero(acc);
  Step<TILES, NT, XS, SUB> st[STAGES];
#pragma unroll
  for (int p = 0; p < STAGES; ++p)
    if (p < steps) load(st[p], w, s, x, p);
  for (int s0 = 0; s0 < steps; s0 += STAGES) {
#pragma unroll
    for (int p = 0; p < STAGES; ++p) {
      if (s0 + p < steps) {
        compute(st[p], acc, live, x, s0 + p);
        if (s0 + p + STAGES < steps) load(st[p], w, s, x, s0 + p + STAGES);
      }
    }
  }
}

// The block's token tiles (its layout rows first..first + 8 NT): x[j], this thread's activations
// (32 a tile) of row first + 8 j + g (`row_ptr(row, pair)`: the row's bf16 activations; nullptr for padding),
// and live[j], whether tile j holds a real row (a block's real rows come first, so warp-uniform).
template <int NT, typename RowPtr>
__device__ __forceinline__ void token_rows(const int* pairs, int first, int num_pairs, int g, int t,
                                           const uint4* (&x)[NT], bool (&live)[NT], RowPtr row_ptr) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int row = first + 8 * j + g;
    const int p = pairs[row];
    x[j] = p < num_pairs ? reinterpret_cast<const uint4*>(row_ptr(row, p)) + 4 * t : nullptr;
    live[j] = pairs[first + 8 * j] < num_pairs;
  }
}

__device__ __forceinline__ uint16_t bf16_bits(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }

// gate/up + SwiGLU. CTA (bx: a block of 8 NT sorted pairs, by: WARPS x 16 columns of H); warp `warp`
// owns H columns n0..n0 + 16: gate rows n0.. (m-tile 0) and up rows N + n0.. (m-tile 1) of expert e.
// W [E, 2N, K/2] and WS [E, 2N, K/32] tiled; X rows gathered by pair / topk; H [rows, N] dense.
template <int NT, int WARPS, int STAGES, bool XS, int SUB, bool HAS_LIMIT>
__device__ __forceinline__ void gate_up(const void* X, int64_t x_stride, const void* W, const void* WS, void* H,
                                        const int* pairs, const int* block_expert, const int* num_rows,
                                        int num_pairs, int topk, int N, int K, float limit, int bx, int by, int tx) {
  constexpr int BM = 8 * NT;
  if (bx * BM >= *num_rows) return;
  const int warp = tx >> 5, lane = tx & 31, g = lane >> 2, t = lane & 3;
  const int64_t e = block_expert[bx];
  const int n0 = (by * WARPS + warp) * 16;
  const int64_t kb = K / 2, kg = K / 32;
  // the 16-row groups of gate rows n0.. and up rows N + n0.. (both multiples of 16)
  const uint8_t* wb = static_cast<const uint8_t*>(W) + (e * 2 * N + n0) * kb + 16 * lane;
  const uint8_t* sb = static_cast<const uint8_t*>(WS) + (e * 2 * N + n0) * kg + lane;
  const uint8_t* const w[2][2] = {{wb, wb + CODE_TILE / 2}, {wb + N * kb, wb + N * kb + CODE_TILE / 2}};
  const uint8_t* const s[2][2] = {{sb, sb + SCALE_TILE / 2}, {sb + N * kg, sb + N * kg + SCALE_TILE / 2}};
  const uint4* x[NT];
  bool live[NT];
  token_rows<NT>(pairs, bx * BM, num_pairs, g, t, x, live, [&](int, int p) {
    return static_cast<const __nv_bfloat16*>(X) + (p / topk) * x_stride;  // the pair's token
  });
  float acc[2][NT][4];
  mainloop<2, NT, STAGES, XS, SUB>(acc, w, s, x, live, K / (128 * SUB));
  uint16_t* h = static_cast<uint16_t*>(H);
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int row = bx * BM + 8 * j + 2 * t + (c & 1);
      if (pairs[row] >= num_pairs) continue;
      float gv = acc[0][j][c], uv = acc[1][j][c];
      if (HAS_LIMIT) {
        gv = fminf(gv, limit);
        uv = fminf(fmaxf(uv, -limit), limit);
      }
      h[int64_t(row) * N + n0 + g + 8 * (c >> 1)] = bf16_bits(gv / (1.f + __expf(-gv)) * uv);
    }
  }
}

// down + routing weight: CTA (bx: the block, by: WARPS x 32 columns of Y); warp `warp` owns output
// columns n0..n0 + 32 (m-tiles of 16). W [E, D, K/2], WS [E, D, K/32] tiled; H [rows, K] dense;
// Y [pairs, D] dense, each real row scaled by its pair's weight.
template <int NT, int WARPS, int STAGES, bool XS, int SUB>
__device__ __forceinline__ void down(const void* H, const void* W, const void* WS, void* Y, const int* pairs,
                                     const int* block_expert, const int* num_rows, const float* topk_w,
                                     int num_pairs, int D, int K, int bx, int by, int tx) {
  constexpr int BM = 8 * NT;
  if (bx * BM >= *num_rows) return;
  const int warp = tx >> 5, lane = tx & 31, g = lane >> 2, t = lane & 3;
  const int64_t e = block_expert[bx];
  const int n0 = (by * WARPS + warp) * 32;
  const int64_t kb = K / 2, kg = K / 32;
  // the 16-row groups of rows n0.. and n0 + 16..
  const uint8_t* wb = static_cast<const uint8_t*>(W) + (e * D + n0) * kb + 16 * lane;
  const uint8_t* sb = static_cast<const uint8_t*>(WS) + (e * D + n0) * kg + lane;
  const uint8_t* const w[2][2] = {{wb, wb + CODE_TILE / 2}, {wb + 16 * kb, wb + 16 * kb + CODE_TILE / 2}};
  const uint8_t* const s[2][2] = {{sb, sb + SCALE_TILE / 2}, {sb + 16 * kg, sb + 16 * kg + SCALE_TILE / 2}};
  const uint4* x[NT];
  bool live[NT];
  token_rows<NT>(pairs, bx * BM, num_pairs, g, t, x, live, [&](int row, int) {
    return static_cast<const __nv_bfloat16*>(H) + int64_t(row) * K;  // the layout row itself
  });
  float acc[2][NT][4];
  mainloop<2, NT, STAGES, XS, SUB>(acc, w, s, x, live, K / (128 * SUB));
  uint16_t* y = static_cast<uint16_t*>(Y);
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int p = pairs[bx * BM + 8 * j + 2 * t + (c & 1)];
      if (p >= num_pairs) continue;
      const float wt = topk_w[p];
#pragma unroll
      for (int i = 0; i < 2; ++i) y[int64_t(p) * D + n0 + 16 * i + g + 8 * (c >> 1)] = bf16_bits(acc[i][j][c] * wt);
    }
  }
}

}  // namespace fp4_moe
