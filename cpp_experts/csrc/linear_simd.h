// AVX-512 pieces shared by the QuantLinear kernels (linear_avx512.cpp: VNNI, linear_amx.cpp: AMX
// int8): reading the packed layout of quant_linear.h into bytes and scales, and scaling one block's
// int32 dot products into the fp32 accumulators. Every function carries the VNNI target attribute,
// so it inlines into the kernels (whose targets include it) and runs only where they run.
#pragma once
// GCC 12 reports the `_mm512_undefined_*` placeholders inside its own intrinsics as maybe-uninitialized
// once they inline here; the diagnostic must be off where the intrinsic headers are read.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "quant_linear.h"

#define CPX_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

namespace cpx {
namespace lin {

CPX_VNNI inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
CPX_VNNI inline __m512 f16x16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
CPX_VNNI inline __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
CPX_VNNI inline __m512 i8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// Bit `from` of every byte moved to bit `to` by a 16-bit shift; bits that crossed into the other
// byte land outside the caller's mask. `from`/`to` are constants once the group loop is unrolled.
CPX_VNNI inline __m512i move_bits(__m512i v, int from, int to) {
  return from < to ? _mm512_slli_epi16(v, unsigned(to - from)) : _mm512_srli_epi16(v, unsigned(from - to));
}
// a | (b & c)
CPX_VNNI inline __m512i or_and(__m512i a, __m512i b, __m512i c) { return _mm512_ternarylogic_epi32(a, b, c, 0xf8); }

// The IQ4 levels + 128 (unsigned bytes) in every 128-bit lane: vpshufb's table for the nibble indices.
CPX_VNNI inline __m512i iq4_table() {
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Unsigned)));
}

// Group g (0..3) of a 4-bit format's packed block at wb, as unsigned bytes: `lo` holds elements
// 4g + c, `hi` elements 16 + 4g + c, with the q5_k / q6_k high bits put back (iq4: the levels + 128).
template <LinFormat F>
CPX_VNNI inline void unpack_group(const uint8_t* wb, int g, __m512i& lo, __m512i& hi) {
  if constexpr (lin_two_bit(F)) {  // the 2-bit plane (and q3_k's third bits)
    const __m512i p = _mm512_loadu_si512(wb + 64 * (g / 2)), m3 = _mm512_set1_epi8(0x03);
    lo = _mm512_and_si512(move_bits(p, 4 * (g % 2), 0), m3);
    hi = _mm512_and_si512(move_bits(p, 4 * (g % 2) + 2, 0), m3);
    if constexpr (F == LinFormat::Q3_K) {
      const __m512i h = _mm512_loadu_si512(wb + 128), mask = _mm512_set1_epi8(0x04);
      lo = or_and(lo, move_bits(h, 2 * g, 2), mask);
      hi = or_and(hi, move_bits(h, 2 * g + 1, 2), mask);
    }
    return;
  }
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  const __m512i v = _mm512_loadu_si512(wb + 64 * g);
  lo = _mm512_and_si512(v, m4);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
  if constexpr (lin_fifth_bit(F)) {
    const __m512i h = _mm512_loadu_si512(wb + 256), mask = _mm512_set1_epi8(0x10);
    lo = or_and(lo, move_bits(h, 2 * g, 4), mask);
    hi = or_and(hi, move_bits(h, 2 * g + 1, 4), mask);
  }
  if constexpr (F == LinFormat::Q6_K) {
    const __m512i h = _mm512_loadu_si512(wb + 256 + 64 * (g / 2)), mask = _mm512_set1_epi8(0x30);
    lo = or_and(lo, move_bits(h, 4 * (g % 2), 4), mask);
    hi = or_and(hi, move_bits(h, 4 * (g % 2) + 2, 4), mask);
  }
  if constexpr (lin_iq4(F)) {
    const __m512i table = iq4_table();
    lo = _mm512_shuffle_epi8(table, lo);
    hi = _mm512_shuffle_epi8(table, hi);
  }
}

constexpr bool has_min(LinFormat f) { return lin_has_m(f) || lin_has_dmin(f); }

// One block's per-row scales: dw multiplies the dot product (lin_split16: of elements 0..15, dw2 of
// 16..31), mw the activation sum (the min term of q4_1 / q5_1 / q4_k / q5_k; q2_k: of elements 0..15, mw2 of
// 16..31). dsup / msup: the K-quants' superblock d / dmin of the 16 rows.
struct Scales {
  __m512 dw, mw, dw2, mw2;
};
template <LinFormat F>
CPX_VNNI inline Scales block_scales(const uint8_t* wb, __m512 dsup, __m512 msup) {
  Scales s{_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  if constexpr (lin_one_block(F)) s.dw = f16x16(wb + lin_d_at(F));
  if constexpr (lin_has_m(F)) s.mw = f16x16(wb + lin_d_at(F) + 32);
  if constexpr (F == LinFormat::IQ4_XS) s.dw = _mm512_mul_ps(dsup, i8x16(wb + 256));
  if constexpr (F == LinFormat::Q4_K || F == LinFormat::Q5_K) {
    const uint8_t* sc = wb + (F == LinFormat::Q5_K ? 320 : 256);
    s.dw = _mm512_mul_ps(dsup, u8x16(sc));
    s.mw = _mm512_mul_ps(msup, u8x16(sc + 16));
  }
  if constexpr (F == LinFormat::Q6_K || F == LinFormat::Q3_K) {
    const uint8_t* sc = wb + (F == LinFormat::Q6_K ? 384 : 192);
    s.dw = _mm512_mul_ps(dsup, i8x16(sc));
    s.dw2 = _mm512_mul_ps(dsup, i8x16(sc + 16));
  }
  if constexpr (F == LinFormat::Q2_K) {  // scale in the low nibble, min in the high one
    const __m512i m4 = _mm512_set1_epi32(15);
    const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 128)));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 144)));
    s.dw = _mm512_mul_ps(dsup, _mm512_cvtepi32_ps(_mm512_and_si512(a, m4)));
    s.dw2 = _mm512_mul_ps(dsup, _mm512_cvtepi32_ps(_mm512_and_si512(b, m4)));
    s.mw = _mm512_mul_ps(msup, _mm512_cvtepi32_ps(_mm512_srli_epi32(a, 4)));
    s.mw2 = _mm512_mul_ps(msup, _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)));
  }
  return s;
}

// acc += one block's contribution for one row of x: `s` (lin_split16: `s`, `s2`) its int32 dot
// products with the zero point already taken off, dx the row's block scale, ds = dx * (sum of its q);
// q2_k: s16 the row's two sums of q per 16 values.
template <LinFormat F>
CPX_VNNI inline __m512 accumulate(__m512 acc, __m512i s, __m512i s2, const Scales& w, float dx, float ds,
                                  const int32_t* s16 = nullptr) {
  const __m512 vdx = _mm512_set1_ps(dx);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(w.dw, vdx), acc);
  if constexpr (lin_has_m(F)) acc = _mm512_fmadd_ps(w.mw, _mm512_set1_ps(ds), acc);
  if constexpr (F == LinFormat::Q4_K || F == LinFormat::Q5_K) acc = _mm512_fnmadd_ps(w.mw, _mm512_set1_ps(ds), acc);
  if constexpr (lin_split16(F)) acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s2), _mm512_mul_ps(w.dw2, vdx), acc);
  if constexpr (F == LinFormat::Q2_K) {
    acc = _mm512_fnmadd_ps(w.mw, _mm512_set1_ps(dx * float(s16[0])), acc);
    acc = _mm512_fnmadd_ps(w.mw2, _mm512_set1_ps(dx * float(s16[1])), acc);
  }
  return acc;
}

}  // namespace lin
}  // namespace cpx
