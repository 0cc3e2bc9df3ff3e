// The AVX2 + FMA bf16 gemm of the kernel table (common.h), compiled with per-function target
// attributes and called only after cpu.cpp found AVX2, FMA and F16C.
//
//  bf16: the packed [N/16][K/2][16][2] layout's 64-byte line (one k-pair of 16 rows) is two ymm of
//        8 32-bit lanes (rows 0..7, 8..15), each lane the row's (even k, odd k) bf16 pair: even k
//        is `lane << 16`, odd k `lane & 0xffff0000` as fp32, each FMA'd against its x[k] broadcast
//        (x's bf16 pair split the same way). Tiles: 2 rowblocks x 1 or 2 rows of x stream the weights
//        at decode; above, 1 rowblock x 4 rows of x (8 accumulators, the two halves' 4 unpacked
//        weights and one row's x pair in 15 ymm), so each unpacked line feeds 8 FMAs, the rowblock's
//        lines reused from L1/L2 by every tile of rows. Every tile sums an output the same way (one
//        chain, even k then odd k, pair after pair), so that a row's result does not depend on the
//        rows beside it (a request's logits on its batch). A 1-row tile used to keep odd k in chains
//        of their own (twice the chains, a different sum): without them a 64 MiB weight at one row
//        took a median 5% longer over four interleaved pairs (0-11%) from a Xeon's L3, this path forced
//        there; not measured from DRAM on an AVX2-only CPU, where the read bounds it.
#include "cpu.h"  // CPX_X86
#if CPX_X86  // an x86 path: elsewhere this file compiles to nothing
#include <immintrin.h>

#include <algorithm>

#include "common.h"

#define CPX_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace cpx {
namespace {

constexpr size_t kPrefetchBytes = 4096;  // ahead along each rowblock's run, as linear_avx2.cpp

// The bf16 pair at p broadcast, split into fp32 (even, odd).
CPX_AVX2 inline void split_pair(const uint16_t* p, __m256& e, __m256& o) {
  const __m256 v = _mm256_broadcast_ss(reinterpret_cast<const float*>(p));
  e = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(v), 16));
  o = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(int32_t(0xffff0000u))));
}
CPX_AVX2 inline void split_line(const uint8_t* p, __m256& e, __m256& o) {
  const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
  e = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  o = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int32_t(0xffff0000u))));
}

// c[t][0 .. 16 R) for TT rows of x from R rowblocks (rbs bytes apart) over kp k-pairs.
template <int R, int TT>
CPX_AVX2 void mk_bf16(const uint8_t* w0, size_t rbs, int kp, const uint16_t* a, size_t lda, float* c, int ldc) {
  __m256 acc[R][2][TT];
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h)
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) acc[r][h][t] = _mm256_setzero_ps();
  for (int kk = 0; kk < kp; ++kk) {
    if constexpr (TT <= 2) {
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w0 + r * rbs + size_t(kk) * 64 + kPrefetchBytes), _MM_HINT_T0);
    }
    if constexpr (R == 2) {  // TT <= 2: x pairs split once, weights one half at a time
      __m256 xe[TT], xo[TT];
#pragma GCC unroll 2
      for (int t = 0; t < TT; ++t) split_pair(a + t * lda + 2 * kk, xe[t], xo[t]);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          __m256 we, wo;
          split_line(w0 + r * rbs + size_t(kk) * 64 + 32 * h, we, wo);
#pragma GCC unroll 2
          for (int t = 0; t < TT; ++t) {
            acc[r][h][t] = _mm256_fmadd_ps(we, xe[t], acc[r][h][t]);
            acc[r][h][t] = _mm256_fmadd_ps(wo, xo[t], acc[r][h][t]);
          }
        }
    } else {  // R == 1: both halves' weights split once, x one row at a time
      __m256 we[2], wo[2];
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) split_line(w0 + size_t(kk) * 64 + 32 * h, we[h], wo[h]);
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) {
        __m256 xe, xo;
        split_pair(a + t * lda + 2 * kk, xe, xo);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          acc[0][h][t] = _mm256_fmadd_ps(we[h], xe, acc[0][h][t]);
          acc[0][h][t] = _mm256_fmadd_ps(wo[h], xo, acc[0][h][t]);
        }
      }
    }
  }
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h)
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t)
        _mm256_storeu_ps(c + size_t(t) * ldc + 16 * r + 8 * h, acc[r][h][t]);
}

using MkBF16 = void (*)(const uint8_t*, size_t, int, const uint16_t*, size_t, float*, int);
constexpr int kTokTile = 4;
const MkBF16 kMkPair[2] = {mk_bf16<2, 1>, mk_bf16<2, 2>};  // [TT - 1], two rowblocks
const MkBF16 kMkOne[kTokTile] = {mk_bf16<1, 1>, mk_bf16<1, 2>, mk_bf16<1, 3>, mk_bf16<1, 4>};  // [TT - 1]

CPX_AVX2 void gemm_bf16_avx2(const Mat& w, int rb0, int nrb, const uint16_t* a, size_t lda, int ntok, float* c,
                             int ldc) {
  const size_t rbs = w.rb_stride();
  const int kp = w.k / 2;
  if (ntok <= 2) {  // one pass over the weights, rowblocks in pairs (nrb is even: rows come in 32s)
    for (int r = 0; r < nrb; r += 2)
      kMkPair[ntok - 1](w.data + size_t(rb0 + r) * rbs, rbs, kp, a, lda, c + r * 16, ldc);
    return;
  }
  for (int r = 0; r < nrb; ++r)
    for (int t = 0; t < ntok; t += kTokTile) {
      const int tt = std::min(kTokTile, ntok - t);
      kMkOne[tt - 1](w.data + size_t(rb0 + r) * rbs, rbs, kp, a + size_t(t) * lda, lda,
                     c + size_t(t) * ldc + r * 16, ldc);
    }
}

}  // namespace

const Kernels kAvx2 = {"avx2", gemm_bf16_avx2};

}  // namespace cpx

#endif  // CPX_X86
