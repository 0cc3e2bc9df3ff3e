// AVX-512 kernels, compiled with per-function target attributes so that the same binary runs on
// CPUs without AVX-512 (they are only called after the CPUID check in cpu.cpp).
//  bf16: vdpbf16ps, 16 output rows per zmm (the packed layout), k-pairs of the activation
//        broadcast; a 2-rowblock x up to 12-token register tile, so one weight line feeds many
//        tokens (GEMM) and one token streams the weights at memory speed (GEMV).
//  q8_0/q4_0: vpdpbusd (unsigned weight bytes x signed Q8_0 activation bytes), one int32 sum per
//        32-value block, then scaled by d_w * d_x into fp32 accumulators, as ggml's vec_dot does.
#include <immintrin.h>

#include "common.h"

#define CPX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni")))

namespace cpx {
namespace {

template <int TT>
CPX_AVX512 inline void mk_bf16(const uint8_t* w0, size_t rbs, int kp, const uint16_t* a, size_t lda,
                               float* c, int ldc) {
  __m512 acc0[TT], acc1[TT];
#pragma GCC unroll 12
  for (int t = 0; t < TT; ++t) acc0[t] = acc1[t] = _mm512_setzero_ps();
  const uint8_t* w1 = w0 + rbs;
  for (int kk = 0; kk < kp; ++kk) {
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
const MkBF16 kMkBF16[kTokTile + 1] = {nullptr,      mk_bf16<1>,  mk_bf16<2>, mk_bf16<3>, mk_bf16<4>,
                                      mk_bf16<5>,   mk_bf16<6>,  mk_bf16<7>, mk_bf16<8>, mk_bf16<9>,
                                      mk_bf16<10>, mk_bf16<11>, mk_bf16<12>};

CPX_AVX512 void gemm_bf16_avx512(const Mat& w, int rb0, int nrb, const uint16_t* a, size_t lda,
                                 int ntok, float* c, int ldc) {
  const size_t rbs = w.rb_stride();
  for (int r = 0; r < nrb; r += 2) {  // nrb is even: rows come in multiples of 32
    const uint8_t* wr = w.data + size_t(rb0 + r) * rbs;
    for (int t = 0; t < ntok; t += kTokTile) {
      const int tt = ntok - t < kTokTile ? ntok - t : kTokTile;
      kMkBF16[tt](wr, rbs, w.k / 2, a + size_t(t) * lda, lda, c + size_t(t) * ldc + r * 16, ldc);
    }
  }
}

template <int TT, bool Q8>
CPX_AVX512 inline void mk_q(const uint8_t* wr, const uint16_t* sr, int nb, const int8_t* xq,
                            const float* xd, const int32_t* xs, int k, float* c, int ldc) {
  constexpr int kGroups = Q8 ? 8 : 4;
  const __m512i lo = _mm512_set1_epi8(15);
  __m512 acc[TT];
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    __m512i wv[8];
    const uint8_t* wb = wr + size_t(b) * kGroups * 64;
    if (Q8) {
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) wv[g] = _mm512_load_si512(wb + g * 64);
    } else {
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        const __m512i v = _mm512_load_si512(wb + g * 64);
        wv[g] = _mm512_and_si512(v, lo);
        wv[g + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo);
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sr + b * 16)));
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) {
      const int8_t* xb = xq + size_t(t) * k + b * 32;
      __m512i s = _mm512_set1_epi32(-(Q8 ? 128 : 8) * xs[size_t(t) * nb + b]);
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        int32_t xv;
        std::memcpy(&xv, xb + 4 * g, 4);
        s = _mm512_dpbusd_epi32(s, wv[g], _mm512_set1_epi32(xv));
      }
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(xd[size_t(t) * nb + b]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[t]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) _mm512_storeu_ps(c + size_t(t) * ldc, acc[t]);
}

using MkQ = void (*)(const uint8_t*, const uint16_t*, int, const int8_t*, const float*, const int32_t*,
                     int, float*, int);
constexpr int kQTile = 8;
const MkQ kMkQ8[kQTile + 1] = {nullptr, mk_q<1, true>, mk_q<2, true>, mk_q<3, true>, mk_q<4, true>,
                               mk_q<5, true>, mk_q<6, true>, mk_q<7, true>, mk_q<8, true>};
const MkQ kMkQ4[kQTile + 1] = {nullptr, mk_q<1, false>, mk_q<2, false>, mk_q<3, false>, mk_q<4, false>,
                               mk_q<5, false>, mk_q<6, false>, mk_q<7, false>, mk_q<8, false>};

CPX_AVX512 void gemm_q_avx512(const Mat& w, int rb0, int nrb, const QAct& a, int row0, int ntok,
                              float* c, int ldc) {
  const int nb = w.k / 32;
  const MkQ* table = w.fmt == Format::Q8_0 ? kMkQ8 : kMkQ4;
  const size_t rbs = w.rb_stride();
  for (int r = 0; r < nrb; ++r) {
    const uint8_t* wr = w.data + size_t(rb0 + r) * rbs;
    const uint16_t* sr = w.scales + size_t(rb0 + r) * nb * 16;
    for (int t = 0; t < ntok; t += kQTile) {
      const int tt = ntok - t < kQTile ? ntok - t : kQTile;
      const size_t row = size_t(row0 + t);
      table[tt](wr, sr, nb, a.q + row * a.k, a.d + row * nb, a.sum + row * nb, a.k,
                c + size_t(t) * ldc + r * 16, ldc);
    }
  }
}

// exp(x) for x <= 0 region used by SiLU (clamped to avoid overflow): 2^n * p(f), |f| <= 0.5.
CPX_AVX512 inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

CPX_AVX512 void silu_mul_avx512(const float* g, const float* u, float* h, int n) {
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    _mm512_storeu_ps(h + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
  }
  for (; i < n; ++i) kPortable.silu_mul(g + i, u + i, h + i, 1);
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

const Kernels kAvx512 = {"avx512_bf16", "avx512_vnni", gemm_bf16_avx512, gemm_q_avx512, silu_mul_avx512};

}  // namespace cpx
