// Portable QuantLinear kernels: plain C++ over the packed layouts (quant_linear.h). They serve x86 CPUs
// without AVX2 and every CPU that is not x86 (aarch64: cpu.h's CPX_X86), and are what the AVX2 and
// AVX-512 kernels are tested against. Written for the compiler to vectorise (SSE2 on the x86-64
// baseline, NEON on aarch64): on the 2-core Zen 5 VM, SmolLM2 Q4_1 decode on them went from 0.022 to
// 0.096 of the AVX-512 kernels' speed (a block unpacked per row with run-time format tests before).
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

// Byte c of row r's 4-byte word at p (the packed layouts hold, per 64-byte line, a word per row): a
// shift of 16 contiguous words, where bp[r * 4 + c] would be a stride-4 byte gather.
inline uint32_t row_byte(const uint8_t* p, int r, int c) {
  uint32_t u;
  std::memcpy(&u, p + 4 * r, 4);
  return (u >> (8 * c)) & 0xffu;
}

// A block's 32 quant values for all 16 rows of a rowblock, k-major (qt[k][row]), the format known at
// compile time: unpack_block's arithmetic without its run-time format tests, in loops over the rows
// that a compiler vectorises.
template <LinFormat F>
inline void unpack_rowblock(const uint8_t* bp, uint8_t (*qt)[16]) {
  for (int g = 0; g < (F == LinFormat::Q8_0 ? 8 : 4); ++g)
    for (int c = 0; c < 4; ++c)
      for (int h = 0; h < (F == LinFormat::Q8_0 ? 1 : 2); ++h)
        for (int r = 0; r < 16; ++r) {
          if constexpr (F == LinFormat::Q8_0) {
            qt[4 * g + c][r] = uint8_t(row_byte(bp + g * 64, r, c));
          } else {
            uint32_t e;
            if constexpr (lin_two_bit(F)) {
              e = (row_byte(bp + 64 * (g / 2), r, c) >> (4 * (g % 2) + 2 * h)) & 3;
              if constexpr (F == LinFormat::Q3_K) e |= ((row_byte(bp + 128, r, c) >> (2 * g + h)) & 1) << 2;
            } else {
              e = h ? row_byte(bp + g * 64, r, c) >> 4 : row_byte(bp + g * 64, r, c) & 15;
            }
            if constexpr (lin_fifth_bit(F)) e |= ((row_byte(bp + 256, r, c) >> (2 * g + h)) & 1) << 4;
            if constexpr (F == LinFormat::Q6_K)
              e |= ((row_byte(bp + 256 + 64 * (g / 2), r, c) >> (4 * (g % 2) + 2 * h)) & 3) << 4;
            if constexpr (lin_iq4(F)) e = kIq4Unsigned[e];
            qt[16 * h + 4 * g + c][r] = uint8_t(e);
          }
        }
}

// Each block is unpacked once for the rowblock's 16 rows and multiplied by each row of x as 16-lane
// integer sums over k (lo: values 0-15, hi: 16-31); the epilogue's float arithmetic is, term by term
// and in the same order, the one the SIMD kernels are tested against.
template <LinFormat F>
void gemm_portable(const QMat& w, int rb0, int rb1, const ActQ& a, int t0, int nt, float* c, int ldc) {
  constexpr LinLayout L = kLinLayout[int(F)];
  constexpr bool kq = L.sb_blocks > 1;
  const int nb = a.k / 32;
  for (int t = 0; t < nt; ++t) std::fill(c + size_t(t) * ldc, c + size_t(t) * ldc + (rb1 - rb0) * 16, 0.0f);
  alignas(64) uint8_t qt[32][16];
  float D[16], Dmin[16], d[16], m[16];
  for (int rb = rb0; rb < rb1; ++rb) {
    for (int sb = 0; sb < w.nsb; ++sb) {
      const uint8_t* base = w.at(rb) + size_t(sb) * kGroupRowblocks * w.sb_bytes;
      for (int r = 0; r < 16; ++r) {
        D[r] = kq ? f16(base + 2 * r) : 0.0f;
        Dmin[r] = lin_has_dmin(F) ? f16(base + 32 + 2 * r) : 0.0f;
      }
      for (int j = 0; j < L.sb_blocks; ++j) {
        const int b = sb * L.sb_blocks + j;
        const uint8_t* bp = base + L.hdr + size_t(j) * L.blk;
        unpack_rowblock<F>(bp, qt);
        if constexpr (lin_one_block(F))
          for (int r = 0; r < 16; ++r) {
            d[r] = f16(bp + lin_d_at(F) + 2 * r);
            m[r] = lin_has_m(F) ? f16(bp + lin_d_at(F) + 32 + 2 * r) : 0.0f;
          }
        for (int t = 0; t < nt; ++t) {
          const size_t row = size_t(t0 + t);
          const int8_t* x = a.q + row * a.k + 32 * b;
          int32_t lo[16] = {}, hi[16] = {};
          for (int i = 0; i < 16; ++i)
            for (int r = 0; r < 16; ++r) lo[r] += int32_t(qt[i][r]) * x[i];
          for (int i = 16; i < 32; ++i)
            for (int r = 0; r < 16; ++r) hi[r] += int32_t(qt[i][r]) * x[i];
          const float dx = a.d[row * nb + b], ds = a.ds[row * nb + b];
          const int32_t s = a.s[row * nb + b];
          float* acc = c + size_t(t) * ldc + (rb - rb0) * 16;
          for (int r = 0; r < 16; ++r) {
            if constexpr (lin_one_block(F)) {  // w = d (q - zero point) (+ m)
              acc[r] += float(lo[r] + hi[r] - lin_zero_point(F) * s) * (d[r] * dx);
              if constexpr (lin_has_m(F)) acc[r] += m[r] * ds;
            } else if constexpr (F == LinFormat::IQ4_XS) {
              acc[r] += float(lo[r] + hi[r] - 128 * s) * (D[r] * float(int8_t(bp[256 + r])) * dx);
            } else if constexpr (F == LinFormat::Q4_K || F == LinFormat::Q5_K) {
              const uint8_t* sc = bp + (F == LinFormat::Q5_K ? 320 : 256);
              acc[r] += float(lo[r] + hi[r]) * (D[r] * float(sc[r]) * dx);
              acc[r] -= Dmin[r] * float(sc[16 + r]) * ds;
            } else if constexpr (F == LinFormat::Q6_K || F == LinFormat::Q3_K) {
              const int8_t* sc = reinterpret_cast<const int8_t*>(bp + (F == LinFormat::Q6_K ? 384 : 192));
              const int32_t* s16 = a.s16 + row * 2 * nb + 2 * b;
              constexpr int off = lin_offset16(F);
              acc[r] += float(lo[r] - off * s16[0]) * (D[r] * float(sc[r]) * dx);
              acc[r] += float(hi[r] - off * s16[1]) * (D[r] * float(sc[16 + r]) * dx);
            } else if constexpr (F == LinFormat::Q2_K) {
              const int32_t* s16 = a.s16 + row * 2 * nb + 2 * b;
              const uint8_t sa = bp[128 + r], sc = bp[144 + r];  // sc | mn << 4
              acc[r] += float(lo[r]) * (D[r] * float(sa & 15) * dx) + float(hi[r]) * (D[r] * float(sc & 15) * dx);
              acc[r] -= Dmin[r] * float(sa >> 4) * (dx * float(s16[0])) + Dmin[r] * float(sc >> 4) * (dx * float(s16[1]));
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
    {nullptr, gemm_portable<LinFormat::Q8_0>, gemm_portable<LinFormat::Q4_0>, gemm_portable<LinFormat::Q4_1>,
     gemm_portable<LinFormat::Q4_K>, gemm_portable<LinFormat::Q5_K>, gemm_portable<LinFormat::Q6_K>, nullptr,
     gemm_portable<LinFormat::IQ4_NL>, gemm_portable<LinFormat::IQ4_XS>, gemm_portable<LinFormat::Q3_K>,
     gemm_portable<LinFormat::Q2_K>, gemm_portable<LinFormat::Q5_0>, gemm_portable<LinFormat::Q5_1>},
    quantize_row_q8,
    store_portable,
    to_bf16_portable,
    gemm_f32_portable,
};

}  // namespace cpx
