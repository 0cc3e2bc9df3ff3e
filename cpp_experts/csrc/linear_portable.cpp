// Portable QuantLinear kernels: plain C++ over the packed layouts (quant_linear.h). They serve x86 CPUs
// without AVX2 and every CPU that is not x86 (aarch64: cpu.h's CPX_X86), and are what the AVX2 and
// AVX-512 kernels are tested against. Written for the compiler to vectorise (SSE2 on the x86-64
// baseline, NEON on aarch64): on the 2-core Zen 5 VM, SmolLM2 Q4_1 decode on them went from 0.022 to
// 0.096 of the AVX-512 kernels' speed (a block unpacked per row with run-time format tests before).
// On aarch64 with the dot-product instructions (Armv8.2+: Graviton 2+, Ampere Altra, Apple M1+) the
// int8 formats take kLinNeonDot instead: the same loop and epilogue, the sums over k by SDOT.
#include <algorithm>
#include <cstring>

#include "quant_linear.h"

#if defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace cpx {
namespace {

float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// Byte c of row r's 4-byte word at p (the packed layouts hold, per 64-byte line, a word per row): a
// shift of 16 contiguous words, where bp[r * 4 + c] would be a stride-4 byte gather.
inline uint32_t row_byte(const uint8_t* p, int r, int c) {
  uint32_t u;
  std::memcpy(&u, p + 4 * r, 4);
  return (u >> (8 * c)) & 0xffu;
}

// Value 16h + 4g + c (Q8_0: 4g + c, h = 0) of a row of a packed block: the one decoder of the packed
// layouts' nibbles and bit planes that unpack_block and both kernels below use, the format known at
// compile time; byte(o) is the row's byte c of the 64-byte line at offset o.
template <LinFormat F, class Byte>
inline uint32_t quant_value(Byte byte, int g, int h) {
  if constexpr (F == LinFormat::Q8_0) {
    return byte(g * 64);
  } else {
    uint32_t e;
    if constexpr (lin_two_bit(F)) {
      e = (byte(64 * (g / 2)) >> (4 * (g % 2) + 2 * h)) & 3;
      if constexpr (F == LinFormat::Q3_K) e |= ((byte(128) >> (2 * g + h)) & 1) << 2;
    } else {
      e = h ? byte(g * 64) >> 4 : byte(g * 64) & 15;
    }
    if constexpr (lin_fifth_bit(F)) e |= ((byte(256) >> (2 * g + h)) & 1) << 4;
    if constexpr (F == LinFormat::Q6_K) e |= ((byte(256 + 64 * (g / 2)) >> (4 * (g % 2) + 2 * h)) & 3) << 4;
    if constexpr (lin_iq4(F)) e = kIq4Unsigned[e];
    return e;
  }
}

// Row r's 32 unsigned quant values of the packed block at bp (iq4: the levels + 128).
template <LinFormat F>
void unpack_row(const uint8_t* bp, int r, uint8_t* q) {
  for (int g = 0; g < (F == LinFormat::Q8_0 ? 8 : 4); ++g)
    for (int c = 0; c < 4; ++c)
      for (int h = 0; h < (F == LinFormat::Q8_0 ? 1 : 2); ++h)
        q[16 * h + 4 * g + c] = uint8_t(quant_value<F>([&](int o) { return uint32_t(bp[o + 4 * r + c]); }, g, h));
}

}  // namespace

void unpack_block(LinFormat f, const uint8_t* bp, int r, uint8_t* q) {
  using F = LinFormat;
  switch (f) {
    case F::Q8_0: return unpack_row<F::Q8_0>(bp, r, q);
    case F::Q4_0: return unpack_row<F::Q4_0>(bp, r, q);
    case F::Q4_1: return unpack_row<F::Q4_1>(bp, r, q);
    case F::Q4_K: return unpack_row<F::Q4_K>(bp, r, q);
    case F::Q5_K: return unpack_row<F::Q5_K>(bp, r, q);
    case F::Q6_K: return unpack_row<F::Q6_K>(bp, r, q);
    case F::IQ4_NL: return unpack_row<F::IQ4_NL>(bp, r, q);
    case F::IQ4_XS: return unpack_row<F::IQ4_XS>(bp, r, q);
    case F::Q3_K: return unpack_row<F::Q3_K>(bp, r, q);
    case F::Q2_K: return unpack_row<F::Q2_K>(bp, r, q);
    case F::Q5_0: return unpack_row<F::Q5_0>(bp, r, q);
    case F::Q5_1: return unpack_row<F::Q5_1>(bp, r, q);
    case F::BF16:
    case F::F32: break;  // not block formats: dequant_row reads them directly
  }
}

namespace {

// A block's 32 quant values for all 16 rows of a rowblock, k-major (qt[k][row]), in loops over the
// rows that a compiler vectorises (each row's byte read from its 4-byte word).
template <LinFormat F>
inline void unpack_rowblock(const uint8_t* bp, uint8_t (*qt)[16]) {
  for (int g = 0; g < (F == LinFormat::Q8_0 ? 8 : 4); ++g)
    for (int c = 0; c < 4; ++c)
      for (int h = 0; h < (F == LinFormat::Q8_0 ? 1 : 2); ++h)
        for (int r = 0; r < 16; ++r)
          qt[16 * h + 4 * g + c][r] =
              uint8_t(quant_value<F>([&](int o) { return row_byte(bp + o, r, c); }, g, h));
}

// Row r's share of block b for row `row` of x, from its integer sums over the block's values 0-15 (lo)
// and 16-31 (hi): the float arithmetic the SIMD kernels are tested against, term by term and in the
// same order. D, Dmin: the superblock's scales (K-quants); d, m: the block's (one-block formats).
template <LinFormat F>
inline void block_epilogue(const int32_t* lo, const int32_t* hi, const uint8_t* bp, const float* D, const float* Dmin,
                           const float* d, const float* m, const ActQ& a, size_t row, int b, float* acc) {
  const int nb = a.k / 32;
  const float dx = a.d[row * nb + b], ds = a.ds[row * nb + b];
  const int32_t s = a.s[row * nb + b];
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

// The loop over a task's rowblocks, superblocks and blocks that both int8 kernels below share: each
// block is unpacked once for the rowblock's 16 rows (`Unpacked::load`), then `Unpacked::sums` gives its
// lo / hi integer sums against each row of x, and block_epilogue scales them into c.
template <LinFormat F, class Unpacked>
inline void gemm_blocks(const QMat& w, int rb0, int rb1, const ActQ& a, int t0, int nt, float* c, int ldc) {
  constexpr LinLayout L = kLinLayout[int(F)];
  constexpr bool kq = L.sb_blocks > 1;
  for (int t = 0; t < nt; ++t) std::fill(c + size_t(t) * ldc, c + size_t(t) * ldc + (rb1 - rb0) * 16, 0.0f);
  Unpacked u;
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
        u.load(bp);
        if constexpr (lin_one_block(F))
          for (int r = 0; r < 16; ++r) {
            d[r] = f16(bp + lin_d_at(F) + 2 * r);
            m[r] = lin_has_m(F) ? f16(bp + lin_d_at(F) + 32 + 2 * r) : 0.0f;
          }
        for (int t = 0; t < nt; ++t) {
          const size_t row = size_t(t0 + t);
          int32_t lo[16], hi[16];
          u.sums(a, row, b, lo, hi);
          block_epilogue<F>(lo, hi, bp, D, Dmin, d, m, a, row, b, c + size_t(t) * ldc + (rb - rb0) * 16);
        }
      }
    }
  }
}

// Portable: the block k-major (qt[k][row]), summed over k in 16-lane integer loops.
template <LinFormat F>
struct PortableBlock {
  alignas(64) uint8_t qt[32][16];
  void load(const uint8_t* bp) { unpack_rowblock<F>(bp, qt); }
  void sums(const ActQ& a, size_t row, int b, int32_t* lo, int32_t* hi) const {
    const int8_t* x = a.q + row * a.k + 32 * b;
    for (int r = 0; r < 16; ++r) lo[r] = hi[r] = 0;
    for (int i = 0; i < 16; ++i)
      for (int r = 0; r < 16; ++r) lo[r] += int32_t(qt[i][r]) * x[i];
    for (int i = 16; i < 32; ++i)
      for (int r = 0; r < 16; ++r) hi[r] += int32_t(qt[i][r]) * x[i];
  }
};

// The table's gemm of format F whose sums over k are Block<F>'s (PortableBlock, aarch64's DotBlock).
template <LinFormat F, template <LinFormat> class Block>
void gemm_int8(const QMat& w, int rb0, int rb1, const ActQ& a, int t0, int nt, float* c, int ldc) {
  gemm_blocks<F, Block<F>>(w, rb0, rb1, a, t0, nt, c, ldc);
}

#if defined(__aarch64__)
// SDOT (Armv8.2 dot product, HWCAP_ASIMDDP): each int32 lane of acc += the four products of its 4 signed
// bytes of a and b. Inline assembly, so that the code around it needs no target attribute (vdotq_s32
// would, and would then not inline into it); binutils 2.40 takes it after `.arch armv8.2-a+dotprod`
// (a superset of what the compiler emits for the rest of the file), not after `.arch_extension`.
inline int32x4_t sdot(int32x4_t acc, int8x16_t a, int8x16_t b) {
  __asm__(".arch armv8.2-a+dotprod\n\tsdot %0.4s, %1.16b, %2.16b" : "+w"(acc) : "w"(a), "w"(b));
  return acc;
}

// Formats whose values reach 255 (Q8_0's and IQ4's, + 128) are held as value - 128 in SDOT's signed
// bytes; a row's lo sum then gets 128 * (the block's sum of x) added back, exactly, so lo + hi are the
// portable sums (these formats' epilogues read lo + hi only).
template <LinFormat F>
constexpr bool kMinus128 = F == LinFormat::Q8_0 || lin_iq4(F);

// NEON dot products: the block in the packed layout's own order, eight 64-byte lines (line s: values
// 4s..4s+3 of the 16 rows, a 4-byte word per row, as the VNNI kernels read them), each line four SDOTs
// against x's four values.
template <LinFormat F>
struct DotBlock {
  alignas(16) int8_t u[8][64];
  void load(const uint8_t* bp) {
    for (int s = 0; s < 8; ++s)
      for (int j = 0; j < 64; ++j) {
        const int g = F == LinFormat::Q8_0 ? s : s % 4, h = F == LinFormat::Q8_0 ? 0 : s / 4;
        const uint32_t e = quant_value<F>([&](int o) { return uint32_t(bp[o + j]); }, g, h);
        u[s][j] = int8_t(kMinus128<F> ? int(e) - 128 : int(e));
      }
  }
  void sums(const ActQ& a, size_t row, int b, int32_t* lo, int32_t* hi) const {
    const int8_t* x = a.q + row * a.k + 32 * b;
    int32x4_t acc[2][4];
    for (int v = 0; v < 4; ++v) acc[0][v] = acc[1][v] = vdupq_n_s32(0);
    for (int s = 0; s < 8; ++s) {
      int32_t x4;
      std::memcpy(&x4, x + 4 * s, 4);
      const int8x16_t xv = vreinterpretq_s8_s32(vdupq_n_s32(x4));
      for (int v = 0; v < 4; ++v) acc[s / 4][v] = sdot(acc[s / 4][v], vld1q_s8(u[s] + 16 * v), xv);
    }
    for (int v = 0; v < 4; ++v) {
      vst1q_s32(lo + 4 * v, acc[0][v]);
      vst1q_s32(hi + 4 * v, acc[1][v]);
    }
    if constexpr (kMinus128<F>) {
      const int32_t back = 128 * a.s[row * (a.k / 32) + b];
      for (int r = 0; r < 16; ++r) lo[r] += back;
    }
  }
};
#endif  // __aarch64__

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

// A kernel table of the int8 gemms of Block (bf16 weights have the MoE's bf16 kernels; f32 its own gemm).
template <template <LinFormat> class Block>
constexpr LinKernels int8_kernels(const char* name) {
  using F = LinFormat;
  return {name,
          {nullptr, gemm_int8<F::Q8_0, Block>, gemm_int8<F::Q4_0, Block>, gemm_int8<F::Q4_1, Block>,
           gemm_int8<F::Q4_K, Block>, gemm_int8<F::Q5_K, Block>, gemm_int8<F::Q6_K, Block>, nullptr,
           gemm_int8<F::IQ4_NL, Block>, gemm_int8<F::IQ4_XS, Block>, gemm_int8<F::Q3_K, Block>,
           gemm_int8<F::Q2_K, Block>, gemm_int8<F::Q5_0, Block>, gemm_int8<F::Q5_1, Block>},
          quantize_row_q8,
          store_portable,
          to_bf16_portable,
          gemm_f32_portable};
}

}  // namespace

const LinKernels kLinPortable = int8_kernels<PortableBlock>("portable");
#if defined(__aarch64__)
const LinKernels kLinNeonDot = int8_kernels<DotBlock>("neon_dotprod");
#endif

}  // namespace cpx
