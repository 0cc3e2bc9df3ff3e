// Portable kernels: plain C++ over the packed layouts, written so that the compiler can
// auto-vectorise the 16-row inner loops for the baseline x86-64 (or any) target.
#include <cmath>
#include <limits>

#include "common.h"

namespace cpx {
namespace {

void gemm_bf16_portable(const Mat& w, int rb0, int nrb, const uint16_t* a, size_t lda, int ntok,
                        float* c, int ldc) {
  const int kp = w.k / 2;
  for (int r = 0; r < nrb; ++r) {
    const uint16_t* wr = reinterpret_cast<const uint16_t*>(w.data + size_t(rb0 + r) * w.rb_stride());
    for (int t = 0; t < ntok; ++t) {
      const uint16_t* x = a + size_t(t) * lda;
      float acc[16] = {};
      for (int kk = 0; kk < kp; ++kk) {
        const float x0 = bf16_to_f32(x[2 * kk]), x1 = bf16_to_f32(x[2 * kk + 1]);
        const uint16_t* wk = wr + size_t(kk) * 32;
        for (int j = 0; j < 16; ++j) acc[j] += bf16_to_f32(wk[2 * j]) * x0 + bf16_to_f32(wk[2 * j + 1]) * x1;
      }
      float* cr = c + size_t(t) * ldc + r * 16;
      for (int j = 0; j < 16; ++j) cr[j] = acc[j];
    }
  }
}

void silu_mul_portable(const float* g, const float* u, float* h, int n) {
  for (int i = 0; i < n; ++i) h[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

}  // namespace

// Also the AVX2 path's int8 gemm (kernels_avx2.cpp).
void gemm_q_portable(const Mat& w, int rb0, int nrb, const QAct& a, int row0, int ntok, float* c,
                     int ldc) {
  const int nb = w.k / 32;
  const bool q8 = w.fmt == Format::Q8_0;
  const int groups = q8 ? 8 : 4;
  const int32_t off = q8 ? 128 : 8;
  for (int r = 0; r < nrb; ++r) {
    const uint8_t* wr = w.data + size_t(rb0 + r) * w.rb_stride();
    const uint16_t* sr = w.scales + size_t(rb0 + r) * nb * 16;
    for (int t = 0; t < ntok; ++t) {
      const size_t arow = size_t(row0 + t);
      const int8_t* xq = a.q + arow * a.k;
      const float* xd = a.d + arow * nb;
      const int32_t* xs = a.sum + arow * nb;
      float acc[16] = {};
      for (int b = 0; b < nb; ++b) {
        const uint8_t* wb = wr + size_t(b) * groups * 64;
        const int8_t* xb = xq + b * 32;
        int32_t isum[16] = {};
        for (int g = 0; g < groups; ++g) {
          const uint8_t* wg = wb + g * 64;
          for (int j = 0; j < 16; ++j) {
            int32_t s = 0;
            for (int cc = 0; cc < 4; ++cc) {
              const int v = wg[4 * j + cc];
              if (q8) {
                s += v * xb[4 * g + cc];
              } else {
                s += (v & 15) * xb[4 * g + cc] + (v >> 4) * xb[16 + 4 * g + cc];
              }
            }
            isum[j] += s;
          }
        }
        const float dx = xd[b];
        const int32_t corr = off * xs[b];
        for (int j = 0; j < 16; ++j) acc[j] += f16_to_f32(sr[b * 16 + j]) * dx * float(isum[j] - corr);
      }
      float* cr = c + size_t(t) * ldc + r * 16;
      for (int j = 0; j < 16; ++j) cr[j] = acc[j];
    }
  }
}

void quantize_row_q8(const float* x, int k, int8_t* q, float* d, int32_t* sum) {
  for (int b = 0; b < k / 32; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.0f;
    bool finite = true;
    for (int i = 0; i < 32; ++i) {
      amax = std::fmax(amax, std::fabs(xb[i]));
      finite = finite && std::isfinite(xb[i]);
    }
    if (!finite) {  // a NaN scale makes every product with this block NaN, as a float matmul would
      std::memset(q + b * 32, 0, 32);
      d[b] = std::numeric_limits<float>::quiet_NaN();
      sum[b] = 0;
      continue;
    }
    const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
    int32_t s = 0;
    for (int i = 0; i < 32; ++i) {
      const int v = int(std::round(xb[i] * id));  // half away from zero, as ggml's roundf
      q[b * 32 + i] = int8_t(v);
      s += v;
    }
    d[b] = db;
    sum[b] = s;
  }
}

const Kernels kPortable = {"portable", "portable", gemm_bf16_portable, gemm_q_portable,
                           silu_mul_portable};

}  // namespace cpx
