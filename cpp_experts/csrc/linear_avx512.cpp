// AVX-512 VNNI QuantLinear kernels over the packed layout (quant_linear.h), compiled with target
// attributes and called only after cpu.cpp found AVX-512 VNNI.
//
// A register tile of R rowblocks (16 output rows each, one zmm) x TT rows of x. Per 32-value block
// the weight bytes are vpdpbusd'ed against the int8 activations (4 values broadcast to every lane)
// into int32 sums, which one FMA then scales by d_w * d_x into fp32 accumulators. At M <= 3, R = 4:
// four independent vpdpbusd chains hide their latency while one contiguous run per superblock streams
// a 64-row group, so the pass runs at memory speed (helped by software prefetch). Above, R = 2 and
// TT = 4: the tile's weights stay in L1 while all rows of x pass over them, and 16 accumulators + 8
// sums fit the 32 zmm registers.
#include "cpu.h"  // CPX_X86
#if CPX_X86  // an x86 path: elsewhere this file compiles to nothing
#include <algorithm>

#include "cpu.h"
#include "linear_simd.h"

namespace cpx {
namespace {

using namespace lin;

// Software prefetch along a task's weights (one contiguous run): how far ahead, and into L1 (T0) or
// L2 (T1). The hardware prefetchers alone leave a core short of the memory bandwidth, most on the 4-bit
// formats: 8 KiB ahead into L1 took Q4_1 at M = 1 from ~23 to ~30 GB/s with a 110 MB working set, ~5%
// with 256 MB (2 cores of a Sapphire Rapids-class VM); 1 KiB did little, 32 KiB less than 8, the L2
// hints (T1, T2) no better than T0; on a 2-core Zen 5 VM it reads Q8_0 at 0.95 of a torch-sum read.
// Zen 4 (AMD family 19h; Zen 3, the same family, has no AVX-512) wants it further ahead and into L2:
// on a 2-core Zen 4 VM (M = 1, 16384 x 2048 Q8_0 from DRAM, each run against a torch-sum read right
// before it) 8 KiB into L1 read at 0.67-0.74 of it, no prefetch 0.57-0.61, 8 KiB into L2 0.77-0.84,
// 16 KiB into L2 0.82-0.92 (32 and 64 KiB no better), T2 and NTA below T1; DeepSeek-V2-Lite-shaped
// decode went from ~32 to ~39 tokens/s (Q8_0) and ~39 to ~52 (Q4_K_M), two interleaved runs each.
// The one-block formats prefetch a tile's whole superblock run (R x 544 bytes at most for Q8_0) as it
// starts. The K-quants' run is R x 2.3-3.4 KiB, and prefetched in one burst (~150 lines, likely more
// than the core's queues of outstanding misses hold) it read far slower than prefetched a rowblock's
// block at a time as each is reached, the same byte distance ahead, as they do now. On the Zen 4 VM
// (M = 1, 16384 x 2048 from DRAM, against a torch-sum read, 3 interleaved rounds) q4_k went from
// 0.57-0.60 to 0.84-0.89 of it, q5_k 0.46-0.58 to 0.90-1.02, q6_k 0.62-0.65 to 0.90-0.94, and
// DeepSeek-V2-Lite-shaped Q4_K_M decode from ~40 to ~59 tokens/s.
// Prefetching every group's line as it is read (the one-block formats too) measured within the noise
// of this for the K-quants and no better for Q8_0.
// In a decode pass (M <= 3) the K-quants now prefetch their tile's run as the one-block formats do, in
// address order, but spread over the superblock's blocks (1/8 of the run at each) rather than at its
// start; rowblock by rowblock the prefetches walk four places of the run at once. On a 2-core Zen 5 VM
// (M = 1, 16384 x 2048 from DRAM, NTA, 3 interleaved rounds, us a call): q4_k 464 -> 442, q5_k 660 ->
// 457, q3_k 299 -> 254, iq4_xs 405 -> 362, q6_k 698 -> 635; in a second sitting q4_k 495 -> 454 and q6_k
// the same (712-740 -> 721-735); DeepSeek-V2-Lite-shaped Q4_K_M decode 1.028x (10 interleaved rounds).
// Above M = 3 (R = 2: a tile reads two of a group's four rowblocks) the address-order prefetch read
// slower (q4_k at M = 4 410 -> 442 us, M = 16 923 -> 982): those tiles keep the rowblock-wise one.
//
// Zen 5 (family 1Ah) prefetches a pass that reads each weight once (M <= 3: a decode) non-temporally
// (NTA), so that the weights streaming through do not push out of the L2 and L3 what is read again
// (activations, the KV cache, the engine's own working set between forwards). On a 2-core Zen 5 VM
// (two processes, interleaved rounds; its read moves between ~45 and ~75 GB/s in spells), against the
// same 8 KiB into L1: DeepSeek-V2-Lite-shaped decode Q8_0 +0.5% and +1.9% (medians of 12 rounds), Q4_K_M
// +2.7% (8), SmolLM2 Q4_1 at 128 tokens of context -2.6%, +1.1% and +1.0% (10, 8, 12); in one earlier
// sitting (every prefetch NTA) Q8_0 +7%, Q4_K_M +10%, SmolLM2 +27%, and single rounds in fast spells
// gave Q4_K_M +27-31%. One weight at M = 1 from DRAM read as fast either way in a slow spell (0.98-1.01)
// and q4_k 4-7% faster in a fast one. Prefill tiles read each weight once per 64 rows of x, and NTA
// there cost 6% of a 512-token prompt: they keep T0.
//
// Zen 4's decode tiles of the one-block formats also ask for the lines 2 KiB ahead into L1 (T0), beside
// the 16 KiB into L2. On the 2-core Zen 4 VM (M = 1, 16384 x 2048 from DRAM, each pass against the
// streaming read around it, the two builds in alternating processes, 45 passes each in a slow read
// spell): q4_1 0.925 -> 0.974 of the read, q8_0 0.933 -> 0.929 (a 1 KiB lead: q4_1 0.925 -> 0.947 and
// 0.976, q8_0 0.933 -> 0.935 and 0.905 -> 0.954, two sittings); SmolLM2 Q4_1 decode 1.039 (12 interleaved
// rounds; 1 KiB: 1.026 and 1.038 over 10 and 12). Tried there and not kept, each against this file's
// other choices: NTA at 8 or 16 KiB (model 0.87, 0.79), T1 at 32 KiB (0.99), and two groups read in
// lockstep (q4_1 0.890, q8_0 0.828 of the read against 0.925, 0.933).
struct Prefetch {
  size_t bytes;
  bool l2;          // into L2 (T1) rather than L1 (T0)
  bool nta_once;    // a pass that reads each weight once prefetches non-temporally
  size_t l1 = 0;    // a decode pass of a one-block format also prefetches this far ahead into L1 (0: no)
};
const Prefetch kPrefetch = [] {
  const CpuInfo& cpu = cpu_info();
  if (cpu.amd && cpu.family == 0x19) return Prefetch{16384, true, false, 2048};
  if (nta_decode_prefetch()) return Prefetch{kNtaPrefetchBytes, false, true};
  return Prefetch{8192, false, false};
}();

// `once`: the tile's pass reads each weight once (gemm: at most 3 rows of x). Always inlined: GCC takes
// a function that only prefetches for one without effects, and silently drops the calls to it that it
// does not inline (a build whose prefetch had grown by two branches lost every prefetch of its decode
// tiles, and its Q8_0 decode read at ~0.68 of a torch-sum read instead of ~0.93 on the Zen 4 VM).
CPX_VNNI __attribute__((always_inline)) inline void prefetch(const uint8_t* p, bool once) {
  if (once && kPrefetch.nta_once)
    _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_NTA);
  else if (kPrefetch.l2)
    _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
  else
    _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}

// How far ahead a tile of R rowblocks prefetches, for a superblock of sbs bytes a rowblock. A whole
// group's tile (R = 4, M <= 3) reads its group's runs back to back, so any distance lands on lines it
// is about to read. A narrower one (R = 2 above M = 3) reads every other part of each run, and
// kPrefetch.bytes, rounded up to whole runs, keeps its prefetches on its own rowblocks rather than
// the group's others: on the Zen 4 VM (M = 4, 16384 x 2048 from DRAM, two interleaved rounds) q4_1
// went from ~0.70 to ~0.91 of a torch-sum read, q8_0 ~0.41 to ~0.67, q4_k ~0.58 to ~0.89, q6_k ~0.73
// to ~0.9.
template <int R>
inline size_t prefetch_ahead(size_t sbs) {
  return R == kGroupRowblocks ? kPrefetch.bytes : round_up(kPrefetch.bytes, kGroupRowblocks * sbs);
}

// `first`: the tile starts its task (the task's first run of weights, not prefetched by a run before it);
// `once`: its pass reads each weight once (prefetch).
template <LinFormat F, int R, int TT>
CPX_VNNI void mk(const QMat& w, int rb, const ActQ& a, int t0, float* c, int ldc, bool first, bool once) {
  constexpr LinLayout L = kLinLayout[int(F)];
  constexpr bool kQ8 = F == LinFormat::Q8_0, kSplit = lin_split16(F), kK = L.sb_blocks > 1;
  constexpr int kOff16 = lin_offset16(F);
  // A decode tile (TT <= 2) sums a block in two chains of vpdpbusd per (rowblock, row of x), not one of
  // eight (its latency is 4 cycles): the 4-bit formats' high nibbles and q8_0's odd groups into s2, added
  // to s before the block is scaled (the same int32 sum). With the prefetch loops unrolled (sbs a
  // constant) a 2048 x 576 Q4_1 weight held in L2 took 19.3-21.6 us a call on one Zen 4 core before and
  // 17.8-19.4 after, q8_0 27.1-29.7 and 25.6-28.8 (3 alternating processes); SmolLM2's decode, whose
  // weights come from DRAM, measured within the noise.
  constexpr bool kTwoChains = !kSplit && TT <= 2;
  // QMat::sb_bytes as a constant of the format: the prefetch loops below unroll
  constexpr size_t sbs = lin_sb_bytes(F);
  const uint8_t* w0 = w.at(rb);
  const size_t ahead = prefetch_ahead<R>(sbs);
  const int nb = a.k / 32;
  const int8_t* xq[TT];
  const float *xd[TT], *xds[TT];
  const int32_t *xs[TT], *xs16[TT];
#pragma GCC unroll 4
  for (int t = 0; t < TT; ++t) {
    const size_t row = size_t(t0 + t);
    xq[t] = a.q + row * a.k;
    xd[t] = a.d + row * nb;
    xds[t] = a.ds + row * nb;
    xs[t] = a.s + row * nb;
    xs16[t] = kSplit ? a.s16 + row * 2 * nb : nullptr;
  }
  __m512 acc[R][TT];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();

  for (int sb = 0; sb < w.nsb; ++sb) {
    const uint8_t* ws = w0 + size_t(sb) * kGroupRowblocks * sbs;
    if constexpr (!kK) {
#pragma GCC unroll 64
      for (size_t o = 0; o < R * sbs; o += 64) prefetch(ws + ahead + o, once);
      if (once && kPrefetch.l1)
#pragma GCC unroll 64
        for (size_t o = 0; o < R * sbs; o += 64)
          _mm_prefetch(reinterpret_cast<const char*>(ws + kPrefetch.l1 + o), _MM_HINT_T0);
      // A task's first run: nothing ahead of it below `ahead` was prefetched (a later run's was, by the
      // run before it). Those bytes are prefetched at twice the reading pace, two superblock steps an
      // iteration, not in one burst at the start (a burst of the first 16 KiB made the step slower). On
      // the 2-core Zen 4 VM, in one process with the ramp switched off and on every two generations
      // (SmolLM2 Q4_1 decode, 128-token prompt, 200-240 generations of 64 tokens, three runs): 2.2%,
      // 5.0% and 4.3% faster a step; one call of 3072 x 576 Q4_1 from memory 8% faster at M = 1 and M =
      // 16, 576 x 576 3%, 65536 x 2048 2%, the 49152 x 576 Q8_0 head 1%.
      if (first) {
        const size_t step = size_t(kGroupRowblocks) * sbs;
        const size_t lo = (2 * size_t(sb) + 1) * step, hi = lo + 2 * step;
        const size_t end = std::min(hi, size_t(sb) * step + ahead);
        for (size_t o = lo; o < end; o += 64) prefetch(w0 + o, once);
      }
    }
    __m512 dsup[R], msup[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      dsup[r] = kK ? f16x16(ws + r * sbs) : _mm512_setzero_ps();
      msup[r] = kK && has_min(F) ? f16x16(ws + r * sbs + 32) : _mm512_setzero_ps();
    }
    for (int j = 0; j < L.sb_blocks; ++j) {
      const int b = sb * L.sb_blocks + j;
      const uint8_t* wb[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) wb[r] = ws + r * sbs + L.hdr + size_t(j) * L.blk;
      if constexpr (kK) {
        if (once) {  // the run `ahead` on, as one ascending stream at the pace the tile reads its own
          const size_t chunk = round_up(size_t(R) * sbs, size_t(64) * L.sb_blocks) / L.sb_blocks;
          for (size_t o = size_t(j) * chunk; o < size_t(j + 1) * chunk; o += 64) prefetch(ws + ahead + o, true);
        } else {  // each rowblock's block `ahead` on, as it is reached
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            if (j == 0) prefetch(ws + r * sbs + ahead, false);
#pragma GCC unroll 8
            for (int o = 0; o < L.blk; o += 64) prefetch(wb[r] + ahead + o, false);
          }
        }
      }
      // int32 sums per (rowblock, row of x), started at -zero_point * (sum of the row's q); the
      // lin_split16 formats keep elements 0..15 (s) and 16..31 (s2) apart, as their scales differ.
      __m512i s[R][TT], s2[R][TT];
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) {
        const __m512i init = _mm512_set1_epi32(kSplit ? -kOff16 * xs16[t][2 * b] : -lin_zero_point(F) * xs[t][b]);
        const __m512i init2 = kSplit ? _mm512_set1_epi32(-kOff16 * xs16[t][2 * b + 1]) : _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          s[r][t] = init;
          s2[r][t] = init2;
        }
      }
      if constexpr (kQ8) {
#pragma GCC unroll 8
        for (int g = 0; g < 8; ++g)
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const __m512i wv = _mm512_loadu_si512(wb[r] + 64 * g);
#pragma GCC unroll 4
            for (int t = 0; t < TT; ++t) {
              if (kTwoChains && (g & 1))
                s2[r][t] = _mm512_dpbusd_epi32(s2[r][t], wv, bcast4(xq[t] + 32 * b + 4 * g));
              else
                s[r][t] = _mm512_dpbusd_epi32(s[r][t], wv, bcast4(xq[t] + 32 * b + 4 * g));
            }
          }
      } else {
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g)
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            __m512i lo, hi;
            unpack_group<F>(wb[r], g, lo, hi);
#pragma GCC unroll 4
            for (int t = 0; t < TT; ++t) {
              const int8_t* x = xq[t] + 32 * b + 4 * g;
              s[r][t] = _mm512_dpbusd_epi32(s[r][t], lo, bcast4(x));
              if constexpr (kSplit || kTwoChains)
                s2[r][t] = _mm512_dpbusd_epi32(s2[r][t], hi, bcast4(x + 16));
              else
                s[r][t] = _mm512_dpbusd_epi32(s[r][t], hi, bcast4(x + 16));
            }
          }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        if constexpr (kTwoChains)
#pragma GCC unroll 4
          for (int t = 0; t < TT; ++t) s[r][t] = _mm512_add_epi32(s[r][t], s2[r][t]);
        const Scales sc = block_scales<F>(wb[r], dsup[r], msup[r]);
#pragma GCC unroll 4
        for (int t = 0; t < TT; ++t)
          acc[r][t] = accumulate<F>(acc[r][t], s[r][t], s2[r][t], sc, xd[t][b], xds[t][b],
                                    kSplit ? xs16[t] + 2 * b : nullptr);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) _mm512_storeu_ps(c + size_t(t) * ldc + 16 * r, acc[r][t]);
}

using Mk = void (*)(const QMat&, int, const ActQ&, int, float*, int, bool, bool);

// [R - 1][TT - 1]; R = 3, 4 only come with TT <= 3 (see gemm)
template <LinFormat F>
struct Tiles {
  static constexpr Mk t[4][4] = {{mk<F, 1, 1>, mk<F, 1, 2>, mk<F, 1, 3>, mk<F, 1, 4>},
                                 {mk<F, 2, 1>, mk<F, 2, 2>, mk<F, 2, 3>, mk<F, 2, 4>},
                                 {mk<F, 3, 1>, mk<F, 3, 2>, mk<F, 3, 3>, nullptr},
                                 {mk<F, 4, 1>, mk<F, 4, 2>, mk<F, 4, 3>, nullptr}};
};

template <LinFormat F>
CPX_VNNI void gemm(const QMat& w, int rb0, int rb1, const ActQ& a, int t0, int nt, float* c, int ldc) {
  const int rmax = nt <= 3 ? 4 : 2;
  const bool once = nt <= 3;  // every row of x in one tile: each weight is read once
  for (int rb = rb0; rb < rb1;) {
    // a tile stays inside its group of 4 rowblocks (one contiguous run per superblock)
    const int r = std::min({rmax, rb1 - rb, kGroupRowblocks - rb % kGroupRowblocks});
    for (int t = 0; t < nt; t += 4) {
      const int tt = std::min(4, nt - t);
      Tiles<F>::t[r - 1][tt - 1](w, rb, a, t0 + t, c + size_t(t) * ldc + (rb - rb0) * 16, ldc, rb == rb0 && t == 0, once);
    }
    rb += r;
  }
}

// fp32 -> bf16, round to nearest even, NaN kept quiet: f32_to_bf16 (common.h) on 16 lanes.
CPX_VNNI inline __m256i bf16_rne(__m512 v) {
  const __m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1)));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40))));
}

CPX_VNNI inline __mmask16 tail_mask(int left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1); }

CPX_VNNI void store_avx512(const float* c, int ldc, int nt, int ncols, const float* bias, void* out, bool bf16,
                           size_t ldo) {
  for (int t = 0; t < nt; ++t) {
    const float* cr = c + size_t(t) * ldc;
    for (int j = 0; j < ncols; j += 16) {
      const __mmask16 k = tail_mask(ncols - j);
      __m512 v = _mm512_maskz_loadu_ps(k, cr + j);
      if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, bias + j));
      if (bf16)
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + size_t(t) * ldo + j, k, bf16_rne(v));
      else
        _mm512_mask_storeu_ps(static_cast<float*>(out) + size_t(t) * ldo + j, k, v);
    }
  }
}

CPX_VNNI void to_bf16_avx512(const float* x, uint16_t* y, int n) {
  for (int j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    _mm256_mask_storeu_epi16(y + j, k, bf16_rne(_mm512_maskz_loadu_ps(k, x + j)));
  }
}

}  // namespace

const LinKernels kLinAvx512 = {
    "avx512_vnni",
    {nullptr, gemm<LinFormat::Q8_0>, gemm<LinFormat::Q4_0>, gemm<LinFormat::Q4_1>, gemm<LinFormat::Q4_K>,
     gemm<LinFormat::Q5_K>, gemm<LinFormat::Q6_K>, nullptr, gemm<LinFormat::IQ4_NL>, gemm<LinFormat::IQ4_XS>,
     gemm<LinFormat::Q3_K>, gemm<LinFormat::Q2_K>, gemm<LinFormat::Q5_0>, gemm<LinFormat::Q5_1>},
    quantize_row_q8_avx512,
    store_avx512,
    to_bf16_avx512,
};

}  // namespace cpx

#endif  // CPX_X86
