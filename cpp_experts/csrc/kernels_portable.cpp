// Portable kernels: the bf16 gemm over the packed bf16 layout (common.h), written so that the compiler
// can auto-vectorise its 16-row inner loop for the baseline x86-64 (or any) target, and the Q8_0
// activation quantisation every path's results are defined by.
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

}  // namespace

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

const Kernels kPortable = {"portable", gemm_bf16_portable};

}  // namespace cpx
