// The tile file and instructions of amx_emulation.h: palette 1 (8 tiles of up to 16 rows x 64 bytes),
// one tile file per thread, as each core has its own. Shapes and faults as the SDM's pseudocode and
// exception classes (AMX-E1 .. E4) give them.
#include "amx_emulation.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace cpx {
namespace amx_emu {
namespace {

constexpr int kTiles = 8, kMaxRows = 16, kRowBytes = 64;

struct TileFile {
  bool configured = false;
  uint8_t rows[kTiles] = {};
  uint16_t colsb[kTiles] = {};
  alignas(64) uint8_t t[kTiles][kMaxRows][kRowBytes] = {};
};
thread_local TileFile tf;

[[noreturn]] void fault(const char* insn, const char* why, int a = -1, int b = -1, int c = -1) {
  std::fprintf(stderr,
               "cpp_experts amx_emulated: %s would fault on AMX hardware: %s (operands %d %d %d; the kernel "
               "that issued it has a bug)\n",
               insn, why, a, b, c);
  std::fflush(stderr);
  std::abort();
}

void check_tile(const char* insn, int t) {
  if (!tf.configured) fault(insn, "no tile configuration loaded (LDTILECFG first)", t);
  if (t < 0 || t >= kTiles) fault(insn, "tile number outside tmm0..tmm7", t);
  if (tf.rows[t] == 0) fault(insn, "the tile is not configured (0 rows)", t);
}

// write_row_and_zero / zero_upper_rows: the bytes past colsb and the rows past `rows` read as zero.
void zero_outside(int t) {
  for (int r = 0; r < kMaxRows; ++r) {
    if (r < tf.rows[t])
      std::memset(tf.t[t][r] + tf.colsb[t], 0, size_t(kRowBytes - tf.colsb[t]));
    else
      std::memset(tf.t[t][r], 0, kRowBytes);
  }
}

// The operand shapes of a tile product: C (m x n dwords) += A (m x k dwords) . B (k rows x n dwords).
void check_product(const char* insn, int c, int a, int b) {
  check_tile(insn, c);
  check_tile(insn, a);
  check_tile(insn, b);
  if (c == a || c == b || a == b) fault(insn, "tile operands must be three different tiles", c, a, b);
  if (tf.colsb[c] % 4 || tf.colsb[a] % 4) fault(insn, "colsb of C or A is not a whole number of dwords", c, a, b);
  if (tf.rows[c] != tf.rows[a]) fault(insn, "C and A have different row counts", c, a, b);
  if (tf.colsb[a] / 4 != tf.rows[b]) fault(insn, "A's dwords per row differ from B's rows", c, a, b);
  if (tf.colsb[c] != tf.colsb[b]) fault(insn, "C's and B's bytes per row differ", c, a, b);
}

uint16_t rd16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// bf16 / fp32 with denormals as zero (TDPBF16PS reads and writes with DAZ and FTZ)
float daz_bf16(uint16_t h) {
  if ((h & 0x7f80u) == 0) h &= 0x8000u;
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
float ftz(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
  std::memcpy(&f, &u, 4);
  return f;
}

// C[m][n] = dot(C[m][n], A's dword k of row m, B's dword n of row k) over k, for every m < C's rows and
// n < C's dwords per row (the SDM's loop order); Acc is the dword's type (int32 as uint32: it wraps).
template <typename Acc, typename Dot>
void tile_product(const char* insn, int c, int a, int b, Dot dot) {
  check_product(insn, c, a, b);
  const int kd = tf.colsb[a] / 4, nd = tf.colsb[c] / 4;
  for (int m = 0; m < tf.rows[c]; ++m) {
    Acc acc[16];
    std::memcpy(acc, tf.t[c][m], sizeof(acc));
    for (int k = 0; k < kd; ++k)
      for (int n = 0; n < nd; ++n) acc[n] = dot(acc[n], tf.t[a][m] + 4 * k, tf.t[b][k] + 4 * n);
    std::memcpy(tf.t[c][m], acc, sizeof(acc));
  }
  zero_outside(c);
}

}  // namespace

void loadconfig(const void* cfg) {
  uint8_t b[64];
  std::memcpy(b, cfg, 64);
  if (b[0] == 0) {  // palette 0: the init state
    release();
    return;
  }
  if (b[0] != 1) fault("ldtilecfg", "palette_id is neither 0 nor 1", b[0]);
  for (int i = 2; i < 16; ++i)
    if (b[i]) fault("ldtilecfg", "a reserved byte (2..15) is not zero", i);
  TileFile next;
  for (int t = 0; t < 16; ++t) {
    const uint16_t colsb = rd16(b + 16 + 2 * t);
    const uint8_t rows = b[48 + t];
    if (t >= kTiles) {
      if (colsb || rows) fault("ldtilecfg", "tiles 8..15 must have 0 rows and 0 colsb in palette 1", t);
      continue;
    }
    if (rows > kMaxRows || colsb > kRowBytes) fault("ldtilecfg", "rows > 16 or colsb > 64", t, rows, colsb);
    if ((rows == 0) != (colsb == 0)) fault("ldtilecfg", "rows and colsb must be both zero or both set", t, rows, colsb);
    next.rows[t] = rows;
    next.colsb[t] = colsb;
  }
  next.configured = true;
  tf = next;  // every tile zeroed
}

void release() { tf = TileFile(); }

void zero(int t) {
  check_tile("tilezero", t);
  std::memset(tf.t[t], 0, sizeof(tf.t[t]));
}

void loadd(int t, const void* base, size_t stride) {
  check_tile("tileloadd", t);
  const uint8_t* p = static_cast<const uint8_t*>(base);
  for (int r = 0; r < tf.rows[t]; ++r) std::memcpy(tf.t[t][r], p + size_t(r) * stride, tf.colsb[t]);
  zero_outside(t);
}

void stored(int t, void* base, size_t stride) {
  check_tile("tilestored", t);
  uint8_t* p = static_cast<uint8_t*>(base);
  for (int r = 0; r < tf.rows[t]; ++r) std::memcpy(p + size_t(r) * stride, tf.t[t][r], tf.colsb[t]);
}

void dpbsud(int c, int a, int b) {
  tile_product<uint32_t>("tdpbsud", c, a, b, [](uint32_t acc, const uint8_t* x, const uint8_t* w) {
    int32_t dot = 0;  // four products of at most 128 x 255 in magnitude: no overflow here
    for (int i = 0; i < 4; ++i) dot += int32_t(int8_t(x[i])) * int32_t(w[i]);
    return acc + uint32_t(dot);  // the int32 accumulator wraps, as the hardware's does
  });
}

void dpbf16ps(int c, int a, int b) {
  tile_product<float>("tdpbf16ps", c, a, b, [](float acc, const uint8_t* x, const uint8_t* w) {
    for (int i = 0; i < 2; ++i)  // each bf16 product is exact in fp32: one rounding per add
      acc = ftz(ftz(acc) + daz_bf16(rd16(x + 2 * i)) * daz_bf16(rd16(w + 2 * i)));
    return acc;
  });
}

}  // namespace amx_emu
}  // namespace cpx
