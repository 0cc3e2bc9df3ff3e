// QuantLinear: a dense layer y = x W^T (+ b) whose weights stay in their GGUF block format.
//
// Why: at decode (a few rows of x) a linear layer is bound by reading W once, and a GGUF block
// format holds 0.33 (Q2_K) .. 1.06 (Q8_0) bytes per weight against bf16's 2. The blocks are repacked
// once at load so that one pass over memory streams 64 output rows' blocks sequentially and the dot
// products run on vpdpbusd (unsigned weight bytes x signed int8 activations) without shuffles.
// Activations are quantised per 32 values as Q8_0 (common.h's quantize_row_q8; fp32 scale d, int32
// sum of q), and every block's int32 dot product is scaled by d_w * d_x into fp32, as ggml does.
//
// Packed layout of the quantised formats. Output rows come in rowblocks of 16 (one zmm of fp32
// results) and rowblocks in groups of 4 (rows padded to 64 with zeros). K is cut into superblocks
// (one 32-value block for Q8_0/Q4_0/Q4_1, eight for the 256-value K-quants):
//     data = [group][superblock][rowblock in group][sb_bytes]
// so a tile of up to 4 rowblocks reads one contiguous run per superblock. One rowblock's superblock
// is a header (K-quants only: fp16 d[16] for the 16 rows, then fp16 dmin[16] for Q4_K/Q5_K), then
// per 32-value block the quant bytes in 64-byte groups of "4 values x 16 rows" (a vpdpbusd operand):
//   q8_0   8 groups; byte (g, r, c) = q[4g + c] + 128 of row r (unsigned; the -128 goes into the
//          activation-sum term);
//   4-bit  4 groups (q4_0, q4_1, q4_k, q5_k, q6_k); byte (g, r, c) has element 4g + c of row r in
//          its low nibble and element 16 + 4g + c in its high nibble: GGUF's own order for q4_0 and
//          q4_1, the K-quants reordered to it;
//   q5_k, q5_0, q5_1  then 64 bytes: bit 2g + h of byte (r, c) = bit 4 of element 16h + 4g + c;
//   q6_k   then 2 x 64 bytes: in part p, bits 4(g % 2) + 2h .. +1 of byte (r, c) = bits 4..5 of
//          element 16h + 4g + c, for the groups g = 2p, 2p + 1;
//   iq4_nl, iq4_xs: the nibbles are indices into the 16 int8 levels kIq4Levels (the kernels look
//          them up as level + 128, unsigned, with a zero point of 128 as q8_0);
// except q3_k and q2_k, whose values are 2 bits (q2_k) or 2 bits + 1 (q3_k), held as planes:
//   q2_k, q3_k  2 x 64 bytes: in part p, bits 4(g % 2) + 2h .. +1 of byte (r, c) = bits 0..1 of
//          element 16h + 4g + c, for the groups g = 2p, 2p + 1 (q6_k's high-bit layout);
//   q3_k   then 64 bytes: bit 2g + h of byte (r, c) = bit 2 of element 16h + 4g + c (q5_k's layout);
// then the block's scales, one per row:
//   q8_0, q4_0: fp16 d[16]                  w = d q (q8_0),  w = d (q - 8) (q4_0)
//   q4_1:       fp16 d[16], fp16 m[16]      w = d q + m
//   q5_0:       fp16 d[16]                  w = d (q - 16)
//   q5_1:       fp16 d[16], fp16 m[16]      w = d q + m
//   q4_k, q5_k: uint8 sc[16], uint8 mn[16]  w = (d sc) q - (dmin mn)        (6-bit sc and mn)
//   q6_k:       int8 sc[16] for elements 0..15, int8 sc[16] for 16..31;  w = (d sc) (q - 32)
//   iq4_nl:     fp16 d[16]                  w = d level
//   iq4_xs:     int8 sc[16] (6-bit scale - 32)  w = (d sc) level
//   q3_k:       int8 sc[16] for elements 0..15, int8 sc[16] for 16..31;  w = (d sc) (q - 4), q = low 2
//               bits + 4 x the high bit (GGUF stores the high bit inverted: q - 4 is its value)
//   q2_k:       uint8 (sc | mn << 4)[16] for elements 0..15, [16] for 16..31;  w = (d sc) q - (dmin mn)
// Bytes per weight are GGUF's (q4_k, q5_k, iq4_xs: +1.5-2%, their 6-bit scales stored as bytes;
// q3_k +4%). The same
// groups are AMX int8 B-tile rows (linear_amx.cpp); on AVX2 (linear_avx2.cpp) a group is two ymm
// operands of vpmaddubsw (rows 0..7, rows 8..15). bf16 weights use the MoE operator's bf16 layout
// and gemm kernels (common.h).
//
// f32 weights (for exact fp32 models) are packed [N/16][K][16] fp32: one 64-byte line holds one k of
// a rowblock's 16 rows (two ymm of fp32, FMA'd against x[k] broadcast), and every rowblock is one
// contiguous run of K lines, read front to back. Activations stay fp32 (bf16 x widened), so the
// product is the fp32 matmul up to summation order.
#pragma once
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"
#include "pool.h"

namespace cpx {

enum class LinFormat { BF16 = 0, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, F32, IQ4_NL, IQ4_XS, Q3_K, Q2_K, Q5_0, Q5_1 };
constexpr int kLinFormats = 14;
// GGUF-block formats (the packed layout above; the int8 kernels)
constexpr bool lin_quantised(LinFormat f) { return f != LinFormat::BF16 && f != LinFormat::F32; }

// Per format: GGUF block (values, bytes) and the packed layout of one rowblock's superblock.
struct LinLayout {
  const char* name;
  int gguf_values, gguf_bytes;
  int sb_blocks;  // 32-value blocks per superblock
  int hdr;        // header bytes per superblock
  int blk;        // bytes per 32-value block (quants + scales)
};
constexpr LinLayout kLinLayout[kLinFormats] = {
    {"bf16", 1, 2, 0, 0, 0},         {"q8_0", 32, 34, 1, 0, 544},    {"q4_0", 32, 18, 1, 0, 288},
    {"q4_1", 32, 20, 1, 0, 320},     {"q4_k", 256, 144, 8, 64, 288}, {"q5_k", 256, 176, 8, 64, 352},
    {"q6_k", 256, 210, 8, 32, 416},  {"f32", 1, 4, 0, 0, 0},         {"iq4_nl", 32, 18, 1, 0, 288},
    {"iq4_xs", 256, 136, 8, 32, 272}, {"q3_k", 256, 110, 8, 32, 224},  {"q2_k", 256, 84, 8, 64, 160},
    {"q5_0", 32, 22, 1, 0, 352},      {"q5_1", 32, 24, 1, 0, 384},
};
// bytes of one rowblock's superblock in the packed layout (QMat::sb_bytes)
constexpr size_t lin_sb_bytes(LinFormat f) {
  return size_t(kLinLayout[int(f)].hdr) + size_t(kLinLayout[int(f)].sb_blocks) * kLinLayout[int(f)].blk;
}
// a fifth bit per value in a 64-byte plane after the nibbles
constexpr bool lin_fifth_bit(LinFormat f) { return f == LinFormat::Q5_K || f == LinFormat::Q5_0 || f == LinFormat::Q5_1; }
// The one-block formats (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl): a packed block's fp16 d[16] sits after its
// quant bytes, at lin_d_at, and q4_1's / q5_1's m[16] right after it; w = d (q - lin_zero_point) (+ m).
constexpr bool lin_one_block(LinFormat f) { return lin_quantised(f) && kLinLayout[int(f)].sb_blocks == 1; }
constexpr int lin_d_at(LinFormat f) { return f == LinFormat::Q8_0 ? 512 : lin_fifth_bit(f) ? 320 : 256; }
constexpr bool lin_has_m(LinFormat f) { return f == LinFormat::Q4_1 || f == LinFormat::Q5_1; }
// the K-quants whose header holds dmin[16] after d[16] (the others: d[16] only)
constexpr bool lin_has_dmin(LinFormat f) {
  return f == LinFormat::Q4_K || f == LinFormat::Q5_K || f == LinFormat::Q2_K;
}
// scales per 16 values: one int32 sum for elements 0..15 of a block and one for 16..31, and the
// activations' sums per 16 (ActQ::s16) for their zero point (q6_k 32, q3_k 4) or min (q2_k)
constexpr bool lin_split16(LinFormat f) { return f == LinFormat::Q6_K || f == LinFormat::Q3_K || f == LinFormat::Q2_K; }
constexpr int lin_offset16(LinFormat f) { return f == LinFormat::Q6_K ? 32 : f == LinFormat::Q3_K ? 4 : 0; }
// values held as 2-bit planes (+ q3_k's 1-bit plane), not nibbles
constexpr bool lin_two_bit(LinFormat f) { return f == LinFormat::Q3_K || f == LinFormat::Q2_K; }
// IQ4_NL's and IQ4_XS's non-uniform levels (ggml's kvalues_iq4nl)
constexpr int8_t kIq4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr bool lin_iq4(LinFormat f) { return f == LinFormat::IQ4_NL || f == LinFormat::IQ4_XS; }
// The weight's zero point, taken off through the activations' block sums: w = d (q - zero point).
constexpr int lin_zero_point(LinFormat f) {
  return f == LinFormat::Q8_0 || lin_iq4(f) ? 128 : f == LinFormat::Q5_0 ? 16 : f == LinFormat::Q4_0 ? 8 : 0;
}
// the levels + 128, as the kernels read them (unsigned bytes; zero point 128)
alignas(16) constexpr uint8_t kIq4Unsigned[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
static_assert([] {
  for (int i = 0; i < 16; ++i)
    if (kIq4Unsigned[i] != kIq4Levels[i] + 128) return false;
  return true;
}());
constexpr int kGroupRowblocks = 4;  // rowblocks interleaved per superblock

// A packed quantised weight matrix (read-only view), or a strided view of its groups: group i of the
// view is group group_step * i of the matrix from `data` (linear_calls.cpp's decode tasks).
struct QMat {
  LinFormat fmt;
  int nsb;          // superblocks along K
  size_t sb_bytes;  // bytes of one rowblock's superblock
  const uint8_t* data;
  int group_step = 1;
  // bytes from one group of the view to the next
  size_t group_bytes() const { return size_t(group_step) * nsb * kGroupRowblocks * sb_bytes; }
  // rowblock rb's first superblock; its next one is kGroupRowblocks * sb_bytes further
  const uint8_t* at(int rb) const {
    return data + size_t(rb / kGroupRowblocks) * group_bytes() + size_t(rb % kGroupRowblocks) * sb_bytes;
  }
};
// Groups a decode pass (up to kGroupStreamRows rows of x, one pass over the weights) of the AVX2
// kernels reads in lockstep, one read stream each (LinKernels::group_streams).
constexpr int kGroupStreams = 4;
constexpr int kGroupStreamRows = 3;

// Q8_0 activations, `k` values per row: q [M][k], d, s (sum of q), ds = d * s [M][k/32]; s16 (sums
// per 16 values, [M][k/16]) only for the formats whose scales change every 16 values (lin_split16).
struct ActQ {
  const int8_t* q;
  const float* d;
  const int32_t* s;
  const float* ds;
  const int32_t* s16;
  int k;
};

// c[t * ldc + (rb - rb0) * 16 + j] = sum_k W[16 rb + j][k] * A[t0 + t][k], for t < nt, rb0 <= rb < rb1.
using LinGemm = void (*)(const QMat& w, int rb0, int rb1, const ActQ& a, int t0, int nt, float* c, int ldc);
// out[t * ldo + j] = c[t * ldc + j] + bias[j] (bias may be null), j < ncols, t < nt; into fp32, or into
// bf16 rounded to nearest even (as torch rounds).
using StoreRows = void (*)(const float* c, int ldc, int nt, int ncols, const float* bias, void* out, bool bf16,
                           size_t ldo);
using ToBF16 = void (*)(const float* x, uint16_t* y, int n);  // round to nearest even
using QuantRow = void (*)(const float* x, int k, int8_t* q, float* d, int32_t* sum);
// One activation row in the form the int8 kernels read (ActQ): Q8_0 blocks (q, d, s), d * s, and the sums
// per 16 values where s16 is not null (only q6_k reads them: a scalar pass over the row that every
// other format would pay for nothing).
void quantize_act_row(QuantRow quantize, const float* x, int k, int8_t* q, float* d, int32_t* s, float* ds,
                      int32_t* s16);
// f32 weights w [rowblocks][k][16]: c[t * ldc + (rb - rb0) * 16 + j] = sum_i W[16 rb + j][i] * x[t * ldx + i],
// for t < nt, rb0 <= rb < rb1.
using LinGemmF32 = void (*)(const float* w, int k, int rb0, int rb1, const float* x, size_t ldx, int nt, float* c,
                            int ldc);

struct LinKernels {
  const char* name;
  LinGemm gemm[kLinFormats];  // null for bf16 (the MoE bf16 kernels serve it) and f32
  QuantRow quantize;
  StoreRows store;
  ToBF16 to_bf16;
  LinGemmF32 gemm_f32;  // null where the path has none (AVX-512: AVX2 serves f32 there)
  // the gemms read kGroupStreams groups in lockstep at up to kGroupStreamRows rows of x (a strided
  // view's groups are then kGroupStreams long streams: linear_calls.cpp)
  bool group_streams = false;
};
extern const LinKernels kLinPortable;
#if defined(__aarch64__)
extern const LinKernels kLinNeonDot;  // needs CpuInfo::arm_dotprod (linear_portable.cpp)
#endif
// Row r's 32 unsigned quant values of the packed 32-value block at bp (the portable kernels' reader).
void unpack_block(LinFormat f, const uint8_t* bp, int r, uint8_t* q);
extern const LinKernels kLinAvx512;  // needs AVX-512 F/BW/VL/DQ + VNNI
extern const LinKernels kLinAvx2;    // needs CpuInfo::avx2 (AVX2 + FMA + F16C)
// AMX int8 gemms (linear_amx.cpp; needs CpuInfo::amx_int8) for tasks of kAmxInt8MinRows rows of x or
// more (shorter token tiles go to the VNNI kernel): below that, storing and scaling the per-block tile
// results costs more than the VNNI kernel's dot products.
extern const LinGemm kLinAmxGemm[kLinFormats];
// The same kernels over the software tile model of amx_emulation.h (needs AVX-512 VNNI): the kernel path
// "amx_emulated", which tests the AMX kernels' code on CPUs without AMX.
extern const LinGemm kLinAmxEmulatedGemm[kLinFormats];
constexpr int kAmxInt8MinRows = 12;
// q8_0 from 48 rows: its VNNI kernel reads the weight bytes as they are (no unpacking), so the tiles'
// per-block scaling loses to it below three whole tiles. Measured (bench/quant_linear_cpu.py, 16384 x
// 2048, 2 threads, two interleaved pairs): AMX at 0.94-0.95x the VNNI kernel at 16 rows, 0.91-0.93x at
// 24, 0.97-0.98x at 32, 0.94-0.95x at 40, 1.09-1.12x at 48, 1.16-1.18x at 64 (Intel Xeon, 2-core VM);
// 0.97x at 16 rows on the H200 host's Xeon (4 threads). The other formats gain from 16 rows there.
constexpr int amx_int8_min_rows(LinFormat f) { return f == LinFormat::Q8_0 ? 48 : kAmxInt8MinRows; }

struct LinearInput;

class QuantLinear {
 public:
  // `data`: the GGUF tensor's blocks in ggml row order (out_features rows of in_features / block
  // values), or for "bf16" / "f32" out_features x in_features bf16 / fp32 values. `bias`:
  // [out_features] fp32 or null. `kernel`: "", "auto", "amx", "avx512", "avx2", "portable" or
  // "amx_emulated" (the AMX kernels over a software model of the tiles: for tests).
  QuantLinear(const std::string& format, int out_features, int in_features, const uint8_t* data, size_t nbytes,
              const float* bias, const std::string& kernel);
  void bind(std::shared_ptr<Pool> pool);  // after a forward under way, if any
  void unbind();
  // out [m][out_features] = x [m][in_features] W^T + b, x and out both fp32 or both bf16
  void forward(const void* x, bool bf16, int m, void* out);
  std::string kernel() const;
  size_t memory_bytes() const { return w_.n + bias_.n; }
  int threads() const;

  // For callers that schedule several linears themselves (linear_calls.h): shapes, what input form
  // the kernels read, one output tile, and single rows of W decoded to fp32 (embedding lookups).
  int out_features() const { return N_; }
  std::string format() const { return kLinLayout[int(fmt_)].name; }
  int in_features() const { return K_; }
  int rowblocks() const { return nrb_; }
  bool reads_q8() const { return lin_quantised(fmt_); }
  bool reads_bf16() const { return fmt_ == LinFormat::BF16; }
  bool reads_f32() const { return fmt_ == LinFormat::F32; }
  bool reads_s16() const { return lin_split16(fmt_); }  // the activations' sums per 16 values
  const float* bias() const { return has_bias_ ? reinterpret_cast<const float*>(bias_.data()) : nullptr; }
  QuantRow quantizer() const { return lin_->quantize; }
  // c[t * ldc + (rb - rb0) * 16 + j] = row 16 rb + j of W times input row t0 + t, rb0 <= rb < rb1
  void tile(const LinearInput& in, int rb0, int rb1, int t0, int nt, float* c, int ldc) const;
  // Groups (of kGroupRowblocks rowblocks) g0, g0 + step, ..., `count` of them: group i's rows into
  // c[t * ldc + 16 kGroupRowblocks i + j]; the rows of the last group past out_features are zeros.
  // Only where reads_group_streams() and nt <= kGroupStreamRows.
  void tile_groups(const LinearInput& in, int g0, int step, int count, int t0, int nt, float* c, int ldc) const;
  // whether a decode pass should give this operator's tiles as strided groups (tile_groups)
  bool reads_group_streams() const { return lin_quantised(fmt_) && lin_->group_streams; }
  int groups() const { return (nrb_ + kGroupRowblocks - 1) / kGroupRowblocks; }
  void dequant_row(int n, float* out) const;  // row n of W (in_features values)
  void set_bias(const float* bias);           // [out_features] fp32, or null for none

 private:
  struct Scratch {
    Buffer c, row;  // fp32 output tile; one fp32 activation row
  };
  void pack_quant(const uint8_t* src);
  void pack_bf16(const uint16_t* src);
  void pack_f32(const float* src);
  void prepare(const void* x, bool bf16, int m);  // activations in the kernel's format
  int rowblocks_per_task() const;

  LinFormat fmt_;
  int N_, K_, Kp_;  // Kp_: K padded to 32 (bf16 only; the quantised formats need whole blocks)
  int nrb_;         // rowblocks holding real rows (bf16: even, the bf16 kernel takes them in pairs)
  // kernels: lin_ for the quantised gemms, activation quantisation, f32 gemm, stores and bf16
  // rounding of x; bf16k_ for the bf16 gemm
  const LinKernels* lin_;
  const Kernels* bf16k_;
  GemmBF16 amx_bf16_ = nullptr;     // bf16 weights: AMX-BF16 tiles for any number of rows of x (or emulated): the
                                    // tiles round sums unlike AVX-512 BF16's in-order pairs, so one kernel for every
                                    // batch keeps a row's result independent of the rows beside it; at one row both
                                    // read at the memory's pace, from two the tiles are faster (2-core Xeon VM)
  const LinGemm* amxq_ = nullptr;  // quantised weights: AMX-INT8 tiles from kAmxInt8MinRows rows of x (or emulated)
  WeightBuffer w_;
  Buffer bias_;
  QMat qm_{};
  Mat bm_{};
  bool has_bias_ = false;
  mutable std::mutex m_;  // one forward at a time per operator (they share the scratch)
  std::shared_ptr<Pool> pool_;
  std::vector<Scratch> scratch_;
  Buffer act_q_, act_d_, act_s_, act_ds_, act_s16_, act_b_, act_f_;  // act_f_: bf16 x widened (f32)
};

}  // namespace cpx
