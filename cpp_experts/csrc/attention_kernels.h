// The kernels of paged attention (attention.cpp), compiled once per instruction set: attention_avx512.cpp
// (sixteen-lane vectors), attention_avx2.cpp and attention_base.cpp (eight lanes) each build
// task_entry_impl with their target attributes (CPX_ATTN_BUILD), and attention.cpp calls the one the
// CPU runs (CPX_DISPATCH_CALL). They are files of their own so that the three builds compile in
// parallel: in one file they took ~5.5 minutes of one core, the longest step of building the extension.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention.h"
#include "common.h"
#include "cpu.h"
#include "vec.h"

namespace cpx {
namespace attn {

constexpr int kKeyTile = 16;
// keys of one online-softmax update at most (run_task: four tiles where the rows are read in place)
constexpr int kMaxChunk = 4 * kKeyTile;
static_assert(kKeyTile == kAttnDumpTile, "a dump's tiles are the key tiles: every tile starts at a multiple of 16");
constexpr int kTokBlock = 4;       // tokens of one request per group (prefill; Layout::tok_block)
// The vdpbf16ps GQA kernel's groups hold eight: each chunk's prefetches, value interleaving and calls then
// serve twice the queries. One layer's prefill on a 2-core Zen 4 VM (3 alternating pairs): SmolLM2's 9 / 3
// heads of 64 over 2048 tokens 20.3-21.7 -> 16.9-17.2 ms, 16 / 16 heads of 128 over 1536 56 -> 42-43 ms;
// SmolLM2's 4096-token prefill 1.10x (4 rounds). The fp32 kernels keep four: the AVX2 build's 9 / 3 heads
// measured 46-54 -> 59-61 ms with eight.
constexpr int kMaxTokBlock = 8;
constexpr int kMlaHeadBlock = 16;  // heads per MLA group
// keys per key block at least: a decode token of a short context still splits into enough tasks for
// the pool (128 left SmolLM2's 3 KV heads at ~160 keys as 3 tasks on 2 threads, ~5% of decode)
constexpr int kMinSplitKeys = 64;
constexpr int kMaxBlocks = 16;      // key blocks per group at most

struct Group {
  int t0, nt;    // tokens t0..t0+nt-1 (one request, consecutive positions)
  int h0, nh;    // query heads h0..h0+nh-1
  int kv_head;   // GQA: the first KV head the group reads; MLA: 0
  int nkv;       // KV heads it reads, kv_head.. (its query heads h0.. split among them evenly); MLA: 1
  int64_t row;   // req_to_token row
  int64_t keys;  // keys the group reads: 0..keys-1 (the last token's position + 1, or the list's length)
  const int32_t* slots;  // the token's own slot list (one token), or null: the row's slots
  // the key count its blocks are cut for (key_blocks): its keys rounded up to a multiple of tok_block, so
  // the end of its tokens' aligned run of positions, the same whatever else the batch holds (below)
  int64_t span;
};

struct Layout {
  int H, D, Dv;             // query heads, score width, value width
  int64_t q_tok, q_head;    // q strides (elements)
  int64_t o_tok, o_head;    // out strides
  int64_t k_head_off, v_head_off;  // offset of one KV head within a slot (GQA: D, Dv); 0 for MLA
  bool mla;
  bool paired;  // bf16 rows read in the paired order (paired_at), no fp32 tiles: GQA, D == Dv of 64 or 128
  int lanes = vec::lanes();  // the kernels' vector width W (the paired order's half period)
  bool far_lead = attention_far_lead();  // decode tokens ask for rows kFarTiles tiles ahead into L2
  bool bf16_dot = false;  // a bf16 cache on AVX512_BF16: attention_bf16_dot.cpp's kernels (attention_bf16_dot())
  int tok_block = kTokBlock;  // tokens of one request per group at most, its positions one aligned run
};

// The kernels' vectors of W lanes: 8 (AVX2 and baseline builds) or 16 (AVX-512: half the multiply-adds
// and loads a key; one decode token of SmolLM2's shape over 1536 keys of a bf16 cache on a 2-core Zen 5
// VM, interleaved runs: ~59 -> ~42 us a call with the tile's softmax in one vector too). A query's
// result depends on W (its sums run in W lanes), never on the batch or the blocking.
template <int W>
struct Lanes;
template <>
struct Lanes<8> {
  using V = vec::v8f;
  static CPX_INLINE V load(const float* p) { return vec::load(p); }
  static CPX_INLINE V bf16(const uint16_t* p, bool odd) { return vec::load_bf16_lanes(p, odd); }
  static CPX_INLINE V splat(float x) { return vec::splat(x); }
  static CPX_INLINE void store(float* p, V v) { vec::store(p, v); }
  static CPX_INLINE float hsum(V v) { return vec::hsum(v); }
  static CPX_INLINE float hmax(V v) { return vec::hmax(v); }
  static CPX_INLINE V exp(V v) { return vec::exp8(v); }
  static CPX_INLINE void hsum4(V a, V b, V c, V d, float* out) { vec::hsum4(a, b, c, d, out); }
  // src[0..2W-1] into the paired order (paired_at): the even values, then the odd ones
  static CPX_INLINE void pair(const float* src, float* dst) {
    const V a = load(src), b = load(src + 8);
    store(dst, __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14));
    store(dst + 8, __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15));
  }
};
template <>
struct Lanes<16> {
  using V = vec::v16f;
  static CPX_INLINE V load(const float* p) { return vec::load16(p); }
  static CPX_INLINE V bf16(const uint16_t* p, bool odd) { return vec::load_bf16_lanes16(p, odd); }
  static CPX_INLINE V splat(float x) { return vec::splat16(x); }
  static CPX_INLINE void store(float* p, V v) { vec::store16(p, v); }
  static CPX_INLINE float hsum(V v) { return vec::hsum(vec::fold(v)); }
  static CPX_INLINE float hmax(V v) { return vec::hmax16(v); }
  static CPX_INLINE V exp(V v) { return vec::exp16(v); }
  static CPX_INLINE void hsum4(V a, V b, V c, V d, float* out) {
    vec::hsum4(vec::fold(a), vec::fold(b), vec::fold(c), vec::fold(d), out);
  }
  static CPX_INLINE void pair(const float* src, float* dst) {
    const V a = load(src), b = load(src + 16);
    store(dst, __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30));
    store(dst + 16, __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31));
  }
};

// The paired order of a bf16 row: each 2W values d0..d0+2W-1 as two W-lane vectors, the even values
// then the odd ones (vec::load_bf16_lanes: one instruction per W values widened, read from the cache
// itself, instead of widening the tile into fp32 rows and reading those). A query is permuted into
// this order once per task, a dot product then pairs the same elements as in natural order (summed
// in another order: a function of the position in the row alone, so the same for every key and
// blocking), and the accumulated values are in it until write_out puts them back. On a 2-core Zen 3 VM
// (one decode token of SmolLM2's shape over 1536 keys, interleaved runs, W = 8) a layer went from
// ~125-140 to ~105 us with the cache in L3, from ~258 to ~236 from DRAM.
CPX_INLINE int paired_at(int d, int W) { return (d & ~(2 * W - 1)) + (d & 1) * W + ((d & (2 * W - 1)) >> 1); }

// A row's W values from d (a multiple of W) as the kernels read them: fp32 rows in order; bf16 rows
// (the paired layout only) the even or odd lanes of the 2W values from d & ~(2W - 1).
template <int W>
CPX_INLINE typename Lanes<W>::V ld(const float* p, int d) { return Lanes<W>::load(p + d); }
template <int W>
CPX_INLINE typename Lanes<W>::V ld(const uint16_t* p, int d) { return Lanes<W>::bf16(p + (d & ~(2 * W - 1)), d & W); }

template <class KT>
CPX_INLINE const KT* kv_ptr(const void* base, int64_t stride, int64_t slot, int64_t off) {
  return static_cast<const KT*>(base) + slot * stride + off;
}

// Scores of kQB queries (one token's heads) against keys j and j + 1 at once: each key row and each
// query chunk is loaded once for all of them. Per (query, key) the arithmetic is always the same
// (W-lane partial sums along the head dim, then hsum): the result does not depend on the blocking.
constexpr int kQB = 4;
template <int QB, int W, class RT>
CPX_INLINE void dots2(const float* const* q, const RT* k0, const RT* k1, int n, float* s, int ls) {
  using Ln = Lanes<W>;
  using V = typename Ln::V;
  V a0[QB], a1[QB];
  for (int i = 0; i < QB; ++i) a0[i] = a1[i] = Ln::splat(0.0f);
  int d = 0;
  for (; d + W <= n; d += W) {
    const V x0 = ld<W>(k0, d), x1 = ld<W>(k1, d);
    for (int i = 0; i < QB; ++i) {
      const V qv = Ln::load(q[i] + d);
      a0[i] += qv * x0;
      a1[i] += qv * x1;
    }
  }
  for (int i = 0; i < QB; ++i) {
    s[i * ls] = Ln::hsum(a0[i]);
    s[i * ls + 1] = Ln::hsum(a1[i]);
    for (int e = d; e < n; ++e) {  // fp32 rows only: a paired row's length is a multiple of 2W
      s[i * ls] += q[i][e] * vec::scalar(k0[e]);
      s[i * ls + 1] += q[i][e] * vec::scalar(k1[e]);
    }
  }
}

// The same scores for keys j .. j + 3 (up to three queries with 16 registers, four with AVX-512's 32), their
// sums reduced four at a time by hsum4, which gives hsum's bits: dots2 and dots4 agree exactly.
template <int QB, int W, class RT>
CPX_INLINE void dots4(const float* const* q, const RT* const* k, int n, float* s, int ls) {
  using Ln = Lanes<W>;
  using V = typename Ln::V;
  V a[QB][4];
  for (int i = 0; i < QB; ++i)
    for (int j = 0; j < 4; ++j) a[i][j] = Ln::splat(0.0f);
  int d = 0;
  for (; d + W <= n; d += W) {
    V qv[QB];
    for (int i = 0; i < QB; ++i) qv[i] = Ln::load(q[i] + d);
    for (int j = 0; j < 4; ++j) {
      const V x = ld<W>(k[j], d);
      for (int i = 0; i < QB; ++i) a[i][j] += qv[i] * x;
    }
  }
  for (int i = 0; i < QB; ++i) {
    Ln::hsum4(a[i][0], a[i][1], a[i][2], a[i][3], s + i * ls);
    for (int e = d; e < n; ++e)
      for (int j = 0; j < 4; ++j) s[i * ls + j] += q[i][e] * vec::scalar(k[j][e]);
  }
}

// The same scores for keys j .. j + 7, with sixteen lanes (up to three queries: 24 accumulators of AVX-512's
// 32 registers), each query's eight reduced at once by vec::hsum8 (hsum's bits, as dots4's hsum4): on
// SmolLM2's 9 / 3 heads of 64 the reductions were about as many instructions as the multiply-adds. Rows
// of whole vectors only (n a multiple of 16).
template <int QB, class RT>
CPX_INLINE void dots8(const float* const* q, const RT* const* k, int n, float* s, int ls) {
  using Ln = Lanes<16>;
  using V = typename Ln::V;
  V a[QB][8];
  for (int i = 0; i < QB; ++i)
    for (int j = 0; j < 8; ++j) a[i][j] = Ln::splat(0.0f);
#pragma GCC unroll 8
  for (int d = 0; d < n; d += 16) {  // unrolled: a bf16 row's even or odd lanes chosen at compile time
    V qv[QB];
    for (int i = 0; i < QB; ++i) qv[i] = Ln::load(q[i] + d);
    for (int j = 0; j < 8; ++j) {
      const V x = ld<16>(k[j], d);
      for (int i = 0; i < QB; ++i) a[i][j] += qv[i] * x;
    }
  }
  for (int i = 0; i < QB; ++i) vec::store(s + i * ls, vec::hsum8(a[i]));
}

// acc = acc * corr + sum_j p[j] v[j] for QB queries that see the same nv keys. C chunks of 8 values at a
// time (C x QB accumulators in registers, each probability broadcast once per C chunks), then single
// chunks, then single values; per query and value the arithmetic is the same whatever the blocking
// (acc * corr, then p[j] v[j] added in key order).
template <int QB, int C, int W, class RT>
CPX_INLINE void pv_chunks(float* const* acc, const float* corr, const float* p, int lp, const RT* const* v, int nv,
                          int d) {
  using Ln = Lanes<W>;
  using V = typename Ln::V;
  V a[QB][C];
  for (int i = 0; i < QB; ++i)
    for (int c = 0; c < C; ++c) a[i][c] = Ln::load(acc[i] + d + W * c) * Ln::splat(corr[i]);
  for (int j = 0; j < nv; ++j) {
    V pj[QB];
    for (int i = 0; i < QB; ++i) pj[i] = Ln::splat(p[i * lp + j]);
    for (int c = 0; c < C; ++c) {
      const V x = ld<W>(v[j], d + W * c);
      for (int i = 0; i < QB; ++i) a[i][c] += pj[i] * x;
    }
  }
  for (int i = 0; i < QB; ++i)
    for (int c = 0; c < C; ++c) Ln::store(acc[i] + d + W * c, a[i][c]);
}

template <int QB, int W, class RT>
CPX_INLINE void pv_block(float* const* acc, const float* corr, const float* p, int lp, const RT* const* v, int nv,
                         int n) {
  // QB x C accumulators, QB broadcasts, a value chunk (and a bf16 mask) within the registers: with 16
  // (W = 8), at QB = 3 and C = 4 GCC kept four accumulators on the stack (a store and a load each per
  // key; 2-core Zen 3 VM, bf16 cache at 1536 keys: ~12% of the attention's instructions); AVX-512's
  // 32 hold 4 x 4 and more
  constexpr int C = W == 16 || QB <= 2 ? 4 : 2;
  int d = 0;
  for (; d + W * C <= n; d += W * C) pv_chunks<QB, C, W>(acc, corr, p, lp, v, nv, d);
  for (; d + W <= n; d += W) pv_chunks<QB, 1, W>(acc, corr, p, lp, v, nv, d);
  for (; d < n; ++d)  // fp32 rows only (as in dots2)
    for (int i = 0; i < QB; ++i) {
      float a = acc[i][d] * corr[i];
      for (int j = 0; j < nv; ++j) a += p[i * lp + j] * vec::scalar(v[j][d]);
      acc[i][d] = a;
    }
}

// Scores of QB heads of one token against a tile's keys krow[0..n) (n <= kKeyTile; krow holds real rows
// up to n rounded up to 8) into s[i * ls + j]: the spare keys' scores land past n, within the tile.
template <int QB, int W, class RT>
CPX_INLINE void score_tile(const float* const* qv, const RT* const* krow, int n, int D, float* s, int ls) {
  if constexpr (QB == 3 && W == 8) {  // as 2 + 1 heads: dots4<3>'s 12 accumulators, 3 queries and a key take all 16
    // ymm, and GCC kept one accumulator on the stack (a store-to-load chain per step, where 14% of the
    // attention's samples sat at a 1.5K context on a 2-core Zen 3 VM; the split alone measured within
    // the noise, -5% cold); the rows come from L1 again
    for (int j = 0; j < n; j += 4) {
      dots4<2, W>(qv, krow + j, D, s + j, ls);
      dots4<1, W>(qv + 2, krow + j, D, s + 2 * ls + j, ls);
    }
  } else if constexpr (QB <= 2 || W == 16) {  // AVX-512's 32 registers hold 4 x 4 accumulators
    if constexpr (W == 16 && QB <= 3) {  // or 3 x 8 (dots8), rows of whole vectors
      if (D % 16 == 0) {
        for (int j = 0; j < n; j += 8) dots8<QB>(qv, krow + j, D, s + j, ls);
        return;
      }
    }
    for (int j = 0; j < n; j += 4) dots4<QB, W>(qv, krow + j, D, s + j, ls);
  } else {
    for (int j = 0; j < n; j += 2) dots2<QB, W>(qv, krow[j], krow[j + 1], D, s + j, ls);
  }
}

// The online-softmax update of one query's state sq (m, l, acc) for a chunk's nv scores sc (scaled and
// turned into exp(s - m) in place): the max, the correction of acc (corr) and the sum once a chunk. A
// tile at a time did them four times for the same keys; one decode token of SmolLM2's shape (9 / 3 heads
// of 64, bf16 cache in L2) spent ~40% of its time there on a 2-core Zen 5 VM (measured with the score
// and value loops compiled out). Each tile's (m, sum) still goes to a dump (ds), m the chunk's. Where every
// score is -inf (a -inf query) sc is zeroed and corr is 1: the values add nothing.
template <int W>
CPX_INLINE void softmax_chunk(float* sc, int nv, float scale, float* sq, float& corr, float* de, float* ds) {
  using Ln = Lanes<W>;
  using V = typename Ln::V;
  static_assert(kKeyTile % W == 0, "a tile is whole vectors");
  const int whole = nv / kKeyTile * kKeyTile;  // keys in whole tiles, read as vectors
  const int tiles = (nv + kKeyTile - 1) / kKeyTile;
  float mx = sq[0];
  if (whole) {
    V m = Ln::splat(-INFINITY);
    for (int j = 0; j < whole; j += W) {
      const V x = Ln::load(sc + j) * Ln::splat(scale);
      Ln::store(sc + j, x);
      m = m > x ? m : x;
    }
    mx = std::max(mx, Ln::hmax(m));
  }
  for (int j = whole; j < nv; ++j) {
    sc[j] *= scale;
    mx = std::max(mx, sc[j]);
  }
  if (mx == -INFINITY) {
    corr = 1.0f;
    std::fill(sc, sc + nv, 0.0f);
    if (de) {
      std::fill(de, de + nv, 0.0f);
      for (int t = 0; t < tiles; ++t) ds[2 * t] = mx, ds[2 * t + 1] = 0.0f;
    }
    return;
  }
  // exp(0) is 1 exactly: an unchanged max (most chunks after the first few) skips the exp
  corr = sq[0] == mx ? 1.0f : sq[0] == -INFINITY ? 0.0f : vec::exp1(sq[0] - mx);
  // Each tile's sum on its own (a dump's), summed in tile order. A chunk of four whole tiles (a prefill's
  // chunks but its last) reduces their four vectors in one hsum4 (hsum's bits) rather than one hsum each:
  // the scalar adds of those reductions, one dependent chain a tile, were ~9% of a 4096-token SmolLM2
  // prefill's attention samples (perf, 2-core Zen 4 VM). Same bits.
  constexpr int kTiles = kMaxChunk / kKeyTile;
  float ts[kTiles] = {};
  auto tile_exp = [&](int t) {
    V e = Ln::splat(0.0f);
    for (int j = t * kKeyTile; j < (t + 1) * kKeyTile; j += W) {
      const V x = Ln::exp(Ln::load(sc + j) - Ln::splat(mx));
      Ln::store(sc + j, x);
      e += x;
    }
    return e;
  };
  const int wt = whole / kKeyTile;
  if (wt == kTiles) {
    const V e0 = tile_exp(0), e1 = tile_exp(1), e2 = tile_exp(2), e3 = tile_exp(3);
    Ln::hsum4(e0, e1, e2, e3, ts);
  } else {
    for (int t = 0; t < wt; ++t) ts[t] = Ln::hsum(tile_exp(t));
  }
  for (int t = wt; t < tiles; ++t)  // the last, partial tile
    for (int j = t * kKeyTile; j < nv; j += 8) {  // the buffer holds whole tiles: lanes past nv are not summed
      vec::store(sc + j, vec::exp8(vec::load(sc + j) - vec::splat(mx)));
      for (int l = j; l < std::min(nv, j + 8); ++l) ts[t] += sc[l];
    }
  float sum = 0.0f;
  for (int t = 0; t < tiles; ++t) {
    if (de) ds[2 * t] = mx, ds[2 * t + 1] = ts[t];
    sum += ts[t];
  }
  sq[0] = mx;
  sq[1] = sq[1] * corr + sum;
  if (de) std::copy(sc, sc + nv, de);  // AttnTokens::dump
}

// The softmax update of each query of group g for the chunk from key kc: the queries of token ti see
// seen[ti] of its keys (0: none), and chunk(qi, nv, de, ds) updates query qi (softmax_chunk, or the bf16
// kernels' own), de and ds its part of the token's AttnTokens::dump, or null. A -inf query adds nothing:
// its correction 1 and its probabilities 0 leave acc as it is, as long as its block of heads has another
// query to add (else the values are skipped).
template <class Chunk>
CPX_INLINE void softmax_update(const AttnTokens& tok, const Layout& L, const Group& g, const int* seen, int kc,
                               const Chunk& chunk) {
  for (int ti = 0; ti < g.nt; ++ti) {
    const int t = g.t0 + ti, nv = seen[ti];
    if (nv == 0) continue;
    float* dump = tok.dump && !g.slots ? tok.dump[t] : nullptr;
    const int64_t dn = tok.pos[t] + 1, dtiles = (dn + kAttnDumpTile - 1) / kAttnDumpTile;
    for (int hi = 0; hi < g.nh; ++hi) {
      const int qi = ti * g.nh + hi;
      const size_t h = size_t(g.h0 + hi);
      float* de = dump ? dump + h * dn + kc : nullptr;
      float* ds = dump ? dump + size_t(L.H) * dn + (h * dtiles + kc / kAttnDumpTile) * 2 : nullptr;
      chunk(qi, nv, de, ds);
    }
  }
}

// softmax_chunk on query qi's scores [qi][ls], state and correction, for softmax_update.
template <int W>
struct SoftmaxChunk {
  float *scores, *st, *corr;
  int ls, sw;
  float scale;
  CPX_INLINE void operator()(int qi, int nv, float* de, float* ds) const {
    softmax_chunk<W>(scores + size_t(qi) * ls, nv, scale, st + size_t(qi) * sw, corr[qi], de, ds);
  }
};

// How many of the n keys from key k each token of group g sees (seen[ti], 0: none): up to its position, or
// the whole of its slot list.
CPX_INLINE void see_keys(const AttnTokens& tok, const Group& g, int k, int n, int* seen) {
  for (int ti = 0; ti < g.nt; ++ti) {
    const int64_t limit = g.slots ? g.keys - 1 : tok.pos[g.t0 + ti];  // the last key it sees
    seen[ti] = k > limit ? 0 : int(std::min<int64_t>(n, limit - k + 1));
  }
}

// The rows of one key tile as fp32: the cache's rows themselves, or (bf16) widened into `buf`.
template <class KT>
CPX_INLINE void tile_rows(const KT* const* src, int nk, int n, float* buf, const float** rows) {
  for (int j = 0; j < nk; ++j) {
    if constexpr (std::is_same_v<KT, float>) {
      rows[j] = src[j];
    } else {
      float* dst = buf + size_t(j) * n;
      int d = 0;
      for (; d + 8 <= n; d += 8) vec::store(dst + d, vec::load(src[j] + d));
      for (; d < n; ++d) dst[d] = vec::scalar(src[j][d]);
      rows[j] = dst;
    }
  }
}

// A row's lines asked for: into L1 (locality 3, T0) by default, into L2 (2, T1) for the far lead, which
// keeps more of a task's rows in flight than L1's miss buffers hold.
template <int Locality = 3>
CPX_INLINE void prefetch_row(const void* p, int bytes) {
  for (int b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, Locality);
}
// How many key tiles ahead a task asks for its rows into L2 (beside the next tile into L1).
constexpr int kFarTiles = 2;

// KV head kh's share of the prefetches of the tile from key kt (the group's rows of kbytes and vbytes a
// slot; MLA: no V rows), asked for with its turn rather than the whole tile at once.
// Past the block's last tile, the first tile of the block after it: the pool gives each thread a
// contiguous range of tasks, so that block is mostly this thread's next task, whose first keys
// would otherwise be read cold (one decode token of SmolLM2's shape over 1536 keys in 16 blocks on
// one thread of a 2-core Zen 5 VM: ~122 -> ~101 us a layer, scattered slots; SmolLM2 decode after a
// 1536-token prompt on two threads, interleaved rounds: ~1.04-1.05x).
// And the tile kFarTiles on into L2. The prefetches into L1 alone stall once its miss buffers are
// full, so a task had few rows in flight: on a 2-core Zen 4 VM, SmolLM2's decode attention ran at
// about half its warm-cache rate. With this lead (bench/batch_decode_cpu.py, builds alternating by
// process, bench/results/batch_decode_cpu_zen4_avx512_l2_lead*.json): 16 requests at ~200 keys,
// attention 9002 -> 7153 us a step, 1.09x; 4 requests 2616 -> 2203 us, 1.07x; one request after
// 1536 tokens 3439 -> 2618 us, 1.06x, and 8 of them 1.25x; one at ~200 keys, where the decode
// program already asks for the layer's rows during the pass before, 0.94-1.01x in three runs
// (about neutral). 4, 6 or 8 tiles on measured the same as 2 within the noise. Decode
// tokens only (a group of one token): a prefill's groups read rows the groups before them have
// just read, and there the lead cost a 1536-token prefill ~6% (7 of 8 alternating pairs). Not on
// Zen 5, where these bursts stall the core and the lead cost (cpu.h, attention_far_lead); spread a
// share per KV head, as the L1 lead is, it measured no better there than none.
// Spread so, a share with each KV head's turn rather than the whole tile as the tile starts, it
// measured faster on the Zen 4 VM, where a decode group holds every KV head (SmolLM2's 3; MLA's one
// group has a single turn, as before): one decode token over 4096 keys of a bf16 cache, 30 layers'
// caches from DRAM in turn, ~180-194 -> ~166-184 us a layer with contiguous slots and ~204-223 ->
// ~161-183 with scattered ones (3 alternating pairs); SmolLM2 decode after a 4096-token prompt
// 1.124x (attention 5195 -> 4518 us a step, 6 rounds, batch_decode_cpu_zen4_avx512_far_lead_spread_
// 4096.json); 1, 8 and 16 requests at ~200 keys 1.02x, 0.99x and 1.10x (_200.json), within the noise.
template <class KT>
CPX_INLINE void prefetch_turn(const PagedKv& kv, const Layout& L, const Group& g, const int32_t* slots, int kt, int kh,
                              bool far_lead, int kbytes, int vbytes) {
  const int next = kt + kKeyTile, n_next = std::max(0, std::min(int(g.keys), next + kKeyTile) - next);
  const int far = kt + kFarTiles * kKeyTile;
  const int n_far = far_lead ? std::max(0, std::min(int(g.keys), far + kKeyTile) - far) : 0;
  for (int j = far + kh * n_far / g.nkv; j < far + (kh + 1) * n_far / g.nkv; ++j) {
    prefetch_row<2>(kv_ptr<KT>(kv.k, kv.k_stride, slots[j], g.kv_head * L.k_head_off), kbytes);
    if (!L.mla) prefetch_row<2>(kv_ptr<KT>(kv.v, kv.v_stride, slots[j], g.kv_head * L.v_head_off), vbytes);
  }
  for (int j = next + kh * n_next / g.nkv; j < next + (kh + 1) * n_next / g.nkv; ++j) {
    prefetch_row(kv_ptr<KT>(kv.k, kv.k_stride, slots[j], g.kv_head * L.k_head_off), kbytes);
    if (!L.mla) prefetch_row(kv_ptr<KT>(kv.v, kv.v_stride, slots[j], g.kv_head * L.v_head_off), vbytes);
  }
}

// One call's queries (next_call): qb queries that each see nv keys, the first of token t and head h of the
// group, the others the next tokens of that head (by token) or the next heads of that token (by head).
struct QCall {
  int t, h, qb, nv;
  bool by_token;
  int first(int nh) const { return t * nh + h; }        // the first query's index in the group
  int step(int nh) const { return by_token ? nh : 1; }  // from one query's index to the next
};
// The next call over the queries of KV head kh (of a group of nt tokens, hp query heads a KV head) that see
// keys of the tile or chunk at hand (seen[t]: how many token t sees, 0: none), up to kQB queries that see
// the same count; false after the last. By head: one token's query heads of the KV head (cursor a: the
// token, b: the first head); by token: one query head of up to kQB consecutive tokens (a: the head, b: the
// first token). Each key row is loaded once per call, so by token is the fewer loads where a KV head has
// fewer query heads than kQB: MHA's one. On a 2-core Zen 4 VM (one layer of a 1536-token prefill, bf16
// cache, the builds in alternating processes, best of 5 calls) 16 / 16 heads of 128 went from 160 to ~105
// ms (the AVX2 build: ~195 to ~140), of D 192 / Dv 128 (rows widened into tiles) from 255 to ~225, and a
// Q8_0 Llama of 16 / 16 heads of 64 prefilled 2048 tokens ~1.15x faster; 16 / 8 heads of 128 from ~90 to
// ~82 ms. By token measured slower where a call of four queries replaces one of two or three in the AVX2
// build (dots2 instead of dots4: 16 / 8 heads of 64 ~63 -> ~70 ms, SmolLM2's 9 / 3 ~35 -> ~37), and the
// same for 9 / 3 in the AVX-512 one: those keep the calls by head (run_task's by_token). Per query the
// arithmetic is the same either way (dots4, pv_block): the same bits.
CPX_INLINE bool next_call(int& a, int& b, bool by_token, int kh, int hp, int nt, const int* seen, QCall& c) {
  if (!by_token) {
    for (; a < nt; ++a, b = 0) {
      if (seen[a] == 0 || b >= hp) continue;
      c = {a, kh * hp + b, std::min(kQB, hp - b), seen[a], false};
      b += kQB;
      return true;
    }
    return false;
  }
  for (; a < hp; ++a, b = 0) {
    while (b < nt && seen[b] == 0) ++b;
    if (b >= nt) continue;
    int e = b + 1;
    while (e < nt && e - b < kQB && seen[e] == seen[b]) ++e;
    c = {b, kh * hp + a, e - b, seen[b], true};
    b = e;
    return true;
  }
  return false;
}

// One task, for a KV element type KT. st: per-query state m, l then acc[Dv] (stride 2 + Dv);
// buf: room for a key tile and a value tile in fp32 (bf16 caches). DN: the head dim (keys and values)
// where it is a compile-time constant (run_block), 0 where it is L.D / L.Dv at run time.
template <class KT, int DN, int W>
CPX_INLINE void run_task(const PagedKv& kv, const AttnTokens& tok, const Layout& L, const Group& g, int k0, int k1,
                         float scale, const float* q, float* st, float* scores, float* buf) {
  const int D = DN ? DN : L.D, Dv = DN ? DN : L.Dv;
  const int nq = g.nt * g.nh, sw = 2 + Dv;
  for (int i = 0; i < nq; ++i) {
    st[size_t(i) * sw] = -INFINITY;
    st[size_t(i) * sw + 1] = 0.0f;
    std::fill(st + size_t(i) * sw + 2, st + size_t(i) * sw + 2 + Dv, 0.0f);
  }
  const int32_t* slots = g.slots ? g.slots : kv.table + g.row * kv.table_stride;
  const int hp = g.nh / g.nkv;  // query heads per KV head
  const void* vbase = L.mla ? kv.k : kv.v;
  const int64_t vstride = L.mla ? kv.k_stride : kv.v_stride;
  // the bytes of a slot the group reads: its KV heads' keys (values), adjacent within the slot
  const int kbytes = int(((g.nkv - 1) * L.k_head_off + D) * int64_t(sizeof(KT)));
  const int vbytes = int(((g.nkv - 1) * L.v_head_off + Dv) * int64_t(sizeof(KT)));
  // bf16 rows at a fixed head dim: read from the cache in the paired order (Layout::paired), the
  // group's queries permuted into buf; else rows as fp32 (bf16 widened into buf a tile at a time)
  constexpr bool kPaired = std::is_same_v<KT, uint16_t> && DN != 0;
  using RT = std::conditional_t<kPaired, uint16_t, float>;
  if constexpr (kPaired) {
    for (int ti = 0; ti < g.nt; ++ti)
      for (int hi = 0; hi < g.nh; ++hi) {
        const float* src = q + (g.t0 + ti) * L.q_tok + (g.h0 + hi) * L.q_head;
        float* dst = buf + size_t(ti * g.nh + hi) * D;
        for (int d = 0; d < D; d += 2 * W) Lanes<W>::pair(src + d, dst + d);  // dst[paired_at(d, W)] = src[d]
      }
  }
  // Keys come in chunks of NT tiles from k0: each chunk's scores, tile by tile for every head (the rows
  // read in key order, as the prefetches below ask for them), then one softmax update of each query
  // (softmax_chunk), then its values a KV head at a time. Four tiles where the rows are read in place (a
  // fixed head dim), one where bf16 rows are widened into buf. Against a tile at a time (2-core Zen 5 VM,
  // SmolLM2, interleaved rounds): a 1536-token prefill 1.117x, decode after 128 tokens 1.015x / 0.985x,
  // after 1536 0.996x (the decode step's attention is bound by its reads and hand-offs, not this).
  constexpr int NT = DN ? kMaxChunk / kKeyTile : 1;
  constexpr int ls = NT * kKeyTile;  // a query's scores (scores: [nq][ls], then corr [nq])
  float* corr = scores + size_t(nq) * ls;
  const KT* ksrc[kKeyTile];
  const KT* vsrc[kKeyTile];
  const RT* krow[kKeyTile];
  const RT* vrow[ls];
  const float* qv[kQB];
  float* acc[kQB];
  const bool far_lead = L.far_lead && g.nt == 1;  // rows read once a step, mostly cold (see the tile loop)
  // By head or by token (next_call): by token for MHA's one query head a KV head, and with sixteen lanes for
  // two, where that takes fewer calls (a group's tokens are at most kQB).
  const bool by_token = (hp == 1 || (W == 16 && hp == 2)) && g.nt > hp;
  int seen[kMaxTokBlock];  // per token, the keys of the tile (chunk) at hand it sees (see_keys)
  for (int kc = k0; kc < k1; kc += ls) {
    const int nc = std::min(ls, k1 - kc);
    for (int kt = kc; kt < kc + nc; kt += kKeyTile) {
      const int nk = std::min(kKeyTile, kc + nc - kt);
      // The rows come from scattered slots, beyond the hardware prefetcher's reach: the next tile's keys
      // and values are asked for while this one is scored, a share with each KV head's turn (and the
      // first tile's values at the start). A whole tile's requests at once outnumber what the core keeps
      // in flight, and the prefetches then stall it: on a 2-core Zen 3 VM (one decode token of SmolLM2's
      // shape over 1536 keys of a bf16 cache from DRAM, interleaved) spreading them took a layer from
      // ~255 to ~210 us, and SmolLM2 decode after a 1536-token prompt from ~139 to ~150 tokens/s.
      if (kt == k0 && !L.mla)
        for (int j = 0; j < nk; ++j)
          prefetch_row(kv_ptr<KT>(vbase, vstride, slots[kt + j], g.kv_head * L.v_head_off), vbytes);
      see_keys(tok, g, kt, nk, seen);
      for (int kh = 0; kh < g.nkv; ++kh) {
        prefetch_turn<KT>(kv, L, g, slots, kt, kh, far_lead, kbytes, vbytes);
        const int64_t head = g.kv_head + kh;
        for (int j = 0; j < nk; ++j) ksrc[j] = kv_ptr<KT>(kv.k, kv.k_stride, slots[kt + j], head * L.k_head_off);
        if constexpr (kPaired)
          for (int j = 0; j < nk; ++j) krow[j] = ksrc[j];
        else
          tile_rows(ksrc, nk, D, buf, krow);
        for (int j = nk; j < kKeyTile; ++j) krow[j] = krow[0];  // a short tile's spare keys read a real row
        QCall qc;
        for (int a = 0, b = 0; next_call(a, b, by_token, kh, hp, g.nt, seen, qc);) {
          const int qi = qc.first(g.nh), qs = qc.step(g.nh), qb = qc.qb, nv = qc.nv;
          for (int i = 0; i < qb; ++i) {
            const int ti = qc.t + (qc.by_token ? i : 0), hi = qc.h + (qc.by_token ? 0 : i);
            qv[i] = kPaired ? buf + size_t(qi + i * qs) * D : q + (g.t0 + ti) * L.q_tok + (g.h0 + hi) * L.q_head;
          }
          float* s = scores + size_t(qi) * ls + (kt - kc);
          switch (qb) {
            case 4: score_tile<4, W>(qv, krow, nv, D, s, ls * qs); break;
            case 3: score_tile<3, W>(qv, krow, nv, D, s, ls * qs); break;
            case 2: score_tile<2, W>(qv, krow, nv, D, s, ls * qs); break;
            default: score_tile<1, W>(qv, krow, nv, D, s, ls * qs); break;
          }
        }
      }
    }
    // the chunk's softmax update of each query that sees it
    see_keys(tok, g, kc, nc, seen);
    softmax_update(tok, L, g, seen, kc, SoftmaxChunk<W>{scores, st, corr, ls, sw, scale});
    // the values, a KV head at a time
    for (int kh = 0; kh < g.nkv; ++kh) {
      const int64_t head = g.kv_head + kh;
      if (L.mla) {  // the value is the key row's first Dv values: the tile's rows just scored
        if constexpr (NT == 1)  // (MLA has no fixed head dim: one tile a chunk)
          for (int j = 0; j < nc; ++j) vrow[j] = krow[j];
      } else {
        if constexpr (kPaired || std::is_same_v<KT, float>) {
          for (int j = 0; j < nc; ++j)
            vrow[j] = reinterpret_cast<const RT*>(kv_ptr<KT>(vbase, vstride, slots[kc + j], head * L.v_head_off));
        } else {  // bf16 widened (NT = 1)
          for (int j = 0; j < nc; ++j) vsrc[j] = kv_ptr<KT>(vbase, vstride, slots[kc + j], head * L.v_head_off);
          tile_rows(vsrc, nc, Dv, buf + size_t(kKeyTile) * D, vrow);
        }
      }
      QCall qc;
      for (int a = 0, b = 0; next_call(a, b, by_token, kh, hp, g.nt, seen, qc);) {
        const int qi = qc.first(g.nh), qs = qc.step(g.nh), qb = qc.qb, nv = qc.nv;
        bool any = false;
        float c[kQB];
        for (int i = 0; i < qb; ++i) {
          float* sq = st + size_t(qi + i * qs) * sw;
          acc[i] = sq + 2;
          c[i] = corr[qi + i * qs];
          any |= sq[0] != -INFINITY;
        }
        if (!any) continue;
        const float* p = scores + size_t(qi) * ls;
        switch (qb) {
          case 4: pv_block<4, W>(acc, c, p, ls * qs, vrow, nv, Dv); break;
          case 3: pv_block<3, W>(acc, c, p, ls * qs, vrow, nv, Dv); break;
          case 2: pv_block<2, W>(acc, c, p, ls * qs, vrow, nv, Dv); break;
          default: pv_block<1, W>(acc, c, p, ls * qs, vrow, nv, Dv); break;
        }
      }
    }
  }
}

// out[query] = acc / l (0 where the query saw no key, which a causal batch never produces).
CPX_INLINE void write_out(const Layout& L, const Group& g, const float* st, float* out) {
  const int sw = 2 + L.Dv;
  for (int ti = 0; ti < g.nt; ++ti)
    for (int hi = 0; hi < g.nh; ++hi) {
      const float* sq = st + size_t(ti * g.nh + hi) * sw;
      float* o = out + (g.t0 + ti) * L.o_tok + (g.h0 + hi) * L.o_head;
      const float inv = sq[1] > 0.0f ? 1.0f / sq[1] : 0.0f;
      for (int d = 0; d < L.Dv; ++d) o[d] = sq[2 + (L.paired ? paired_at(d, L.lanes) : d)] * inv;
    }
}

// R = R (+) B for nq query states (m, l, acc[Dv]) (attention.cpp: one compiled body for every build).
void merge_state(int nq, int Dv, float* R, const float* B);

// The common GQA head dims, for which run_task is compiled with the dim as a constant (0: another
// dim, or MLA): the dot and value loops unroll whole, without the tails' bookkeeping (2-core Zen 3 VM,
// 9 / 3 heads of 64, one decode token over 1536 keys from cache: 953 -> 809 instructions and 70 -> 64 ns
// a key; SmolLM2 decode after a 1536-token prompt ~7% faster). A bf16 cache is read paired at these.
inline int fixed_head_dim(const Layout& L) {
  return !L.mla && L.D == L.Dv && (L.D == 64 || L.D == 128) ? L.D : 0;
}

// The fixed key blocks of a group: a function of its span alone (Group::span), so of its tokens' aligned
// run of positions, never of the rest of the batch nor of where a prefill chunk or a cached prefix cut
// the request. Each block starts a fresh online softmax; blocks are merged in order. Blocks past a
// token's own position, or past the group's keys, add nothing to it and merge as nothing; every tile
// starts at a multiple of kKeyTile and a token's last one ends at its own position. So a token's result
// has the same bits in any batch: decoded, prefilled whole, or prefilled after any cached prefix or chunk.
// (They used to be cut for the group's key count, the last token's position + 1: a prompt whose cached
// prefix or chunk boundary was not a multiple of the token block grouped its tokens otherwise, and its logits
// moved by up to ~1e-3 with a bf16 cache, enough to change a near-tie's greedy token.)
struct Blocks {
  int n;         // blocks
  int64_t size;  // keys per block, a multiple of kKeyTile (the last block shorter)
};
inline Blocks key_blocks(int64_t keys) {
  const int n = int(std::clamp<int64_t>(keys / kMinSplitKeys, 1, kMaxBlocks));
  const int64_t per = (keys + n - 1) / n;
  return {n, (per + kKeyTile - 1) / kKeyTile * kKeyTile};
}

// Block b of the group's keys into st. (A function, not a lambda: a lambda would not take the
// target attributes of the dispatched variant it is called from, and would run the baseline code.)
// Build::task<KT, DN> is the build's run_task<KT, DN, W>, compiled as a function of its own
// (CPX_ATTN_BUILD): six such functions compile far faster than one that inlines all six, as GCC's data
// flow passes grow faster than the function does (the one function took ~110 s of a core per build).
template <class Build>
CPX_INLINE void run_block(const PagedKv& kv, const AttnTokens& tok, const Layout& L, const Group& g, const Blocks& B,
                          int b, float scale, const float* q, float* st, float* scores, float* buf) {
  const int k0 = int(std::min<int64_t>(g.keys, b * B.size)), k1 = int(std::min<int64_t>(g.keys, (b + 1) * B.size));
  const int dn = fixed_head_dim(L);
  if (kv.type == KvType::BF16) {
    if (dn == 64) Build::template task<uint16_t, 64>(kv, tok, L, g, k0, k1, scale, q, st, scores, buf);
    else if (dn == 128) Build::template task<uint16_t, 128>(kv, tok, L, g, k0, k1, scale, q, st, scores, buf);
    else Build::template task<uint16_t, 0>(kv, tok, L, g, k0, k1, scale, q, st, scores, buf);
  } else {
    if (dn == 64) Build::template task<float, 64>(kv, tok, L, g, k0, k1, scale, q, st, scores, buf);
    else if (dn == 128) Build::template task<float, 128>(kv, tok, L, g, k0, k1, scale, q, st, scores, buf);
    else Build::template task<float, 0>(kv, tok, L, g, k0, k1, scale, q, st, scores, buf);
  }
}

// One task: block `block` of the group into st, or (block < 0) every block in turn merged into st
// (blk: room for one block's states) and out = acc / l.
template <class Build>
CPX_INLINE void task_entry_impl(const PagedKv& kv, const AttnTokens& tok, const Layout& L, const Group& g, int block,
                                float scale, const float* q, float* st, float* blk, float* scores, float* buf,
                                float* out) {
  const Blocks B = key_blocks(g.span);
  if (block >= 0) {
    run_block<Build>(kv, tok, L, g, B, block, scale, q, st, scores, buf);
    return;
  }
  run_block<Build>(kv, tok, L, g, B, 0, scale, q, st, scores, buf);
  for (int b = 1; b < B.n; ++b) {
    run_block<Build>(kv, tok, L, g, B, b, scale, q, blk, scores, buf);
    merge_state(g.nt * g.nh, L.Dv, st, blk);
  }
  write_out(L, g, st, out);
}

// One build of the kernels: NAME (avx512, avx2, base) with target attributes ATTR and W-lane vectors
// defines task_entry_NAME, the CPU's entry point for that build (attention.cpp picks one).
#define CPX_ATTN_TASK_PARAMS                                                                                 \
  (const PagedKv& kv, const AttnTokens& tok, const Layout& L, const Group& g, int block, float scale, const float* q, \
   float* st, float* blk, float* scores, float* buf, float* out)
#define CPX_ATTN_TASK_ARGS (kv, tok, L, g, block, scale, q, st, blk, scores, buf, out)
#define CPX_ATTN_BUILD(NAME, ATTR, W)                                                                          \
  struct Build_##NAME {                                                                                      \
    template <class KT, int DN>                                                                              \
    ATTR __attribute__((noinline)) static void task(const PagedKv& kv, const AttnTokens& tok, const Layout& L, \
                                                    const Group& g, int k0, int k1, float scale, const float* q, \
                                                    float* st, float* scores, float* buf) {                     \
      run_task<KT, DN, W>(kv, tok, L, g, k0, k1, scale, q, st, scores, buf);                                     \
    }                                                                                                        \
  };                                                                                                         \
  ATTR void task_entry_##NAME CPX_ATTN_TASK_PARAMS { task_entry_impl<Build_##NAME> CPX_ATTN_TASK_ARGS; }
void task_entry_avx512 CPX_ATTN_TASK_PARAMS;
// Attention over a bf16 cache with vdpbf16ps (attention_bf16_dot.cpp; Layout::bf16_dot), and the floats
// of per-thread buffer its task needs
void task_entry_bf16_dot CPX_ATTN_TASK_PARAMS;
size_t bf16_dot_buffer(int max_nq, int D, int Dv);
void task_entry_avx2 CPX_ATTN_TASK_PARAMS;
void task_entry_base CPX_ATTN_TASK_PARAMS;

}  // namespace attn
}  // namespace cpx
