// AMX int8 QuantLinear kernels (Sapphire Rapids and newer), for tasks with kAmxInt8MinRows or more
// rows of x; called only where cpu.cpp found AMX-INT8 and the OS granted tile data.
//
// Per 32-value block one TDPBSUD (signed int8 activations x unsigned weight bytes) gives the 16 x 16
// int32 dot products of up to 16 rows of x with one rowblock, which are stored and scaled into fp32
// accumulators exactly as the VNNI kernel's sums are (linear_simd.h). The packed "4 values x 16
// rows" groups are B-tile rows: q8_0's load as they are, the 4-bit formats are unpacked to bytes
// first; q6_k's two 16-value halves (own scales) are two products of K = 16. A K = 32 product and the
// per-block scaling of its 256 results, not the multiplies, bound the speed: on a 2-core Sapphire
// Rapids slice about 1.25x the VNNI kernel from 16 rows of x (and no gain at 8, hence kAmxInt8MinRows).
#include "cpu.h"  // CPX_X86
#if CPX_X86  // an x86 path: elsewhere this file compiles to nothing
#include <algorithm>

#include "linear_simd.h"

#ifdef CPX_AMX_EMULATED  // linear_amx_emulated.cpp: the tile instructions modelled in software
#include "amx_emulation.h"
#define CPX_AMX CPX_VNNI
#define CPX_AMX_INT8_TABLE kLinAmxEmulatedGemm
#else
#define CPX_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define CPX_AMX_INT8_TABLE kLinAmxGemm
#endif

namespace cpx {
namespace {

using namespace lin;

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tmm0..3: C (m rows of x x 16 output rows, int32), two per block (q6_k's halves) and two blocks in
// flight; tmm4, tmm5: A (m rows x 32 / halves bytes of x); tmm6, tmm7: B (8 / halves rows of 64 bytes:
// 4 values x 16 output rows).
CPX_AMX void configure(int m, int halves) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int i = 0; i < 4; ++i) {
    cfg.rows[i] = uint8_t(m);
    cfg.colsb[i] = 64;
  }
  for (int i = 4; i < 6; ++i) {
    cfg.rows[i] = uint8_t(m);
    cfg.colsb[i] = uint16_t(32 / halves);
    cfg.rows[i + 2] = uint8_t(8 / halves);
    cfg.colsb[i + 2] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Block b's products into C tiles C0 (and C1: a lin_split16 format's second half); retire() stores them. GCC's tile
// intrinsics paste their tile numbers into the instruction text, so these take literal numbers.
#define CPX_TILE_ISSUE(C0, C1)                  \
  do {                                          \
    _tile_zero(C0);                             \
    _tile_loadd(4, ap, lda);                    \
    _tile_loadd(6, bsrc, 64);                   \
    _tile_dpbsud(C0, 4, 6);                     \
    if constexpr (Split) {                      \
      _tile_zero(C1);                           \
      _tile_loadd(5, ap + 16, lda);             \
      _tile_loadd(7, bsrc + 256, 64);           \
      _tile_dpbsud(C1, 5, 7);                   \
    }                                           \
  } while (0)
#define CPX_TILE_RETIRE(C0, C1)                            \
  do {                                                     \
    _tile_stored(C0, cbuf[0], 64);                         \
    if constexpr (Split) _tile_stored(C1, cbuf[1], 64);    \
  } while (0)
template <bool Split>
CPX_AMX inline void issue(int buf, const int8_t* ap, int lda, const uint8_t* bsrc) {
  if (buf)
    CPX_TILE_ISSUE(2, 3);
  else
    CPX_TILE_ISSUE(0, 1);
}
template <bool Split>
CPX_AMX inline void retire(int buf, int32_t (*cbuf)[256]) {
  if (buf)
    CPX_TILE_RETIRE(2, 3);
  else
    CPX_TILE_RETIRE(0, 1);
}

// 4-bit formats: block wb unpacked to the bytes of B rows 0..7 (elements 0..15 in rows 0..3).
template <LinFormat F>
CPX_AMX inline void unpack_block(const uint8_t* wb, uint8_t* out) {
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {
    __m512i lo, hi;
    unpack_group<F>(wb, g, lo, hi);
    _mm512_store_si512(out + 64 * g, lo);
    _mm512_store_si512(out + 256 + 64 * g, hi);
  }
}

// c[i * ldc + j] = sum_k W[16 rb + j][k] * A[t0 + i][k] for i < m (<= 16), j < 16. Software-pipelined
// by one block: block b's tile products run while block b - 1's are scaled into the accumulators,
// and block b + 1 is unpacked (so neither the tile store nor the B-tile load waits on its producer).
template <LinFormat F>
CPX_AMX void rowblock(const QMat& w, int rb, const ActQ& a, int t0, int m, float* c, int ldc) {
  constexpr LinLayout L = kLinLayout[int(F)];
  constexpr bool kQ8 = F == LinFormat::Q8_0, kSplit = lin_split16(F), kK = L.sb_blocks > 1;
  alignas(64) uint8_t bbuf[2][512];
  alignas(64) int32_t cbuf[2][2][256];
  const size_t sbs = w.sb_bytes;
  const uint8_t* w0 = w.at(rb);
  const int nb = a.k / 32;
  // block b's packed bytes, and its superblock's header
  const auto header = [&](int b) { return w0 + size_t(b / L.sb_blocks) * kGroupRowblocks * sbs; };
  const auto block = [&](int b) { return header(b) + L.hdr + size_t(b % L.sb_blocks) * L.blk; };
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  if constexpr (!kQ8) unpack_block<F>(block(0), bbuf[0]);
  for (int b = 0; b <= nb; ++b) {
    const int cur = b & 1;
    if (b < nb) {
      const int8_t* ap = a.q + size_t(t0) * a.k + 32 * b;
      const uint8_t* bsrc = kQ8 ? block(b) : bbuf[cur];
      issue<kSplit>(cur, ap, a.k, bsrc);
    }
    if (b == 0) {
      if constexpr (!kQ8) unpack_block<F>(block(1 % nb), bbuf[1]);
      continue;
    }
    const int p = b - 1;  // the block to retire
    retire<kSplit>(cur ^ 1, cbuf[cur ^ 1]);
    if constexpr (!kQ8)
      if (b + 1 < nb) unpack_block<F>(block(b + 1), bbuf[cur ^ 1]);
    const uint8_t* hp = header(p);
    const Scales sc = block_scales<F>(block(p), kK ? f16x16(hp) : _mm512_setzero_ps(),
                                      kK && has_min(F) ? f16x16(hp + 32) : _mm512_setzero_ps());
    const int32_t(*cb)[256] = cbuf[cur ^ 1];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      if (i >= m) break;
      const size_t row = size_t(t0 + i);
      __m512i s = _mm512_load_si512(cb[0] + 16 * i), s2 = _mm512_setzero_si512();
      if constexpr (kSplit) {
        const int32_t* s16 = a.s16 + row * 2 * nb + 2 * p;
        s = _mm512_add_epi32(s, _mm512_set1_epi32(-lin_offset16(F) * s16[0]));
        s2 = _mm512_add_epi32(_mm512_load_si512(cb[1] + 16 * i), _mm512_set1_epi32(-lin_offset16(F) * s16[1]));
      } else if constexpr (lin_zero_point(F) != 0) {
        s = _mm512_add_epi32(s, _mm512_set1_epi32(-lin_zero_point(F) * a.s[row * nb + p]));
      }
      acc[i] = accumulate<F>(acc[i], s, s2, sc, a.d[row * nb + p], a.ds[row * nb + p],
                             kSplit ? a.s16 + row * 2 * nb + 2 * p : nullptr);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    if (i >= m) break;
    _mm512_storeu_ps(c + size_t(i) * ldc, acc[i]);
  }
}

template <LinFormat F>
CPX_AMX void gemm_amx(const QMat& w, int rb0, int rb1, const ActQ& a, int t0, int nt, float* c, int ldc) {
  int configured = -1;
  for (int t = 0; t < nt; t += 16) {
    const int m = std::min(16, nt - t);
    if (m < kAmxInt8MinRows) {  // a short tail: the VNNI kernel is faster there
      kLinAvx512.gemm[int(F)](w, rb0, rb1, a, t0 + t, m, c + size_t(t) * ldc, ldc);
      continue;
    }
    if (m != configured) {
      configure(m, lin_split16(F) ? 2 : 1);
      configured = m;
    }
    for (int rb = rb0; rb < rb1; ++rb) rowblock<F>(w, rb, a, t0 + t, m, c + size_t(t) * ldc + (rb - rb0) * 16, ldc);
  }
  if (configured >= 0) _tile_release();
}

}  // namespace

const LinGemm CPX_AMX_INT8_TABLE[kLinFormats] = {
    nullptr,                   gemm_amx<LinFormat::Q8_0>,   gemm_amx<LinFormat::Q4_0>,
    gemm_amx<LinFormat::Q4_1>, gemm_amx<LinFormat::Q4_K>,   gemm_amx<LinFormat::Q5_K>,
    gemm_amx<LinFormat::Q6_K>, nullptr,                     gemm_amx<LinFormat::IQ4_NL>,
    gemm_amx<LinFormat::IQ4_XS>, gemm_amx<LinFormat::Q3_K>, gemm_amx<LinFormat::Q2_K>,
    gemm_amx<LinFormat::Q5_0>, gemm_amx<LinFormat::Q5_1>};

}  // namespace cpx

#endif  // CPX_X86
