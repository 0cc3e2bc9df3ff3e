// Portable QuantLinear kernels: plain C++ over the packed layouts (quant_linear.h). They serve CPUs
// without AVX2 and are what the AVX2 and AVX-512 kernels are tested against.
#include <algorithm>

#include "quant_linear.h"

namespace cpx {
namespace {

float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

}  // namespace

// Row r's 32 unsigned quant values of the packed block at bp (iq4: the levels + 128).
void unpack_block(LinFormat f, const uint8_t* bp, int r, uint8_t* q) {
  for (int c = 0; c < 4; ++c) {
    if (f == LinFormat::Q8_0) {
      for (int g = 0; g < 8; ++g) q[4 * g + c] = bp[g * 64 + r * 4 + c];
      continue;
    }
    for (int g = 0; g < 4; ++g) {
      const uint8_t v = lin_two_bit(f) ? 0 : bp[g * 64 + r * 4 + c];  // (the 2-bit blocks are shorter)
      for (int h = 0; h < 2; ++h) {
        uint8_t e = uint8_t(h ? v >> 4 : v & 15);
        if (lin_two_bit(f)) {
          e = uint8_t((bp[64 * (g / 2) + r * 4 + c] >> (4 * (g % 2) + 2 * h)) & 3);
          if (f == LinFormat::Q3_K) e |= uint8_t(((bp[128 + r * 4 + c] >> (2 * g + h)) & 1) << 2);
        }
        if (lin_fifth_bit(f)) e |= uint8_t(((bp[256 + r * 4 + c] >> (2 * g + h)) & 1) << 4);
        if (f == LinFormat::Q6_K)
          e |= uint8_t(((bp[256 + 64 * (g / 2) + r * 4 + c] >> (4 * (g % 2) + 2 * h)) & 3) << 4);
        if (lin_iq4(f)) e = kIq4Unsigned[e];
        q[16 * h + 4 * g + c] = e;
      }
    }
  }
}

namespace {

void gemm_portable(const QMat& w, int rb0, int rb1, const ActQ& a, int t0, int nt, float* c, int ldc) {
  const LinLayout& L = kLinLayout[int(w.fmt)];
  const bool kq = L.sb_blocks > 1;
  const int nb = a.k / 32;
  for (int t = 0; t < nt; ++t) std::fill(c + size_t(t) * ldc, c + size_t(t) * ldc + (rb1 - rb0) * 16, 0.0f);
  uint8_t q[32];
  for (int rb = rb0; rb < rb1; ++rb) {
    for (int r = 0; r < 16; ++r) {
      float* col = c + (rb - rb0) * 16 + r;
      for (int sb = 0; sb < w.nsb; ++sb) {
        const uint8_t* base = w.at(rb) + size_t(sb) * kGroupRowblocks * w.sb_bytes;
        const float D = kq ? f16(base + 2 * r) : 0.0f;
        const float Dmin = lin_has_dmin(w.fmt) ? f16(base + 32 + 2 * r) : 0.0f;
        for (int j = 0; j < L.sb_blocks; ++j) {
          const int b = sb * L.sb_blocks + j;
          const uint8_t* bp = base + L.hdr + size_t(j) * L.blk;
          unpack_block(w.fmt, bp, r, q);
          for (int t = 0; t < nt; ++t) {
            const size_t row = size_t(t0 + t);
            const int8_t* x = a.q + row * a.k + 32 * b;
            int32_t lo = 0, hi = 0;
            for (int i = 0; i < 16; ++i) {
              lo += q[i] * x[i];
              hi += q[16 + i] * x[16 + i];
            }
            const float dx = a.d[row * nb + b], ds = a.ds[row * nb + b];
            const int32_t s = a.s[row * nb + b];
            float& acc = col[size_t(t) * ldc];
            if (lin_one_block(w.fmt)) {  // w = d (q - zero point) (+ m)
              acc += float(lo + hi - lin_zero_point(w.fmt) * s) * (f16(bp + lin_d_at(w.fmt) + 2 * r) * dx);
              if (lin_has_m(w.fmt)) acc += f16(bp + lin_d_at(w.fmt) + 32 + 2 * r) * ds;
              continue;
            }
            switch (w.fmt) {
              case LinFormat::IQ4_XS:
                acc += float(lo + hi - 128 * s) * (D * float(int8_t(bp[256 + r])) * dx);
                break;
              case LinFormat::Q4_K:
              case LinFormat::Q5_K: {
                const uint8_t* sc = bp + (w.fmt == LinFormat::Q5_K ? 320 : 256);
                acc += float(lo + hi) * (D * float(sc[r]) * dx);
                acc -= Dmin * float(sc[16 + r]) * ds;
                break;
              }
              case LinFormat::Q6_K:
              case LinFormat::Q3_K: {
                const int8_t* sc = reinterpret_cast<const int8_t*>(bp + (w.fmt == LinFormat::Q6_K ? 384 : 192));
                const int32_t* s16 = a.s16 + row * 2 * nb + 2 * b;
                const int off = lin_offset16(w.fmt);
                acc += float(lo - off * s16[0]) * (D * float(sc[r]) * dx);
                acc += float(hi - off * s16[1]) * (D * float(sc[16 + r]) * dx);
                break;
              }
              case LinFormat::Q2_K: {
                const int32_t* s16 = a.s16 + row * 2 * nb + 2 * b;
                const uint8_t a = bp[128 + r], c = bp[144 + r];  // sc | mn << 4
                acc += float(lo) * (D * float(a & 15) * dx) + float(hi) * (D * float(c & 15) * dx);
                acc -= Dmin * float(a >> 4) * (dx * float(s16[0])) + Dmin * float(c >> 4) * (dx * float(s16[1]));
                break;
              }
              default:  // the one-block formats (above); bf16 and f32 have other kernels
                break;
            }
          }
        }
      }
    }
  }
}

// f32 weights [rowblock][k][16]: one 16-row accumulator per row of x, in k order.
void gemm_f32_portable(const float* w, int k, int rb0, int rb1, const float* x, size_t ldx, int nt, float* c,
                       int ldc) {
  for (int rb = rb0; rb < rb1; ++rb) {
    const float* wr = w + size_t(rb) * k * 16;
    for (int t = 0; t < nt; ++t) {
      const float* xr = x + size_t(t) * ldx;
      float acc[16] = {};
      for (int i = 0; i < k; ++i)
        for (int j = 0; j < 16; ++j) acc[j] += wr[size_t(i) * 16 + j] * xr[i];
      std::copy(acc, acc + 16, c + size_t(t) * ldc + (rb - rb0) * 16);
    }
  }
}

void store_portable(const float* c, int ldc, int nt, int ncols, const float* bias, void* out, bool bf16,
                    size_t ldo) {
  for (int t = 0; t < nt; ++t) {
    for (int j = 0; j < ncols; ++j) {
      const float v = bias ? c[size_t(t) * ldc + j] + bias[j] : c[size_t(t) * ldc + j];
      if (bf16)
        static_cast<uint16_t*>(out)[size_t(t) * ldo + j] = f32_to_bf16(v);
      else
        static_cast<float*>(out)[size_t(t) * ldo + j] = v;
    }
  }
}

void to_bf16_portable(const float* x, uint16_t* y, int n) {
  for (int i = 0; i < n; ++i) y[i] = f32_to_bf16(x[i]);
}

}  // namespace

const LinKernels kLinPortable = {
    "portable",
    {nullptr, gemm_portable, gemm_portable, gemm_portable, gemm_portable, gemm_portable, gemm_portable, nullptr,
     gemm_portable, gemm_portable, gemm_portable, gemm_portable, gemm_portable, gemm_portable},
    quantize_row_q8,
    store_portable,
    to_bf16_portable,
    gemm_f32_portable,
};

}  // namespace cpx
