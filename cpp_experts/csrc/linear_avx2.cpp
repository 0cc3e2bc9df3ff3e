// AVX2 QuantLinear kernels (AVX2 + FMA + F16C): the six quantised formats over the packed layout of
// quant_linear.h, the f32 format, Q8_0 activation quantisation and the stores. Compiled with target
// attributes and called only after cpu.cpp found AVX2, FMA, F16C and the OS saving ymm state; they
// serve CPUs without AVX-512 VNNI, and the f32 format everywhere (AVX-512 CPUs run them too).
//
// Int8 dot products without VNNI: vpmaddubsw multiplies unsigned weight bytes by the signed int8
// activations and adds adjacent pairs into int16 lanes, saturating; vpmaddwd against ones adds pairs
// of those into int32. A 64-byte group (4 values x 16 rows) is two ymm operands ("halves": rows 0..7,
// rows 8..15); the group's 4 activation values are broadcast to every 32-bit lane. Every sum is
// exact: activations are within +-127, so a 4-bit weight (0..15) pair is at most 3810 and a block's 8
// vpmaddubsw results add in int16 (30480) before one vpmaddwd; q5_k (0..31) and q6_k (0..63) add 4
// and 2. q8_0's stored bytes q + 128 could saturate (2 x 255 x 127 > 32767), so q8_0 uses the sign
// trick on q = byte ^ 0x80: |q| (at most 128, unsigned) times sign(q) * x, pairs of at most 32512,
// one vpmaddwd each. q6_k puts its two 16-value scales into the vpmaddwd (int16 scale pairs instead
// of ones) and its -32 zero point into one more, leaving one int32 per row and block (< 2^24, so
// exact in fp32). Each block's int32 sums are then scaled into fp32 accumulators as ggml does.
//
// Tiling: a tile is R rowblocks of one group (one contiguous run per superblock) x TT rows of x.
//  M <= 3 (decode, bandwidth bound; one pass over the weights): up to 4 whole groups are read in
//    lockstep, block by block (mk_groups: 4 read streams per thread, which this memory system needs
//    to approach its bandwidth), accumulators in the output tile; a task's partial groups run as
//    tiles (TT = 1: 8 register accumulators). From cache one core runs Q4_1 at ~30 GB/s.
//  TT = 2..4 (M = 2, 3 in one pass over the weights; prefill in tiles of 4 rows, rowblocks outside
//    rows so that a group's weights stay in L1/L2 while every tile of rows passes over them): per
//    block, each rowblock's two halves at once for q8_0 / q4_x (2 x TT sums + 4 unpacked weight
//    registers + the broadcast fill the 16 ymm, and each broadcast serves both halves); q5_k / q6_k
//    one half at a time. Accumulators live in the L1 output tile, loaded and stored once per block
//    and (rowblock, half, row). What bounds it on Zen 3: vpmaddubsw and the vpaddw that accumulates
//    it share pipes, ~1.1 pairs per cycle, so 4-bit formats reach ~21 multiply-adds per cycle
//    (q8_0's sign trick: ~12); the per-block scaling takes about a third of the time. Unrolling the
//    rowblock loop or 8-row tiles overflowed the op cache and ran slower.
// f32: [rowblock][k][16] fp32 lines, FMA'd against x[k] broadcast: R = 4 x TT = 1 (8 chains) and
// R = 2 x TT = 2 stream the weights; above, 1 rowblock x 6 rows of x (12 accumulators: the classic
// 6 x 16 AVX2 sgemm tile), a rowblock's K lines reused from L1/L2 by every tile of rows.
#include "cpu.h"  // CPX_X86
#if CPX_X86  // an x86 path: elsewhere this file compiles to nothing
#include <immintrin.h>

#include <algorithm>

#include "quant_linear.h"

#define CPX_AVX2 __attribute__((target("avx2,fma,f16c")))
// The kernel's pieces: inlined into the tiles always (GCC's heuristics left some out of line, their
// sums passing through the stack: half the speed of an inlined tile).
#define CPX_AVX2_INL __attribute__((target("avx2,fma,f16c"), always_inline)) inline

namespace cpx {
namespace {

// Software prefetch distance along the weights (the scheme of linear_avx512.cpp). On a 2-core Zen 3 VM
// (M = 1, weights from DRAM) 4 and 8 KiB were the best of 1 .. 32 KiB, within the noise of each other;
// without prefetch, or with L2 hints (T1 / T2) further ahead, decode ran ~5-10% slower.
constexpr size_t kPrefetchBytes = 4096;

// How far ahead mk_groups prefetches along a group's run for the one-block formats (q8_0, q4_0, q4_1).
// Shorter than kPrefetchBytes: with 4 streams a thread, 4 KiB ahead measured worse once the decode
// tasks read long strided streams (linear_calls.cpp). On a 2-core Zen 3 VM, SmolLM2 Q4_1 decode at
// 160 tokens, 4 interleaved rounds each: 1 and 2 KiB ~3% more tokens/s than 4 KiB (gate·up's pass
// ~6% shorter, the Q8_0 LM head's ~3%); on its own (M = 1, 16384 x 576 from DRAM, interleaved) q4_1
// went from 0.81 to 0.88 of a streaming read (1 KiB: 0.87; 512 B: 0.81).
constexpr size_t kStreamPrefetchBytes = 2048;

// mk_groups and the tiles (mk) prefetch each rowblock's block this many blocks ahead along that
// rowblock, as each block is reached (mk_groups non-temporally: decode streams; mk to L1 as ordinary
// lines: prefill's later tiles of rows read the group again from L2): the same block
// of the group's next superblock run (9-13 KiB further on). The runs are read block by block across
// their 4 rowblocks, not in address order, so a byte distance shorter than a run lands on lines some
// rowblocks had read already. History, all on 2-core Zen 3 VMs: with four groups a pass (16 streams'
// worth of lines in flight) a run ahead outlived the 32 KiB L1 that a non-temporal prefetch fills on
// AMD, and about kPrefetchBytes ahead (2-4 blocks) took the K-quants from ~0.62 of a streaming read to
// ~0.85 (M = 1, 65536 x 2048 from DRAM; q4_k 24 -> 33 GB/s). Since the K-quants read one group a pass
// (max_streams; two since in the model's decode passes), a run ahead is the better distance: on a starved host (12-20 GB/s reads), against
// ggml's mul_mat in the same process (bench/ggml_peer.py; 10-16 interleaved rounds), from 4 blocks
// ahead to 8 q4_k went from 0.99-1.03x of ggml to 1.14-1.19x (65536 x 2048, three runs) and 1.11x to 1.35x
// (11008 x 4096), iq4_xs 1.01x to 1.15x, q5_k, q2_k and q3_k +5%, and from 2 blocks to 8 q6_k +3.5%
// (129280 x 2048) and +11% (11008 x 4096); 12 and 16 blocks about as 8; at M = 2 q4_k +9%, at M = 3 the
// same. The DeepSeek-V2-Lite-shaped q4_k_m decode (small experts; its LM head Q6_K) did not move: 1.03x
// and 0.96x in two runs of 10-12 pairs. The tiles (M >= 4) had prefetched a whole superblock run of
// their rowblocks at once, a run ahead, at each superblock's start (kPrefetchBytes rounded up to a run);
// spread block by block as above, on the same host, against ggml in one process (16384 x 2048, 6
// interleaved rounds): at M = 4 q4_k 1.35x the speed, q6_k 1.38x, q5_k 1.40x, iq4_xs 1.45x, q3_k
// 1.20x, q2_k 1.17x; at M = 8 q4_k and q6_k 1.19-1.20x; at M = 16 1.08x; at M = 64 within -1%..+6%.
// The one-block formats keep a byte distance in address order (kPrefetchBytes in the tiles,
// kStreamPrefetchBytes in mk_groups): a blocks distance (within 7% of 4 KiB) measured slower for q8_0
// (~-10%), the same for q4_1.
template <LinFormat F>
constexpr int prefetch_blocks() {
  return kLinLayout[int(F)].sb_blocks;
}
// A K-quant block's prefetch: `at` bytes from its unit's superblock start (the rowblock's header in
// superblock sb) lies the block prefetch_blocks() further along the rowblock, `len` bytes of it (with
// its superblock's header if it is a first block).
struct Ahead {
  size_t at;
  int len;
};
template <LinFormat F>
constexpr Ahead block_ahead(int sb, int b, size_t sbs) {
  constexpr LinLayout L = kLinLayout[int(F)];
  const int ahead = b + prefetch_blocks<F>(), pj = ahead % L.sb_blocks;
  return {size_t(ahead / L.sb_blocks - sb) * kGroupRowblocks * sbs + (pj == 0 ? 0 : L.hdr + pj * L.blk),
          L.blk + (pj == 0 ? L.hdr : 0)};
}

// An empty asm that "changes" v: the compiler may not reassociate a sum across it. Without it GCC
// turns a block's chain of int16 / int32 adds into a tree, computes every vpmaddubsw product first and
// spills them to the stack (half the speed at M = 64).
#define CPX_KEEP(v) __asm__("" : "+x"(v))

CPX_AVX2 inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
CPX_AVX2 inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
CPX_AVX2 inline __m256 f16x8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
CPX_AVX2 inline __m256i u8x8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
CPX_AVX2 inline __m256i i8x8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
// Bit `from` of every byte moved to bit `to` by a 16-bit shift; bits that crossed into the other byte
// land outside the caller's mask. Constants once the group loop is unrolled.
CPX_AVX2 inline __m256i move_bits(__m256i v, int from, int to) {
  return from < to ? _mm256_slli_epi16(v, to - from) : _mm256_srli_epi16(v, from - to);
}
// Two int16 in every 32-bit lane: lo's low half, hi's low half (lo, hi: int32 lanes).
CPX_AVX2 inline __m256i pair16(__m256i lo, __m256i hi) {
  return _mm256_blend_epi16(lo, _mm256_slli_epi32(hi, 16), 0xAA);
}

// Per-row fp32 scales of one (rowblock, half) for one block: dw multiplies the int sum (for the
// lin_split16 formats only the superblock d: their scales per 16 values are inside the sum), mw the
// activation sum (q4_1's m; the K-quants' dmin * mn, subtracted; q2_k: dmin * mn of elements 0..15, mw2
// of 16..31, times the activations' sums per 16).
struct Scales {
  __m256 dw, mw, mw2;
};
template <LinFormat F>
CPX_AVX2_INL Scales block_scales(const uint8_t* hdr, const uint8_t* wb, int half) {
  Scales s{_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  if constexpr (lin_one_block(F)) s.dw = f16x8(wb + lin_d_at(F) + 16 * half);
  if constexpr (lin_has_m(F)) s.mw = f16x8(wb + lin_d_at(F) + 32 + 16 * half);
  if constexpr (F == LinFormat::IQ4_XS)
    s.dw = _mm256_mul_ps(f16x8(hdr + 16 * half), _mm256_cvtepi32_ps(i8x8(wb + 256 + 8 * half)));
  if constexpr (F == LinFormat::Q4_K || F == LinFormat::Q5_K) {
    const uint8_t* sc = wb + (F == LinFormat::Q5_K ? 320 : 256) + 8 * half;
    s.dw = _mm256_mul_ps(f16x8(hdr + 16 * half), _mm256_cvtepi32_ps(u8x8(sc)));
    s.mw = _mm256_mul_ps(f16x8(hdr + 32 + 16 * half), _mm256_cvtepi32_ps(u8x8(sc + 16)));
  }
  if constexpr (lin_split16(F)) s.dw = f16x8(hdr + 16 * half);
  if constexpr (F == LinFormat::Q2_K) {
    const __m256 dmin = f16x8(hdr + 32 + 16 * half);
    s.mw = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(u8x8(wb + 128 + 8 * half), 4)));
    s.mw2 = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(u8x8(wb + 144 + 8 * half), 4)));
  }
  return s;
}

// The activation rows of a tile.
template <int TT>
struct Rows {
  const int8_t* q[TT];
  const float *d[TT], *ds[TT];
  const int32_t *s[TT], *s16[TT];
};

// q5_k / q6_k: the 4-bit quants in v widened by their high bits from hb (bits blo / bhi of each byte,
// moved to the place mh masks): the values of v's low nibbles (lo) and of its high nibbles (hi).
CPX_AVX2_INL void with_high_bits(__m256i v, __m256i hb, int blo, int bhi, __m256i mh, __m256i& lo, __m256i& hi) {
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  lo = _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_and_si256(move_bits(hb, blo, 4), mh));
  hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), _mm256_and_si256(move_bits(hb, bhi, 4), mh));
}
// The lin_split16 formats: int16 pairs of each row's scale for elements 0..15 (lo) / 16..31 (hi), rows
// 8 half .. 8 half + 7 (q6_k, q3_k int8; q2_k uint8)
template <LinFormat F>
CPX_AVX2_INL void split_scales(const uint8_t* wb, int half, __m256i& lo, __m256i& hi) {
  constexpr int at = F == LinFormat::Q6_K ? 384 : F == LinFormat::Q3_K ? 192 : 128;
  const uint8_t* p = wb + at + 8 * half;
  const __m256i m4 = _mm256_set1_epi32(15);  // q2_k: the scale is the low nibble (the min the high one)
  const __m256i a = F == LinFormat::Q2_K ? _mm256_and_si256(u8x8(p), m4) : i8x8(p);
  const __m256i c = F == LinFormat::Q2_K ? _mm256_and_si256(u8x8(p + 16), m4) : i8x8(p + 16);
  lo = pair16(a, a);
  hi = pair16(c, c);
}
// Their zero point: s - 2^shift (sc_lo * sum of x 0..15 + sc_hi * sum of x 16..31), s16 the row's two sums
// (q6_k: 32, shift 5; q3_k: 4, shift 2). The sum of 16 activations fits in int16.
CPX_AVX2_INL __m256i minus_offset(__m256i s, __m256i sc_lo, __m256i sc_hi, const int32_t* s16, int shift) {
  const __m256i m = _mm256_slli_epi16(_mm256_blend_epi16(sc_lo, sc_hi, 0xAA), shift);  // (off lo, off hi) pairs
  const uint32_t sp = uint32_t(uint16_t(s16[0])) | uint32_t(uint16_t(s16[1])) << 16;
  return _mm256_sub_epi32(s, _mm256_madd_epi16(m, _mm256_set1_epi32(int32_t(sp))));
}
// q2_k / q3_k: groups 2 gp and 2 gp + 1 of the half at wh from the 2-bit plane (and q3_k's third bits)
template <LinFormat F>
CPX_AVX2_INL void two_bit_groups(const uint8_t* wh, int gp, __m256i* lo, __m256i* hi) {
  const __m256i m3 = _mm256_set1_epi8(0x03), m4 = _mm256_set1_epi8(0x04);
  const __m256i p = load32(wh + 64 * gp);
#pragma GCC unroll 2
  for (int gg = 0; gg < 2; ++gg) {
    lo[gg] = _mm256_and_si256(move_bits(p, 4 * gg, 0), m3);
    hi[gg] = _mm256_and_si256(move_bits(p, 4 * gg + 2, 0), m3);
    if constexpr (F == LinFormat::Q3_K) {
      const __m256i hb = load32(wh + 128);
      const int g = 2 * gp + gg;
      lo[gg] = _mm256_or_si256(lo[gg], _mm256_and_si256(move_bits(hb, 2 * g, 2), m4));
      hi[gg] = _mm256_or_si256(hi[gg], _mm256_and_si256(move_bits(hb, 2 * g + 1, 2), m4));
    }
  }
}

// s[t] = one block's exact int32 dot products of rows 8 half .. 8 half + 7 of the rowblock whose block
// is at wb with activation row t, zero point taken off. One (rowblock, half) at a time: few registers
// (decode, and q5_k / q6_k, whose group pairs hold 4 unpacked weight registers).
template <LinFormat F, int TT>
CPX_AVX2_INL void half_sums(const uint8_t* wb, int half, const Rows<TT>& x, int b, __m256i* s) {
  const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0f);
  const uint8_t* wh = wb + 32 * half;
#pragma GCC unroll 4
  for (int t = 0; t < TT; ++t) s[t] = _mm256_setzero_si256();
  if constexpr (F == LinFormat::Q8_0) {
    const __m256i flip = _mm256_set1_epi8(char(0x80));
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m256i sw = _mm256_xor_si256(load32(wh + 64 * g), flip);  // q, signed
      const __m256i aw = _mm256_abs_epi8(sw);                           // |q| <= 128 as unsigned bytes
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) {
        const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bcast4(x.q[t] + 32 * b + 4 * g), sw));
        s[t] = _mm256_add_epi32(s[t], _mm256_madd_epi16(p, ones));
        CPX_KEEP(s[t]);
      }
    }
  } else if constexpr (lin_fifth_bit(F) || lin_split16(F)) {
    // group pairs: at most 4 (q5_k, q5_0, q5_1) / 2 per chain (the split16 formats) vpmaddubsw results
    // per int16 sum
    constexpr bool kSplit = lin_split16(F);
    __m256i sc_lo = ones, sc_hi = ones;
    if constexpr (kSplit) split_scales<F>(wb, half, sc_lo, sc_hi);
    const __m256i mh = _mm256_set1_epi8(F == LinFormat::Q6_K ? 0x30 : 0x10);
#pragma GCC unroll 2
    for (int gp = 0; gp < 2; ++gp) {
      __m256i lo[2], hi[2];
      if constexpr (lin_two_bit(F)) {
        two_bit_groups<F>(wh, gp, lo, hi);
      } else {
        const __m256i hb = load32(wh + 256 + (kSplit ? 64 * gp : 0));
#pragma GCC unroll 2
        for (int gg = 0; gg < 2; ++gg) {
          const int g = 2 * gp + gg;
          const int blo = kSplit ? 4 * gg : 2 * g, bhi = kSplit ? 4 * gg + 2 : 2 * g + 1;  // the high bits' place
          with_high_bits(load32(wh + 64 * g), hb, blo, bhi, mh, lo[gg], hi[gg]);
        }
      }
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) {
        const int8_t* xp = x.q[t] + 32 * b + 8 * gp;
        const __m256i pl = _mm256_add_epi16(_mm256_maddubs_epi16(lo[0], bcast4(xp)),
                                            _mm256_maddubs_epi16(lo[1], bcast4(xp + 4)));
        const __m256i ph = _mm256_add_epi16(_mm256_maddubs_epi16(hi[0], bcast4(xp + 16)),
                                            _mm256_maddubs_epi16(hi[1], bcast4(xp + 20)));
        if constexpr (kSplit)
          s[t] = _mm256_add_epi32(s[t], _mm256_add_epi32(_mm256_madd_epi16(pl, sc_lo), _mm256_madd_epi16(ph, sc_hi)));
        else
          s[t] = _mm256_add_epi32(s[t], _mm256_madd_epi16(_mm256_add_epi16(pl, ph), ones));
        CPX_KEEP(s[t]);
      }
    }
    if constexpr (F == LinFormat::Q5_0) {
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) s[t] = _mm256_add_epi32(s[t], _mm256_set1_epi32(-lin_zero_point(F) * x.s[t][b]));
    }
    if constexpr (lin_offset16(F) != 0) {
      constexpr int shift = F == LinFormat::Q6_K ? 5 : 2;
      static_assert(lin_offset16(F) == 1 << shift);
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) s[t] = minus_offset(s[t], sc_lo, sc_hi, x.s16[t] + 2 * b, shift);
    }
  } else {  // q4_0, q4_1, q4_k: one int16 sum per block
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      const __m256i v = load32(wh + 64 * g);
      const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) {
        const int8_t* xp = x.q[t] + 32 * b + 4 * g;
        s[t] = _mm256_add_epi16(s[t], _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xp)),
                                                       _mm256_maddubs_epi16(hi, bcast4(xp + 16))));
        CPX_KEEP(s[t]);
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) {
      s[t] = _mm256_madd_epi16(s[t], ones);
      if constexpr (F == LinFormat::Q4_0) s[t] = _mm256_add_epi32(s[t], _mm256_set1_epi32(-8 * x.s[t][b]));
    }
  }
}

// Formats whose rowblock_sums take both halves at once.
constexpr bool both_halves(LinFormat f) { return !lin_fifth_bit(f) && !lin_split16(f); }

// s[0][t] += rows 0..7, s[1][t] += rows 8..15 of one group of signed weights (sw0, sw1: 4 values a row)
// times the 4 activations at x.q[t] + at: vpmaddubsw on |w| with x carrying w's sign (q8_0's sign trick).
template <int TT>
CPX_AVX2_INL void signed_group_sums(__m256i sw0, __m256i sw1, const Rows<TT>& x, int at, __m256i (*s)[TT]) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i aw0 = _mm256_abs_epi8(sw0), aw1 = _mm256_abs_epi8(sw1);
#pragma GCC unroll 4
  for (int t = 0; t < TT; ++t) {
    const __m256i xv = bcast4(x.q[t] + at);
    const __m256i p0 = _mm256_maddubs_epi16(aw0, _mm256_sign_epi8(xv, sw0));
    s[0][t] = _mm256_add_epi32(s[0][t], _mm256_madd_epi16(p0, ones));
    CPX_KEEP(s[0][t]);
    const __m256i p1 = _mm256_maddubs_epi16(aw1, _mm256_sign_epi8(xv, sw1));
    s[1][t] = _mm256_add_epi32(s[1][t], _mm256_madd_epi16(p1, ones));
    CPX_KEEP(s[1][t]);
  }
}

// half_sums for both halves of the rowblock at once (q8_0, q4_0, q4_1, q4_k): every activation
// broadcast feeds two vpmaddubsw (one per half), so a block takes half a load per vpmaddubsw; with 8
// sums, 4 unpacked weight registers and the broadcast the tile fits the 16 ymm at TT <= 4.
template <LinFormat F, int TT>
CPX_AVX2_INL void rowblock_sums(const uint8_t* wb, const Rows<TT>& x, int b, __m256i (*s)[TT]) {
  const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0f);
#pragma GCC unroll 4
  for (int t = 0; t < TT; ++t) s[0][t] = s[1][t] = _mm256_setzero_si256();
  if constexpr (F == LinFormat::Q8_0) {
    const __m256i flip = _mm256_set1_epi8(char(0x80));
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m256i sw0 = _mm256_xor_si256(load32(wb + 64 * g), flip);  // q, signed, rows 0..7
      const __m256i sw1 = _mm256_xor_si256(load32(wb + 64 * g + 32), flip);  // rows 8..15
      signed_group_sums<TT>(sw0, sw1, x, 32 * b + 4 * g, s);
    }
  } else if constexpr (lin_iq4(F)) {
    // the nibbles looked up as the signed levels, then q8_0's sign trick (|level| <= 127: no vpmaddubsw
    // pair saturates), nibble half by nibble half
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Levels)));
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      const __m256i v0 = load32(wb + 64 * g), v1 = load32(wb + 64 * g + 32);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i sw0 = _mm256_shuffle_epi8(table, _mm256_and_si256(h ? _mm256_srli_epi16(v0, 4) : v0, m4));
        const __m256i sw1 = _mm256_shuffle_epi8(table, _mm256_and_si256(h ? _mm256_srli_epi16(v1, 4) : v1, m4));
        signed_group_sums<TT>(sw0, sw1, x, 32 * b + 16 * h + 4 * g, s);
      }
    }
  } else {
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      const __m256i v0 = load32(wb + 64 * g), v1 = load32(wb + 64 * g + 32);
      const __m256i lo0 = _mm256_and_si256(v0, m4), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4);
      const __m256i lo1 = _mm256_and_si256(v1, m4), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) {
        const int8_t* xp = x.q[t] + 32 * b + 4 * g;
        const __m256i xl = bcast4(xp);
        s[0][t] = _mm256_add_epi16(s[0][t], _mm256_maddubs_epi16(lo0, xl));
        CPX_KEEP(s[0][t]);
        s[1][t] = _mm256_add_epi16(s[1][t], _mm256_maddubs_epi16(lo1, xl));
        CPX_KEEP(s[1][t]);
        const __m256i xh = bcast4(xp + 16);
        s[0][t] = _mm256_add_epi16(s[0][t], _mm256_maddubs_epi16(hi0, xh));
        CPX_KEEP(s[0][t]);
        s[1][t] = _mm256_add_epi16(s[1][t], _mm256_maddubs_epi16(hi1, xh));
        CPX_KEEP(s[1][t]);
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        s[h][t] = _mm256_madd_epi16(s[h][t], ones);
        if constexpr (F == LinFormat::Q4_0) s[h][t] = _mm256_add_epi32(s[h][t], _mm256_set1_epi32(-8 * x.s[t][b]));
      }
  }
}

// q6_k's half_sums for both halves of a rowblock at one row of x (decode): each activation broadcast
// feeds both halves, as rowblock_sums does for the other formats.
CPX_AVX2_INL void q6_rowblock_sums(const uint8_t* wb, const Rows<1>& x, int b, __m256i (*s)[1]) {
  const __m256i mh = _mm256_set1_epi8(0x30);
  __m256i sc_lo[2], sc_hi[2];
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    split_scales<LinFormat::Q6_K>(wb, h, sc_lo[h], sc_hi[h]);
    s[h][0] = _mm256_setzero_si256();
  }
#pragma GCC unroll 2
  for (int gp = 0; gp < 2; ++gp) {
    const int8_t* xp = x.q[0] + 32 * b + 8 * gp;
    __m256i pl[2], ph[2];
#pragma GCC unroll 2
    for (int gg = 0; gg < 2; ++gg) {
      const __m256i xl = bcast4(xp + 4 * gg), xh = bcast4(xp + 16 + 4 * gg);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const uint8_t* wh = wb + 32 * h;
        __m256i lo, hi;
        with_high_bits(load32(wh + 64 * (2 * gp + gg)), load32(wh + 256 + 64 * gp), 4 * gg, 4 * gg + 2, mh, lo, hi);
        const __m256i l = _mm256_maddubs_epi16(lo, xl), u = _mm256_maddubs_epi16(hi, xh);
        pl[h] = gg == 0 ? l : _mm256_add_epi16(pl[h], l);
        ph[h] = gg == 0 ? u : _mm256_add_epi16(ph[h], u);
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      s[h][0] = _mm256_add_epi32(s[h][0], _mm256_add_epi32(_mm256_madd_epi16(pl[h], sc_lo[h]),
                                                           _mm256_madd_epi16(ph[h], sc_hi[h])));
      CPX_KEEP(s[h][0]);
    }
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) s[h][0] = minus_offset(s[h][0], sc_lo[h], sc_hi[h], x.s16[0] + 2 * b, 5);
}

// acc + one block's contribution: s its int32 sums, dx the row's block scale, ds = dx * (sum of its q)
// (both broadcast); q2_k: s16 the row's two sums of q per 16 values.
template <LinFormat F>
CPX_AVX2_INL __m256 accumulate(__m256 acc, __m256i s, const Scales& w, __m256 dx, __m256 ds,
                               const int32_t* s16 = nullptr) {
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(w.dw, dx), acc);
  if constexpr (lin_has_m(F)) acc = _mm256_fmadd_ps(w.mw, ds, acc);
  if constexpr (F == LinFormat::Q4_K || F == LinFormat::Q5_K) acc = _mm256_fnmadd_ps(w.mw, ds, acc);
  if constexpr (F == LinFormat::Q2_K) {
    acc = _mm256_fnmadd_ps(w.mw, _mm256_mul_ps(dx, _mm256_set1_ps(float(s16[0]))), acc);
    acc = _mm256_fnmadd_ps(w.mw2, _mm256_mul_ps(dx, _mm256_set1_ps(float(s16[1]))), acc);
  }
  return acc;
}

// One block of one rowblock for TT rows of x into accumulators in memory: cp[t * ldc + j], j < 16.
template <LinFormat F, int TT>
CPX_AVX2_INL void rowblock_step(const uint8_t* hdr, const uint8_t* wb, const Rows<TT>& x, int b, float* cp,
                                   int ldc) {
  __m256i s[2][TT];
  if constexpr (both_halves(F)) {
    rowblock_sums<F, TT>(wb, x, b, s);
  } else if constexpr (F == LinFormat::Q6_K && TT == 1) {
    q6_rowblock_sums(wb, x, b, s);
  } else {
    half_sums<F, TT>(wb, 0, x, b, s[0]);
    half_sums<F, TT>(wb, 1, x, b, s[1]);
  }
  const Scales sc[2] = {block_scales<F>(hdr, wb, 0), block_scales<F>(hdr, wb, 1)};
#pragma GCC unroll 4
  for (int t = 0; t < TT; ++t) {
    const __m256 dx = _mm256_set1_ps(x.d[t][b]), ds = _mm256_set1_ps(x.ds[t][b]);
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      float* p = cp + size_t(t) * ldc + 8 * half;
      _mm256_storeu_ps(p, accumulate<F>(_mm256_loadu_ps(p), s[half][t], sc[half], dx, ds,
                                        F == LinFormat::Q2_K ? x.s16[t] + 2 * b : nullptr));
    }
  }
}

template <LinFormat F, int TT>
CPX_AVX2_INL Rows<TT> rows_of(const ActQ& a, int t0) {
  const int nb = a.k / 32;
  Rows<TT> x;
#pragma GCC unroll 4
  for (int t = 0; t < TT; ++t) {
    const size_t row = size_t(t0 + t);
    x.q[t] = a.q + row * a.k;
    x.d[t] = a.d + row * nb;
    x.ds[t] = a.ds + row * nb;
    x.s[t] = a.s + row * nb;
    x.s16[t] = lin_split16(F) ? a.s16 + row * 2 * nb : nullptr;
  }
  return x;
}

template <LinFormat F, int R, int TT>
CPX_AVX2 void mk(const QMat& w, int rb, const ActQ& a, int t0, float* c, int ldc) {
  constexpr LinLayout L = kLinLayout[int(F)];
  const size_t sbs = w.sb_bytes;
  const uint8_t* w0 = w.at(rb);
  const Rows<TT> x = rows_of<F, TT>(a, t0);
  __m256 acc[R][2];  // TT = 1
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  if constexpr (TT > 1) {
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t)
#pragma GCC unroll 8
      for (int j = 0; j < 2 * R; ++j) _mm256_storeu_ps(c + size_t(t) * ldc + 8 * j, _mm256_setzero_ps());
  }
  for (int sb = 0; sb < w.nsb; ++sb) {
    const uint8_t* ws = w0 + size_t(sb) * kGroupRowblocks * sbs;
    if constexpr (L.sb_blocks == 1) {
      for (size_t o = 0; o < R * sbs; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ws + kPrefetchBytes + o), _MM_HINT_T0);
    }
    for (int j = 0; j < L.sb_blocks; ++j) {
      const int b = sb * L.sb_blocks + j;
      if constexpr (L.sb_blocks > 1) {
        const Ahead pf = block_ahead<F>(sb, b, sbs);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
          for (int o = 0; o < pf.len; o += 64)
            _mm_prefetch(reinterpret_cast<const char*>(ws + r * sbs + pf.at + o), _MM_HINT_T0);
      }
      if constexpr (TT == 1) {  // registers: 8 accumulators, one (rowblock, half) at a time
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const uint8_t* hdr = ws + r * sbs;
          const uint8_t* wb = hdr + L.hdr + size_t(j) * L.blk;
          const __m256 dx = _mm256_set1_ps(x.d[0][b]), ds = _mm256_set1_ps(x.ds[0][b]);
          if constexpr (both_halves(F)) {
            __m256i s[2][1];
            rowblock_sums<F, 1>(wb, x, b, s);
#pragma GCC unroll 2
            for (int half = 0; half < 2; ++half)
              acc[r][half] = accumulate<F>(acc[r][half], s[half][0], block_scales<F>(hdr, wb, half), dx, ds);
          } else {
#pragma GCC unroll 2
            for (int half = 0; half < 2; ++half) {
              __m256i s[1];
              half_sums<F, 1>(wb, half, x, b, s);
              acc[r][half] = accumulate<F>(acc[r][half], s[0], block_scales<F>(hdr, wb, half), dx, ds,
                                           F == LinFormat::Q2_K ? x.s16[0] + 2 * b : nullptr);
            }
          }
        }
      } else {
        // accumulators in the output tile; rowblocks in a loop, not unrolled: unrolled, a block's
        // code overflows the op cache and the front end halves the speed
#pragma GCC unroll 1
        for (int r = 0; r < R; ++r) {
          const uint8_t* hdr = ws + r * sbs;
          rowblock_step<F, TT>(hdr, hdr + L.hdr + size_t(j) * L.blk, x, b, c + 16 * r, ldc);
        }
      }
    }
  }
  if constexpr (TT == 1) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(c + 16 * r, acc[r][0]);
      _mm256_storeu_ps(c + 16 * r + 8, acc[r][1]);
    }
  }
}

// Decode and M = 2, 3: G whole groups (4 G rowblocks from rb, a multiple of 4) x TT rows of x in one
// pass that reads the groups' runs in lockstep, block by block: G read streams instead of one, the
// accumulators in the output tile. One stream per core fell short of the memory system on a 2-core
// Zen 3 VM (a plain read loop: one core ~12 GB/s with one stream, ~18 with 8; two cores ~19 and ~28),
// and 4 groups took the Q4_1 LM head at M = 1 from ~20 to ~23 GB/s on two cores (~11 to ~13.5 on one);
// the K-quants' longer groups go one or two at a time (max_streams). Each unit's block is prefetched
// kStreamPrefetchBytes (K-quants: prefetch_blocks) ahead as it is reached (spread over the pass rather
// than a burst per superblock: ~5% more), non-temporally: a decode step streams every weight once, and
// lines brought in as ordinary ones push the KV cache and the activations out of L2 / L3 (on a 2-core
// Zen 3 VM, SmolLM2 Q4_1 decode at 128 + 64 tokens ran ~9% faster with NTA, the attention's share most).
// Where each block's prefetch lands: prefetch_blocks.
template <LinFormat F, int TT>
CPX_AVX2 void mk_groups(const QMat& w, int rb, int G, const ActQ& a, int t0, float* c, int ldc) {
  constexpr LinLayout L = kLinLayout[int(F)];
  const size_t sbs = w.sb_bytes, gstride = w.group_bytes();
  const uint8_t* w0 = w.at(rb);
  const Rows<TT> x = rows_of<F, TT>(a, t0);
  for (int t = 0; t < TT; ++t)
    for (int j = 0; j < 2 * kGroupRowblocks * G; ++j)
      _mm256_storeu_ps(c + size_t(t) * ldc + 8 * j, _mm256_setzero_ps());
  for (int sb = 0; sb < w.nsb; ++sb) {
    for (int j = 0; j < L.sb_blocks; ++j) {
      const int b = sb * L.sb_blocks + j;
      const Ahead pf = L.sb_blocks == 1 ? Ahead{kStreamPrefetchBytes, L.hdr + L.blk} : block_ahead<F>(sb, b, sbs);
#pragma GCC unroll 1
      for (int u = 0; u < G * kGroupRowblocks; ++u) {
        const uint8_t* hdr =
            w0 + (u / kGroupRowblocks) * gstride + (size_t(sb) * kGroupRowblocks + u % kGroupRowblocks) * sbs;
        const uint8_t* wb = hdr + L.hdr + size_t(j) * L.blk;
        for (int o = 0; o < pf.len; o += 64) _mm_prefetch(reinterpret_cast<const char*>(hdr + pf.at + o), _MM_HINT_NTA);
        rowblock_step<F, TT>(hdr, wb, x, b, c + 16 * u, ldc);
      }
    }
  }
}
// Groups one decode pass reads in lockstep (a task holds at most kGroupStreams of them): all of them for
// the one-block formats, one or two at a time for the K-quants, whose group is a long stream of its own (a
// 64-row group of 2048 inputs: 74 KiB in Q4_K, 107 KiB in Q6_K, against Q4_1's 23 KiB at SmolLM2's 576).
// On a 2-core Zen 3 VM with a starved memory system (a streaming read at 10-22 GB/s), one group at a time
// against four, in one process, alternating every 32 tokens (10 pairs each): DeepSeek-V2-Lite-shaped
// Q4_K_M decode (its LM head Q6_K) 1.17x the tokens/s (every pair above 1.08x), Q8_0 decode 1.00x; on
// their own from DRAM (alternating with ggml's vec_dot in the same process, which reads one row after
// another), Q6_K at 129280 x 2048 went from 0.81-0.85 of ggml's speed to 1.15-1.21, Q4_K at 65536 x 2048
// from 0.76-0.89 to 1.00-1.25. Two groups were not tried then. They are better where the view is strided
// (the model's decode passes, linear_calls.cpp: a task's groups lie Q groups apart, and the tasks a
// thread takes in turn continue the same streams), and not where it is contiguous (QuantLinear::forward's
// tasks of whole consecutive groups). The same host in a fast spell (reads of 32-35 GB/s), in one process,
// alternating per 48-token decode (10-12 pairs), against one group: q4_k_m 1.077x the tokens/s (the Q6_K
// LM head's, the experts' and the dense layers' passes each 9-14% shorter in a phase profile), iq4_xs
// 1.051x, q3_k_m 1.049x, q2_k 1.064x, every pair at 1.00x or above; three groups 1.03-1.05x. On their
// own in contiguous tasks (16384 x 2048, 10 rounds) two groups ran q4_k 6% faster but iq4_xs and q3_k
// 10-11% and the 129280 x 2048 Q6_K LM head 2-4% slower, so those keep one.
template <LinFormat F>
int max_streams(const QMat& w) {
  return lin_one_block(F) ? kGroupStreams : w.group_step > 1 ? 2 : 1;
}

using Mk = void (*)(const QMat&, int, const ActQ&, int, float*, int);

// [R - 1][TT - 1]
template <LinFormat F>
struct Tiles {
  static constexpr Mk t[4][4] = {{mk<F, 1, 1>, mk<F, 1, 2>, mk<F, 1, 3>, mk<F, 1, 4>},
                                 {mk<F, 2, 1>, mk<F, 2, 2>, mk<F, 2, 3>, mk<F, 2, 4>},
                                 {mk<F, 3, 1>, mk<F, 3, 2>, mk<F, 3, 3>, mk<F, 3, 4>},
                                 {mk<F, 4, 1>, mk<F, 4, 2>, mk<F, 4, 3>, mk<F, 4, 4>}};
};
constexpr int kTileRows = 4;

template <LinFormat F>
CPX_AVX2 void gemm(const QMat& w, int rb0, int rb1, const ActQ& a, int t0, int nt, float* c, int ldc) {
  if (nt <= kGroupStreamRows) {  // one pass over the weights: whole groups in lockstep, partial ones as tiles
    using MkG = void (*)(const QMat&, int, int, const ActQ&, int, float*, int);
    constexpr MkG kMkG[3] = {mk_groups<F, 1>, mk_groups<F, 2>, mk_groups<F, 3>};
    for (int rb = rb0; rb < rb1;) {
      const int head = std::min(rb1 - rb, (kGroupRowblocks - rb % kGroupRowblocks) % kGroupRowblocks);
      const int groups = std::min(max_streams<F>(w), (rb1 - rb) / kGroupRowblocks);
      if (head > 0 || groups == 0) {
        const int r = head > 0 ? head : rb1 - rb;
        Tiles<F>::t[r - 1][nt - 1](w, rb, a, t0, c + (rb - rb0) * 16, ldc);
        rb += r;
      } else {
        kMkG[nt - 1](w, rb, groups, a, t0, c + (rb - rb0) * 16, ldc);
        rb += groups * kGroupRowblocks;
      }
    }
    return;
  }
  for (int rb = rb0; rb < rb1;) {
    // a tile stays inside its group of 4 rowblocks (one contiguous run per superblock)
    const int r = std::min({kGroupRowblocks, rb1 - rb, kGroupRowblocks - rb % kGroupRowblocks});
    for (int t = 0; t < nt; t += kTileRows) {
      const int tt = std::min(kTileRows, nt - t);
      Tiles<F>::t[r - 1][tt - 1](w, rb, a, t0 + t, c + size_t(t) * ldc + (rb - rb0) * 16, ldc);
    }
    rb += r;
  }
}

// ---- f32 weights

// c[t][0 .. 16 R) for TT rows of x, R rowblocks from w (each k * 16 floats further).
template <int R, int TT>
CPX_AVX2 void mkf(const float* w, int k, const float* x, size_t ldx, float* c, int ldc) {
  __m256 acc[R][2][TT];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 6
    for (int t = 0; t < TT; ++t) acc[r][0][t] = acc[r][1][t] = _mm256_setzero_ps();
  const size_t rs = size_t(k) * 16;
  for (int i = 0; i < k; ++i) {
    if (TT <= 2) {  // streaming: each rowblock's run is read once
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + r * rs + size_t(i) * 16) + kPrefetchBytes, _MM_HINT_T0);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float* wi = w + r * rs + size_t(i) * 16;
      const __m256 w0 = _mm256_loadu_ps(wi), w1 = _mm256_loadu_ps(wi + 8);
#pragma GCC unroll 6
      for (int t = 0; t < TT; ++t) {
        const __m256 xv = _mm256_broadcast_ss(x + t * ldx + i);
        acc[r][0][t] = _mm256_fmadd_ps(w0, xv, acc[r][0][t]);
        acc[r][1][t] = _mm256_fmadd_ps(w1, xv, acc[r][1][t]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 6
    for (int t = 0; t < TT; ++t) {
      _mm256_storeu_ps(c + size_t(t) * ldc + 16 * r, acc[r][0][t]);
      _mm256_storeu_ps(c + size_t(t) * ldc + 16 * r + 8, acc[r][1][t]);
    }
}

using MkF = void (*)(const float*, int, const float*, size_t, float*, int);
constexpr int kF32TileRows = 6;
const MkF kMkF1[4] = {mkf<1, 1>, mkf<2, 1>, mkf<3, 1>, mkf<4, 1>};  // [R - 1], one row of x
const MkF kMkF2[2] = {mkf<1, 2>, mkf<2, 2>};                        // [R - 1], two rows
const MkF kMkFT[kF32TileRows] = {mkf<1, 1>, mkf<1, 2>, mkf<1, 3>, mkf<1, 4>, mkf<1, 5>, mkf<1, 6>};  // [TT - 1]

CPX_AVX2 void gemm_f32(const float* w, int k, int rb0, int rb1, const float* x, size_t ldx, int nt, float* c,
                       int ldc) {
  const size_t rs = size_t(k) * 16;
  if (nt <= 2) {  // one pass over the weights, several rowblocks per tile for independent chains
    const int rmax = nt == 1 ? 4 : 2;
    for (int rb = rb0; rb < rb1;) {
      const int r = std::min(rmax, rb1 - rb);
      (nt == 1 ? kMkF1 : kMkF2)[r - 1](w + size_t(rb) * rs, k, x, ldx, c + (rb - rb0) * 16, ldc);
      rb += r;
    }
    return;
  }
  for (int rb = rb0; rb < rb1; ++rb)
    for (int t = 0; t < nt; t += kF32TileRows) {
      const int tt = std::min(kF32TileRows, nt - t);
      kMkFT[tt - 1](w + size_t(rb) * rs, k, x + size_t(t) * ldx, ldx, c + size_t(t) * ldc + (rb - rb0) * 16, ldc);
    }
}

// ---- stores

// fp32 -> bf16, round to nearest even, NaN kept quiet: f32_to_bf16 (common.h) on 8 lanes.
CPX_AVX2 inline __m128i bf16_rne(__m256 v) {
  const __m256i u = _mm256_castps_si256(v), hi = _mm256_srli_epi32(u, 16);
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(hi, _mm256_set1_epi32(1)));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));  // lanes <= 0xffff
}

CPX_AVX2 void store_avx2(const float* c, int ldc, int nt, int ncols, const float* bias, void* out, bool bf16,
                         size_t ldo) {
  for (int t = 0; t < nt; ++t) {
    const float* cr = c + size_t(t) * ldc;
    int j = 0;
    for (; j + 8 <= ncols; j += 8) {
      __m256 v = _mm256_loadu_ps(cr + j);
      if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + j));
      if (bf16)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + size_t(t) * ldo + j), bf16_rne(v));
      else
        _mm256_storeu_ps(static_cast<float*>(out) + size_t(t) * ldo + j, v);
    }
    for (; j < ncols; ++j) {  // the same rounding as bf16_rne
      const float v = bias ? cr[j] + bias[j] : cr[j];
      if (bf16)
        static_cast<uint16_t*>(out)[size_t(t) * ldo + j] = f32_to_bf16(v);
      else
        static_cast<float*>(out)[size_t(t) * ldo + j] = v;
    }
  }
}

CPX_AVX2 void to_bf16_avx2(const float* x, uint16_t* y, int n) {
  int j = 0;
  for (; j + 8 <= n; j += 8) _mm_storeu_si128(reinterpret_cast<__m128i*>(y + j), bf16_rne(_mm256_loadu_ps(x + j)));
  for (; j < n; ++j) y[j] = f32_to_bf16(x[j]);
}

CPX_AVX2 inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
CPX_AVX2 inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

}  // namespace

// Same results as quantize_row_q8 bit for bit: the same fp32 divide and reciprocal, and
// round-half-away-from-zero done exactly (truncate, then step away where |fraction| >= 0.5).
CPX_AVX2 void quantize_row_q8_avx2(const float* x, int k, int8_t* q, float* d, int32_t* sum) {
  const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f), sign = _mm256_set1_ps(-0.0f);
  for (int b = 0; b < k / 32; ++b) {
    __m256 v[4];
    __m256 bad = _mm256_setzero_ps(), amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + b * 32 + 8 * i);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(v[i], v[i]), _mm256_setzero_ps(), _CMP_NEQ_UQ));
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    if (_mm256_movemask_ps(bad)) {  // x - x is NaN exactly where x is NaN or infinite
      std::memset(q + b * 32, 0, 32);
      d[b] = __builtin_nanf("");
      sum[b] = 0;
      continue;
    }
    const float db = hmax(amax) / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
    const __m256 vid = _mm256_set1_ps(id);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 p = _mm256_mul_ps(v[i], vid);
      const __m256 t = _mm256_round_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      const __m256 away = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(p, t)), half, _CMP_GE_OQ);
      const __m256 step = _mm256_and_ps(away, _mm256_or_ps(one, _mm256_and_ps(p, sign)));  // +-1 or 0
      qi[i] = _mm256_cvttps_epi32(_mm256_add_ps(t, step));
    }
    // int32 -> int8: the packs interleave 128-bit lanes; the permute puts the 4-byte runs back in order
    const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    const __m256i p8 = _mm256_permutevar8x32_epi32(p16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * 32), p8);
    d[b] = db;
    sum[b] = hsum(_mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3])));
  }
}

const LinKernels kLinAvx2 = {
    "avx2",
    {nullptr, gemm<LinFormat::Q8_0>, gemm<LinFormat::Q4_0>, gemm<LinFormat::Q4_1>, gemm<LinFormat::Q4_K>,
     gemm<LinFormat::Q5_K>, gemm<LinFormat::Q6_K>, nullptr, gemm<LinFormat::IQ4_NL>, gemm<LinFormat::IQ4_XS>,
     gemm<LinFormat::Q3_K>, gemm<LinFormat::Q2_K>, gemm<LinFormat::Q5_0>, gemm<LinFormat::Q5_1>},
    quantize_row_q8_avx2,
    store_avx2,
    to_bf16_avx2,
    gemm_f32,
    true,
};

}  // namespace cpx

#endif  // CPX_X86
