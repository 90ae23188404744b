// One consumer warp's share of the TileLang fp8 GQA decode kernel (tilelang.py), in registers.
//
// Each warp owns 16 tokens of every 64-token tile and keeps its own online-softmax state, so the four
// consumer warps never synchronise inside the loop; they merge once at the end (`finish`). Both
// products run on mma.sync m16n8k16 (f16 in, f32 accumulate), transposed so that every mma row is real
// work: a tile's tokens, then the head dims, are the rows, and the GQA group's q heads the 8 columns
// (`group` of them used). Thread (g = lane / 4, c = lane % 4) keeps the online-softmax state of heads
// 2c and 2c + 1. Against q heads as the rows (rows 8-15 zero, twice the mma count): 1.03-1.07x a layer
// and +4-5% on the Llama-3.1-8B end-to-end benchmark (H200, docs/PERF.md, "end to end").
//
//   S^T = K q^T (16 tokens x 8 heads): K is the A operand (tokens g and g + 8), q the B operand. The sum
//     over d does not care which d each k-step covers, so d is permuted: thread (g, c) covers d in
//     [c D/4, (c + 1) D/4), and k-step kk, element e (k = 2c + e, 2c + 8 + e - 2) maps to d = c D/4 +
//     4 kk + e. Each 4-byte word of the thread's K span then feeds one k-step directly: its low two bytes
//     are a0 (a1 for token g + 8) and its high two a2 (a3), one e4m3x2 -> f16x2 conversion each. q's B
//     fragment uses the same map (built once an item).
//   O^T += V^T P^T (16 d x 8 heads an m-tile): P^T comes from S^T's accumulators, moved to the B
//     operand's layout by movmatrix (an 8 x 8 transpose of 16-bit pairs across the warp). V^T is the A
//     operand, whose pairs are two tokens at one d; the output rows are permuted: in m-tile j, row r is
//     d = r D/16 + j, so a thread reads D/16 contiguous bytes at d = g D/16 and (g + 8) D/16 of 4 token
//     rows and pairs rows with a byte permute. `finish` writes O back in natural order.
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

// q's B fragment of S^T = K q^T (head g; zero for g >= group): qa[2 kk] and qa[2 kk + 1] per k-step.
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

// This warp's K and V bytes of one ring tile into registers. K: tokens g and 8 + g of the warp's 16, the
// thread's d span (kr: 2 x D/16 words). V: tokens 2c, 2c + 1, 2c + 8, 2c + 9, at d in [g D/16, (g + 1)
// D/16) ("lo") and [(g + 8) D/16, (g + 9) D/16) ("hi"): vr[(2 i + half) D/64 + word]. The ring slot may be
// refilled once every consumer thread has returned from here.
template <int D>
__device__ __forceinline__ void load_kv(const void* k_tile, const void* v_tile, uint32_t* kr, uint32_t* vr, int w,
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

// One tile: S^T (tokens past `end` at -inf), the online softmax per head (base 2, `scale` = softmax scale
// x log2 e; ml = (max a, max b, sum a, sum b) for heads a = 2c and b = 2c + 1, the maxima in units of
// `scale`), O^T = O^T alpha + V^T P^T. acc[4 j + 0..3] = O^T of m-tile j: (d = g D/16 + j: heads 2c,
// 2c + 1), (d = (g + 8) D/16 + j: heads 2c, 2c + 1).
template <int D>
__device__ __forceinline__ void attend(const uint32_t* kr, const uint32_t* vr, const uint32_t* qb, float* acc,
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

// The end of a work item: this warp's row sums over its tokens and the state of heads 2c, 2c + 1 into
// shared memory (o_s: 4 x 8 x D floats in natural d order, m_s / l_s: 32 each), then the four warps'
// states merged into the split's normalised partial O and base-2 LSE for the group's heads (an empty
// split: O = 0, LSE = -inf). DIRECT (a single split): O is the attention output itself, written in q's
// 16-bit type (BF16 or float16) to `o`, and there is no LSE. `tid` is the consumer thread (0-127); named
// barrier 9 spans the 128 consumers.
template <int D, bool DIRECT, bool BF16>
__device__ __forceinline__ void finish(const float* acc, const float* ml, float* o_s, float* m_s, float* l_s,
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
  asm volatile("bar.sync 9, 128;\n" ::: "memory");
  for (int i = tid; i < group * D; i += 128) {
    const int h = i / D, d = i % D;
    float m = m_s[h];
#pragma unroll
    for (int v = 1; v < 4; ++v) m = fmaxf(m, m_s[v * 8 + h]);
    float total = 0.f, out = 0.f;
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const float f = exp2f(m_s[v * 8 + h] - m);
      total += l_s[v * 8 + h] * f;
      out += o_s[(v * 8 + h) * D + d] * f;
    }
    const float value = total > 0.f ? out / total : 0.f;
    if constexpr (DIRECT) {
      static_cast<uint16_t*>(o)[h * o_head_stride + d] = from_float<BF16>(value);
    } else {
      static_cast<float*>(o)[h * o_head_stride + d] = value;
      if (d == 0) mid_lse[h * lse_head_stride] = total > 0.f ? log2f(total) + m : -INFINITY;
    }
  }
  asm volatile("bar.sync 9, 128;\n" ::: "memory");  // a persistent CTA's next item reuses o_s
}

}  // namespace gqa_fp8
