// One consumer warp's share of the TileLang fp8 GQA decode kernel (tilelang.py), in registers.
//
// Each warp owns 16 tokens of every 64-token tile and keeps its own online-softmax state, so the four
// consumer warps never synchronise inside the loop; they merge once at the end (`finish`). Both
// products run on mma.sync m16n8k16 (f16 in, f32 accumulate) with the GQA group's q heads as rows
// g = lane / 4 (at most 8; rows 8-15 of the tile are zero and their results discarded):
//
//   S = q K^T: K is the B operand. A thread needs, per k-step, two pairs of k values of one token. The
//     sum over d does not care which d each k-step covers, so d is permuted: thread (g, c = lane % 4)
//     covers d in [c D/4, (c + 1) D/4), and k-step kk, element e (k = 2c + e, 2c + 8 + e - 2) maps to
//     d = c D/4 + 4 kk + e. Each 4-byte word of the thread's K span then feeds one k-step directly: its
//     low two bytes are the b0 register and its high two b1, one e4m3x2 -> f16x2 conversion each.
//     q's A fragment uses the same map (built once).
//   O += P V: P comes from S's accumulators (the FA2 register reuse); V is the B operand, whose pairs
//     are two tokens at one d. The output columns are permuted instead: in n-tile j, column g of the
//     thread's B fragment is d = g D/8 + j, so a thread reads D/8 contiguous bytes of 4 token rows and
//     pairs rows with a byte permute. `finish` writes O back in natural column order.
//
// The ring tile in shared memory is [64 tokens][D bytes] with 16-byte chunks XOR-swizzled by the row
// (chunk ^ (row % (D / 16))), which the producer applies when it copies; the loads below are then free
// of bank conflicts at D = 128.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace gqa_fp8 {

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two) {  // the low 16 bits
  uint32_t out;
  const uint16_t in = static_cast<uint16_t>(two);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(out) : "h"(in));
  return out;
}

__device__ __forceinline__ uint32_t f16x2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// (d0, d1) = row g, columns 2c and 2c + 1 of C += A B, where A's rows g + 8 are zero (a1 = a3 = 0)
// and their results are dropped.
__device__ __forceinline__ void mma_rows_g(float& d0, float& d1, uint32_t a0, uint32_t a2, uint32_t b0,
                                           uint32_t b1) {
  float x2, x3;
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11,%12,%13};\n"
      : "=f"(d0), "=f"(d1), "=f"(x2), "=f"(x3)
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(d0), "f"(d1), "f"(0.f), "f"(0.f));
}

template <int D>
__device__ __forceinline__ const uint8_t* chunk(const uint8_t* tile, int row, int ch) {
  return tile + row * D + ((ch ^ (row & (D / 16 - 1))) << 4);
}

template <bool BF16>
__device__ __forceinline__ float to_float(uint16_t bits) {
  if constexpr (BF16) {
    return __uint_as_float(static_cast<uint32_t>(bits) << 16);
  } else {
    return __half2float(__ushort_as_half(bits));
  }
}

template <bool BF16>
__device__ __forceinline__ uint16_t from_float(float x) {
  if constexpr (BF16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  } else {
    return __half_as_ushort(__float2half_rn(x));
  }
}

// q's A fragment (rows g < group; zero otherwise): qa[2 kk] and qa[2 kk + 1] per k-step.
template <int D, bool BF16>
__device__ __forceinline__ void load_q(const void* q_heads, int group, uint32_t* qa, int lane) {
  const int g = lane >> 2, c = lane & 3;
  const uint2* row = reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(q_heads) + g * D + c * (D / 4));
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint2 u = g < group ? row[kk] : make_uint2(0u, 0u);
    qa[2 * kk] = f16x2(to_float<BF16>(u.x & 0xffff), to_float<BF16>(u.x >> 16));
    qa[2 * kk + 1] = f16x2(to_float<BF16>(u.y & 0xffff), to_float<BF16>(u.y >> 16));
  }
}

// This warp's K and V bytes of one ring tile into registers (kr: 2 token rows x D/16 words; vr: 4 token
// rows x D/32 words). The ring slot may be refilled once every consumer thread has returned from here.
template <int D>
__device__ __forceinline__ void load_kv(const void* k_tile, const void* v_tile, uint32_t* kr, uint32_t* vr, int w,
                                        int lane) {
  const uint8_t* k = static_cast<const uint8_t*>(k_tile);
  const uint8_t* v = static_cast<const uint8_t*>(v_tile);
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // tokens g and 8 + g of the warp's 16
    const int row = 16 * w + 8 * h + g;
#pragma unroll
    for (int q = 0; q < D / 64; ++q) {
      const uint4 u = *reinterpret_cast<const uint4*>(chunk<D>(k, row, c * (D / 64) + q));
      uint32_t* o = kr + h * (D / 16) + 4 * q;
      o[0] = u.x, o[1] = u.y, o[2] = u.z, o[3] = u.w;
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // tokens 2c, 2c + 1, 2c + 8, 2c + 9 of the warp's 16
    const int row = 16 * w + 2 * c + (i & 1) + 8 * (i >> 1);
    uint32_t* o = vr + i * (D / 32);
    if constexpr (D == 64) {
      const uint2 u = *reinterpret_cast<const uint2*>(chunk<D>(v, row, g >> 1) + 8 * (g & 1));
      o[0] = u.x, o[1] = u.y;
    } else {
#pragma unroll
      for (int q = 0; q < D / 128; ++q) {
        const uint4 u = *reinterpret_cast<const uint4*>(chunk<D>(v, row, g * (D / 128) + q));
        o[4 * q] = u.x, o[4 * q + 1] = u.y, o[4 * q + 2] = u.z, o[4 * q + 3] = u.w;
      }
    }
  }
}

// One tile: S = q K^T (tokens past `end` at -inf), the online softmax (ml = running max, this thread's
// partial row sum; base 2 with `scale` = softmax scale x log2 e), O = O alpha + P V.
template <int D>
__device__ __forceinline__ void attend(const uint32_t* kr, const uint32_t* vr, const uint32_t* qa, float* acc,
                                       float* ml, int w, int lane, int tile_start, int end, float scale) {
  const int c = lane & 3;
  float s[4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int tok = tile_start + 16 * w + 8 * h + 2 * c;
    // two accumulators per n-tile halve the dependent mma chain
    float d0 = tok < end ? 0.f : -INFINITY, d1 = tok + 1 < end ? 0.f : -INFINITY, e0 = 0.f, e1 = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk += 2) {
      const uint32_t x = kr[h * (D / 16) + kk], y = kr[h * (D / 16) + kk + 1];
      mma_rows_g(d0, d1, qa[2 * kk], qa[2 * kk + 1], e4m3x2_to_f16x2(x), e4m3x2_to_f16x2(x >> 16));
      mma_rows_g(e0, e1, qa[2 * kk + 2], qa[2 * kk + 3], e4m3x2_to_f16x2(y), e4m3x2_to_f16x2(y >> 16));
    }
    s[2 * h] = d0 + e0;
    s[2 * h + 1] = d1 + e1;
  }
  float mx = fmaxf(fmaxf(s[0], s[1]), fmaxf(s[2], s[3]));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float m_new = fmaxf(ml[0], mx);
  const float alpha = exp2f((ml[0] - m_new) * scale);
  const float shift = m_new * scale;
  float p[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = exp2f(s[i] * scale - shift);
  ml[0] = m_new;
  ml[1] = ml[1] * alpha + ((p[0] + p[1]) + (p[2] + p[3]));
  const uint32_t pa0 = f16x2(p[0], p[1]), pa2 = f16x2(p[2], p[3]);  // tokens 2c.., 8 + 2c..
#pragma unroll
  for (int j = 0; j < D / 8; j += 2) {  // n-tiles j and j + 1: bytes j, j + 1 of the thread's V span
    const int word = j >> 2;
    const uint32_t sel = (j & 3) ? 0x7362u : 0x5140u;
    const uint32_t lo = __byte_perm(vr[word], vr[D / 32 + word], sel);              // tokens 2c, 2c + 1
    const uint32_t hi = __byte_perm(vr[D / 16 + word], vr[3 * (D / 32) + word], sel);  // 2c + 8, 2c + 9
#pragma unroll
    for (int u = 0; u < 4; ++u) acc[2 * j + u] *= alpha;
    mma_rows_g(acc[2 * j], acc[2 * j + 1], pa0, pa2, e4m3x2_to_f16x2(lo), e4m3x2_to_f16x2(hi));
    mma_rows_g(acc[2 * j + 2], acc[2 * j + 3], pa0, pa2, e4m3x2_to_f16x2(lo >> 16), e4m3x2_to_f16x2(hi >> 16));
  }
}

// The four warps' states are in shared memory (o_s: 4 x 8 x D floats, m_s / l_s: 32 each, m in units
// of `scale`): merge them and write the split's normalised partial O and base-2 LSE for the group's
// heads (an empty split: O = 0, LSE = -inf). DIRECT (a single split): O is the attention output itself,
// written in q's 16-bit type (BF16 or float16) to `o`, and there is no LSE. `tid` is the consumer thread
// (0-127); named barrier 9 spans the 128 consumers.
template <int D, bool DIRECT, bool BF16>
__device__ __forceinline__ void merge(const float* o_s, const float* m_s, const float* l_s, int tid, int group,
                                      float scale, void* o, int64_t o_head_stride, float* mid_lse,
                                      int64_t lse_head_stride) {
  asm volatile("bar.sync 9, 128;\n" ::: "memory");
  for (int i = tid; i < group * D; i += 128) {
    const int h = i / D, d = i % D;
    float m = m_s[h];
#pragma unroll
    for (int v = 1; v < 4; ++v) m = fmaxf(m, m_s[v * 8 + h]);
    float total = 0.f, out = 0.f;
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const float f = exp2f((m_s[v * 8 + h] - m) * scale);
      total += l_s[v * 8 + h] * f;
      out += o_s[(v * 8 + h) * D + d] * f;
    }
    const float value = total > 0.f ? out / total : 0.f;
    if constexpr (DIRECT) {
      static_cast<uint16_t*>(o)[h * o_head_stride + d] = from_float<BF16>(value);
    } else {
      static_cast<float*>(o)[h * o_head_stride + d] = value;
      if (d == 0) mid_lse[h * lse_head_stride] = total > 0.f ? log2f(total) + m * scale : -INFINITY;
    }
  }
  asm volatile("bar.sync 9, 128;\n" ::: "memory");  // a persistent CTA's next item reuses o_s
}

// This warp's state (rows g < group: head g, its d permuted as in `attend`) into shared memory, then
// `merge`.
template <int D, bool DIRECT, bool BF16>
__device__ __forceinline__ void finish(const float* acc, const float* ml, float* o_s, float* m_s, float* l_s,
                                       int tid, int group, float scale, void* o, int64_t o_head_stride,
                                       float* mid_lse, int64_t lse_head_stride) {
  const int w = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  float l = ml[1];
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (g < group) {
    if (c == 0) m_s[w * 8 + g] = ml[0], l_s[w * 8 + g] = l;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      o_s[(w * 8 + g) * D + (2 * c) * (D / 8) + j] = acc[2 * j];
      o_s[(w * 8 + g) * D + (2 * c + 1) * (D / 8) + j] = acc[2 * j + 1];
    }
  }
  merge<D, DIRECT, BF16>(o_s, m_s, l_s, tid, group, scale, o, o_head_stride, mid_lse, lse_head_stride);
}

// ---- the tile's tokens as the mma rows (the default; `_kernel`'s opt "head_rows" runs the layout above) --
// S^T = K q^T (16 tokens x 8 heads) and O^T = V^T P^T (16 d x 8 heads a tile): rows 0-15 are all real
// tokens or dims, so each mma does twice the useful work of the layout above (whose rows 8-15 are
// zero); only the heads column (8 wide, `group` of it used) is padded. P^T goes from S^T's accumulators
// to the B operand of P V by movmatrix (an 8 x 8 transpose of 16-bit pairs across the warp). Thread
// (g, c) keeps the online-softmax state of heads 2c and 2c + 1: ml = (max a, max b, sum a, sum b), in
// units of the score scale. Against the layout above: 1.03-1.08x a layer (H200, docs/PERF.md,
// seventeenth session), where the consumers alone went from 4.1-5.6 to 5.4-6.9 TB/s equivalent.

__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ void mma_f16(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// K as in `load_kv` (tokens g and 8 + g, the thread's d span); V: tokens 2c, 2c + 1, 2c + 8, 2c + 9 of the
// warp's 16, at d in [g D/16, (g + 1) D/16) ("lo") and [(g + 8) D/16, (g + 9) D/16) ("hi"): vr[(2 i +
// half) D/64 + word].
template <int D>
__device__ __forceinline__ void load_kv_t(const void* k_tile, const void* v_tile, uint32_t* kr, uint32_t* vr, int w,
                                          int lane) {
  const uint8_t* k = static_cast<const uint8_t*>(k_tile);
  const uint8_t* v = static_cast<const uint8_t*>(v_tile);
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = 16 * w + 8 * h + g;
#pragma unroll
    for (int q = 0; q < D / 64; ++q) {
      const uint4 u = *reinterpret_cast<const uint4*>(chunk<D>(k, row, c * (D / 64) + q));
      uint32_t* o = kr + h * (D / 16) + 4 * q;
      o[0] = u.x, o[1] = u.y, o[2] = u.z, o[3] = u.w;
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = 16 * w + 2 * c + (i & 1) + 8 * (i >> 1);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int byte = (g + 8 * half) * (D / 16);
      const uint8_t* src = chunk<D>(v, row, byte >> 4) + (byte & 15);
      uint32_t* o = vr + (2 * i + half) * (D / 64);
      if constexpr (D == 64) {
        o[0] = *reinterpret_cast<const uint32_t*>(src);
      } else if constexpr (D == 128) {
        const uint2 u = *reinterpret_cast<const uint2*>(src);
        o[0] = u.x, o[1] = u.y;
      } else {
        const uint4 u = *reinterpret_cast<const uint4*>(src);
        o[0] = u.x, o[1] = u.y, o[2] = u.z, o[3] = u.w;
      }
    }
  }
}

// One tile in the kq layout: S^T (tokens past `end` at -inf), the online softmax per head, O^T = O^T alpha
// + V^T P^T. acc[4 j + 0..3] = O^T of m-tile j: (d = g D/16 + j: heads 2c, 2c + 1), (d = (g + 8) D/16 +
// j: heads 2c, 2c + 1).
template <int D>
__device__ __forceinline__ void attend_t(const uint32_t* kr, const uint32_t* vr, const uint32_t* qb, float* acc,
                                         float* ml, int w, int lane, int tile_start, int end, float scale) {
  const int g = lane >> 2;
  float s[4] = {0.f, 0.f, 0.f, 0.f}, t[4] = {0.f, 0.f, 0.f, 0.f};  // two chains halve the mma latency
  const uint32_t* k0 = kr;           // token g
  const uint32_t* k1 = kr + D / 16;  // token g + 8
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    mma_f16(kk & 1 ? t : s, e4m3x2_to_f16x2(k0[kk]), e4m3x2_to_f16x2(k1[kk]), e4m3x2_to_f16x2(k0[kk] >> 16),
            e4m3x2_to_f16x2(k1[kk] >> 16), qb[2 * kk], qb[2 * kk + 1]);
  const int tok = tile_start + 16 * w + g;
  const float sa0 = tok < end ? (s[0] + t[0]) * scale : -INFINITY;  // token g, head 2c
  const float sb0 = tok < end ? (s[1] + t[1]) * scale : -INFINITY;  // token g, head 2c + 1
  const float sa1 = tok + 8 < end ? (s[2] + t[2]) * scale : -INFINITY;
  const float sb1 = tok + 8 < end ? (s[3] + t[3]) * scale : -INFINITY;
  float ma = fmaxf(sa0, sa1), mb = fmaxf(sb0, sb1);
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    ma = fmaxf(ma, __shfl_xor_sync(0xffffffffu, ma, off));
    mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, off));
  }
  ma = fmaxf(ml[0], ma);
  mb = fmaxf(ml[1], mb);
  const float alpha_a = exp2f(ml[0] - ma), alpha_b = exp2f(ml[1] - mb);
  const float pa0 = exp2f(sa0 - ma), pb0 = exp2f(sb0 - mb), pa1 = exp2f(sa1 - ma), pb1 = exp2f(sb1 - mb);
  ml[0] = ma, ml[1] = mb;
  ml[2] = ml[2] * alpha_a + (pa0 + pa1);
  ml[3] = ml[3] * alpha_b + (pb0 + pb1);
  const uint32_t pt0 = transpose8x8(f16x2(pa0, pb0));  // P[head g][tokens 2c, 2c + 1]
  const uint32_t pt1 = transpose8x8(f16x2(pa1, pb1));  // P[head g][tokens 2c + 8, 2c + 9]
  constexpr int W = D / 64;                          // words of a V span
#pragma unroll
  for (int j = 0; j < D / 16; j += 2) {  // m-tiles j and j + 1: bytes j, j + 1 of the spans
    const int word = j >> 2;
    const uint32_t sel = (j & 3) ? 0x7362u : 0x5140u;
    const uint32_t lo01 = __byte_perm(vr[0 * W + word], vr[2 * W + word], sel);  // tokens 2c, 2c + 1; d row g
    const uint32_t hi01 = __byte_perm(vr[1 * W + word], vr[3 * W + word], sel);  // d row g + 8
    const uint32_t lo89 = __byte_perm(vr[4 * W + word], vr[6 * W + word], sel);  // tokens 2c + 8, 2c + 9
    const uint32_t hi89 = __byte_perm(vr[5 * W + word], vr[7 * W + word], sel);
#pragma unroll
    for (int u = 0; u < 8; u += 2) acc[4 * j + u] *= alpha_a, acc[4 * j + u + 1] *= alpha_b;
    mma_f16(acc + 4 * j, e4m3x2_to_f16x2(lo01), e4m3x2_to_f16x2(hi01), e4m3x2_to_f16x2(lo89),
            e4m3x2_to_f16x2(hi89), pt0, pt1);
    mma_f16(acc + 4 * j + 4, e4m3x2_to_f16x2(lo01 >> 16), e4m3x2_to_f16x2(hi01 >> 16),
            e4m3x2_to_f16x2(lo89 >> 16), e4m3x2_to_f16x2(hi89 >> 16), pt0, pt1);
  }
}

// `finish` for the kq layout: the sums over the warp's rows, the state of heads 2c, 2c + 1 into shared
// memory in natural d order, then `merge` (m is already in scaled units).
template <int D, bool DIRECT, bool BF16>
__device__ __forceinline__ void finish_t(const float* acc, const float* ml, float* o_s, float* m_s, float* l_s,
                                         int tid, int group, void* o, int64_t o_head_stride, float* mid_lse,
                                         int64_t lse_head_stride) {
  const int w = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  float la = ml[2], lb = ml[3];
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    la += __shfl_xor_sync(0xffffffffu, la, off);
    lb += __shfl_xor_sync(0xffffffffu, lb, off);
  }
  const int ha = 2 * c, hb = 2 * c + 1;
  if (g == 0) {
    if (ha < group) m_s[w * 8 + ha] = ml[0], l_s[w * 8 + ha] = la;
    if (hb < group) m_s[w * 8 + hb] = ml[1], l_s[w * 8 + hb] = lb;
  }
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    const int d_lo = g * (D / 16) + j, d_hi = (g + 8) * (D / 16) + j;
    if (ha < group) o_s[(w * 8 + ha) * D + d_lo] = acc[4 * j], o_s[(w * 8 + ha) * D + d_hi] = acc[4 * j + 2];
    if (hb < group) o_s[(w * 8 + hb) * D + d_lo] = acc[4 * j + 1], o_s[(w * 8 + hb) * D + d_hi] = acc[4 * j + 3];
  }
  merge<D, DIRECT, BF16>(o_s, m_s, l_s, tid, group, 1.f, o, o_head_stride, mid_lse, lse_head_stride);
}

}  // namespace gqa_fp8
