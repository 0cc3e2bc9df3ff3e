// AMX bf16 tiles (Sapphire Rapids and newer), used for experts with more than a few tokens. Kept
// small and separate: the packed bf16 layout's 64-byte k-pair lines of 16 rows are exactly the
// VNNI-format B tile, so B tiles load straight from the weights; A tiles are 16 activation rows.
// Only called after cpu.cpp found AMX and the kernel granted the tile-data permission.
#include "cpu.h"  // CPX_X86
#if CPX_X86  // an x86 path: elsewhere this file compiles to nothing
#include <immintrin.h>

#include "common.h"

#ifdef CPX_AMX_EMULATED  // kernels_amx_emulated.cpp: the tile instructions modelled in software
#include "amx_emulation.h"
#define CPX_AMX __attribute__((target("avx512f")))
#define CPX_AMX_BF16_GEMM amx_emulated_gemm_bf16
#else
#define CPX_AMX __attribute__((target("amx-tile,amx-bf16,avx512f")))
#define CPX_AMX_BF16_GEMM amx_gemm_bf16
#endif

namespace cpx {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tmm0, tmm1: C (m tokens x 16 rows fp32); tmm2: A (m tokens x 32 bf16); tmm3, tmm4: B (16 x 64 B).
CPX_AMX void configure(int m) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int i = 0; i < 3; ++i) {
    cfg.rows[i] = uint8_t(m);
    cfg.colsb[i] = 64;
  }
  for (int i = 3; i < 5; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace

CPX_AMX void CPX_AMX_BF16_GEMM(const Mat& w, int rb0, int nrb, const uint16_t* a, size_t lda, int ntok,
                           float* c, int ldc) {
  const size_t rbs = w.rb_stride();
  int configured = -1;
  for (int t = 0; t < ntok; t += 16) {
    const int m = ntok - t < 16 ? ntok - t : 16;
    if (m != configured) {
      configure(m);
      configured = m;
    }
    const uint16_t* at = a + size_t(t) * lda;
    for (int r = 0; r < nrb; r += 2) {  // nrb is even
      const uint8_t* w0 = w.data + size_t(rb0 + r) * rbs;
      _tile_zero(0);
      _tile_zero(1);
      for (int k0 = 0; k0 < w.k; k0 += 32) {
        _tile_loadd(2, at + k0, lda * 2);
        _tile_loadd(3, w0 + size_t(k0 / 2) * 64, 64);
        _tile_loadd(4, w0 + rbs + size_t(k0 / 2) * 64, 64);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
      }
      float* ct = c + size_t(t) * ldc + r * 16;
      _tile_stored(0, ct, size_t(ldc) * 4);
      _tile_stored(1, ct + 16, size_t(ldc) * 4);
    }
  }
  _tile_release();
}

}  // namespace cpx

#endif  // CPX_X86
