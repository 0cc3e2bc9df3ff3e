// AVX-512 kernels, compiled with per-function target attributes so that the same binary runs on
// CPUs without AVX-512 (they are only called after the CPUID check in cpu.cpp).
//  bf16: vdpbf16ps, 16 output rows per zmm (the packed layout), k-pairs of the activation
//        broadcast; a 2-rowblock x up to 12-token register tile, so one weight line feeds many
//        tokens (GEMM) and one token streams the weights at memory speed (GEMV).
//  The Q8_0 activation quantisation of the AVX-512 path (the int8 gemms are in linear_avx512.cpp).
#include "cpu.h"  // CPX_X86
#if CPX_X86  // an x86 path: elsewhere this file compiles to nothing
#include <immintrin.h>

#include "common.h"
#include "cpu.h"

#define CPX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni")))

namespace cpx {
namespace {

// NTA: prefetch both rowblocks' weights non-temporally (gemm_bf16_avx512, cpu.h).
template <int TT, bool NTA>
CPX_AVX512 inline void mk_bf16(const uint8_t* w0, size_t rbs, int kp, const uint16_t* a, size_t lda,
                               float* c, int ldc) {
  __m512 acc0[TT], acc1[TT];
#pragma GCC unroll 12
  for (int t = 0; t < TT; ++t) acc0[t] = acc1[t] = _mm512_setzero_ps();
  const uint8_t* w1 = w0 + rbs;
  for (int kk = 0; kk < kp; ++kk) {
    if constexpr (NTA) {
      _mm_prefetch(reinterpret_cast<const char*>(w0 + size_t(kk) * 64 + kNtaPrefetchBytes), _MM_HINT_NTA);
      _mm_prefetch(reinterpret_cast<const char*>(w1 + size_t(kk) * 64 + kNtaPrefetchBytes), _MM_HINT_NTA);
    }
    const __m512i wa = _mm512_load_si512(w0 + size_t(kk) * 64);
    const __m512i wb = _mm512_load_si512(w1 + size_t(kk) * 64);
#pragma GCC unroll 12
    for (int t = 0; t < TT; ++t) {
      int32_t xv;
      std::memcpy(&xv, a + t * lda + 2 * kk, 4);
      const __m512i x = _mm512_set1_epi32(xv);
      acc0[t] = _mm512_dpbf16_ps(acc0[t], (__m512bh)wa, (__m512bh)x);
      acc1[t] = _mm512_dpbf16_ps(acc1[t], (__m512bh)wb, (__m512bh)x);
    }
  }
#pragma GCC unroll 12
  for (int t = 0; t < TT; ++t) {
    _mm512_storeu_ps(c + size_t(t) * ldc, acc0[t]);
    _mm512_storeu_ps(c + size_t(t) * ldc + 16, acc1[t]);
  }
}

using MkBF16 = void (*)(const uint8_t*, size_t, int, const uint16_t*, size_t, float*, int);
constexpr int kTokTile = 12;
const MkBF16 kMkBF16[kTokTile + 1] = {nullptr,           mk_bf16<1, false>,  mk_bf16<2, false>, mk_bf16<3, false>,
                                      mk_bf16<4, false>,  mk_bf16<5, false>,  mk_bf16<6, false>, mk_bf16<7, false>,
                                      mk_bf16<8, false>,  mk_bf16<9, false>,  mk_bf16<10, false>, mk_bf16<11, false>,
                                      mk_bf16<12, false>};
constexpr int kNtaMaxTok = 3;
const MkBF16 kMkBF16Nta[kNtaMaxTok + 1] = {nullptr, mk_bf16<1, true>, mk_bf16<2, true>, mk_bf16<3, true>};

// A decode pass (at most kNtaMaxTok tokens: each weight read once) prefetches its two rowblocks'
// weights non-temporally where the int8 kernels' do (nta_decode_prefetch): the hardware prefetchers
// alone fill L2 and L3 with weights read once. On a 2-core Zen 5 VM (DeepSeek-V2-Lite-shaped bf16
// decode, two processes, interleaved rounds in a fast read spell, medians): +5.3% over 10 rounds (an
// environment switch in one build) and +2.2% over 8 (against the build before).
const bool kBf16Nta = nta_decode_prefetch();

CPX_AVX512 void gemm_bf16_avx512(const Mat& w, int rb0, int nrb, const uint16_t* a, size_t lda,
                                 int ntok, float* c, int ldc) {
  const size_t rbs = w.rb_stride();
  const MkBF16* mk = kBf16Nta && ntok <= kNtaMaxTok ? kMkBF16Nta : kMkBF16;
  for (int r = 0; r < nrb; r += 2) {  // nrb is even: rows come in multiples of 32
    const uint8_t* wr = w.data + size_t(rb0 + r) * rbs;
    for (int t = 0; t < ntok; t += kTokTile) {
      const int tt = ntok - t < kTokTile ? ntok - t : kTokTile;
      mk[tt](wr, rbs, w.k / 2, a + size_t(t) * lda, lda, c + size_t(t) * ldc + r * 16, ldc);
    }
  }
}

}  // namespace

// Same results as quantize_row_q8 bit for bit: the same fp32 divide and reciprocal, and
// round-half-away-from-zero done exactly (truncate, then step away where |fraction| >= 0.5).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void quantize_row_q8_avx512(const float* x, int k, int8_t* q, float* d, int32_t* sum) {
  const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f), zero = _mm512_setzero_ps();
  for (int b = 0; b < k / 32; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + b * 32), x1 = _mm512_loadu_ps(x + b * 32 + 16);
    // x - x is NaN exactly where x is NaN or infinite
    if (_mm512_cmp_ps_mask(_mm512_sub_ps(x0, x0), zero, _CMP_NEQ_UQ) |
        _mm512_cmp_ps_mask(_mm512_sub_ps(x1, x1), zero, _CMP_NEQ_UQ)) {
      std::memset(q + b * 32, 0, 32);
      d[b] = __builtin_nanf("");
      sum[b] = 0;
      continue;
    }
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
    const __m512 vid = _mm512_set1_ps(id);
    __m512i qi[2];
    const __m512 xs[2] = {x0, x1};
    for (int h = 0; h < 2; ++h) {
      const __m512 v = _mm512_mul_ps(xs[h], vid);
      const __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      const __mmask16 away = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(v, t)), half, _CMP_GE_OQ);
      const __m512 step = _mm512_or_ps(one, _mm512_and_ps(v, _mm512_set1_ps(-0.0f)));  // +-1, sign of v
      qi[h] = _mm512_cvttps_epi32(_mm512_mask_add_ps(t, away, t, step));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32 + 16 * h), _mm512_cvtepi32_epi8(qi[h]));
    }
    d[b] = db;
    sum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(qi[0], qi[1]));
  }
}

const Kernels kAvx512 = {"avx512_bf16", gemm_bf16_avx512};

}  // namespace cpx

#endif  // CPX_X86
