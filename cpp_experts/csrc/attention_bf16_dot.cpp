// Attention over a bf16 cache with AVX512_BF16's dot products (vdpbf16ps): the kernels of
// attention_kernels.h's task for MLA's latent rows and for GQA/MHA's K and V rows (attention.cpp
// dispatches here: Layout::bf16_dot).
//
// Why: the fp32 kernels widen bf16 rows into fp32 (MLA: each key tile of 576-value rows, 36 KB a tile,
// more than a Zen 4's L1; GQA: each 16 values a load) and run one fp32 multiply-add per value and query.
// MLA's absorbed form costs 16 heads x (576 + 512) of those per key: a DeepSeek-V2-Lite-shaped
// 2048-token prompt spent 43% of its prefill there, and a decode token over 4096 keys was bound by that
// arithmetic, not its reads. SmolLM2's 4096-token prompt spent 77% of its prefill in GQA attention. Here
// the queries are rounded to bf16 once a task, the rows are read in place, and each vdpbf16ps does two
// values' products a lane: half the instructions of the fp32 multiply-adds, and no widening. The values
// take the same instruction: a chunk's rows are interleaved two keys a 32-bit lane once (for all of the
// queries that share them), and the probabilities are rounded to bf16 pairs, as GPU MLA and flash
// kernels round P before their P·V product. So the result is within bf16 rounding of the fp32 kernels',
// not equal to it (tests/cpp_experts/test_attention.py states the tolerance).
//
// MLA, measured on a 2-core Zen 4 VM (16 heads, r 512 + 64, one layer a call, the fp32 kernel's build and
// this one in alternating processes, two rounds): a 2048-token prefill 463-486 -> 259-260 ms (~280 GFLOP/s,
// 0.63 of vdpbf16ps's peak), 512 tokens 32.0-34.0 -> 19.3-19.5 ms; one decode token over 4096 keys, 12
// layers' caches read in turn, 1135-1186 -> 610-624 us a layer, over 512 scattered keys 180-191 -> 112-114 us.
// GQA, SmolLM2 Q4_1 with a bf16 cache, the builds alternating by process: a 4096-token prompt's prefill
// 1.13x and 1.23x in two runs, the decode after it 1.09x and 1.17x; at 192 tokens within the noise. With
// the softmax's own exp (softmax_chunk_bf16), that prefill 1.22x and its decode 1.14x in a slow spell.
//
// Per query and key the arithmetic is fixed: a query's scores are its dot products in 32-value steps (the
// lanes summed with hsum's association, four or eight keys at once), its values are added a pair of keys
// at a time, the pairs at even offsets of tiles that start at multiples of kKeyTile, and a key past a
// query's last is paired with a zero probability. So, as in attention_kernels.h, a token's result has the
// same bits whatever the batch, its blocking, a cached prefix or a prefill chunk.
#include <cstdlib>

#include "attention_kernels.h"

#if CPX_X86
#include <immintrin.h>
#define CPX_BF16DOT __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512dq,avx512bw,avx512bf16")))
#else
#define CPX_BF16DOT
#endif

namespace cpx {
namespace attn {

#if CPX_X86
namespace {

#define CPX_BF16DOT_INLINE CPX_BF16DOT inline __attribute__((always_inline))

// n <= 32 bf16 values from p, zeros past n (a row's tail: never read past its end)
CPX_BF16DOT_INLINE __m512i load_words(const uint16_t* p, int n) {
  return n >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(__mmask32((1ull << n) - 1), p);
}

CPX_BF16DOT_INLINE __m512 dot(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);  // bit casts (reinterpret_cast went through memory)
}

// Scores of QB queries (bf16 rows of Dp values, zero past D) against keys k[0..NK), NK 4 or 8 (then QB <= 3:
// 24 accumulators), each query's sums reduced at once by hsum4 or hsum8 (the same association: the same
// bits). At a head dim of 64 a (query, key) pair is two vdpbf16ps, and its reduction costs as much again:
// eight keys share the reduction's steps.
template <int QB, int NK>
CPX_BF16DOT_INLINE void dots_bf16(const uint16_t* const* q, const uint16_t* const* k, int D, float* s, int ls) {
  static_assert(NK == 4 || (NK == 8 && QB <= 3), "4 keys, or 8 for up to 3 queries");
  __m512 a[QB][NK];
  for (int i = 0; i < QB; ++i)
    for (int j = 0; j < NK; ++j) a[i][j] = _mm512_setzero_ps();
  for (int d = 0; d < D; d += 32) {
    __m512i qv[QB];
    for (int i = 0; i < QB; ++i) qv[i] = _mm512_loadu_si512(q[i] + d);
    for (int j = 0; j < NK; ++j) {
      const __m512i x = load_words(k[j] + d, D - d);
      for (int i = 0; i < QB; ++i) a[i][j] = dot(a[i][j], qv[i], x);
    }
  }
  for (int i = 0; i < QB; ++i) {
    vec::v16f v[NK];
    for (int j = 0; j < NK; ++j) v[j] = vec::v16f(a[i][j]);
    if constexpr (NK == 8) vec::store(s + i * ls, vec::hsum8(v));
    else Lanes<16>::hsum4(v[0], v[1], v[2], v[3], s + i * ls);
  }
}

// A tile's scores: QB queries against keys krow[0..n), four or (QB <= 3) eight at a time (spare keys up
// to n rounded up to 4 or 8: krow holds a whole tile). DN: the head dim where it is a constant, else D.
template <int QB, int DN>
CPX_BF16DOT __attribute__((noinline)) void score_tile_bf16(const uint16_t* const* q, const uint16_t* const* krow,
                                                          int n, int D, float* s, int ls) {
  if constexpr (DN != 0) D = DN;
  if constexpr (QB <= 3) {
    for (int j = 0; j < n; j += 8) dots_bf16<QB, 8>(q, krow + j, D, s + j, ls);
  } else {
    for (int j = 0; j < n; j += 4) dots_bf16<QB, 4>(q, krow + j, D, s + j, ls);
  }
}

// acc = acc * corr + sum over pairs p of (v[2p] pp[2p] + v[2p+1] pp[2p+1]) for QB queries, C vectors of 16
// values from d: vb holds the pairs' rows interleaved (pair p's value e of both keys in the 32-bit word
// p * Dv + e), pp[i] query i's probabilities as bf16, two keys a 32-bit word.
template <int QB, int C>
CPX_BF16DOT_INLINE void pv_bf16_chunks(float* const* acc, const float* corr, const uint32_t* const* pp,
                                       const uint16_t* vb, int npairs, int Dv, int d) {
  __m512 a[QB][C];
  for (int i = 0; i < QB; ++i)
    for (int c = 0; c < C; ++c) a[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc[i] + d + 16 * c), _mm512_set1_ps(corr[i]));
  for (int p = 0; p < npairs; ++p) {
    __m512i pj[QB];
    for (int i = 0; i < QB; ++i) pj[i] = _mm512_set1_epi32(int(pp[i][p]));
    const uint16_t* row = vb + (size_t(p) * Dv + d) * 2;
    for (int c = 0; c < C; ++c) {
      const __m512i x = _mm512_loadu_si512(row + 32 * c);
      for (int i = 0; i < QB; ++i) a[i][c] = dot(a[i][c], x, pj[i]);
    }
  }
  for (int i = 0; i < QB; ++i)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc[i] + d + 16 * c, a[i][c]);
}

// Not inlined, as score_tile_bf16: inside the task GCC kept the softmax's constants in registers
// across the loops and spilled this loop's broadcasts to the stack (a store and loads per pair).
template <int QB, int DN>
CPX_BF16DOT __attribute__((noinline)) void pv_bf16(float* const* acc, const float* corr, const uint32_t* const* pp,
                                                  const uint16_t* vb, int npairs, int Dv) {
  if constexpr (DN != 0) Dv = DN;
  int d = 0;
  for (; d + 64 <= Dv; d += 64) pv_bf16_chunks<QB, 4>(acc, corr, pp, vb, npairs, Dv, d);
  for (; d < Dv; d += 16) pv_bf16_chunks<QB, 1>(acc, corr, pp, vb, npairs, Dv, d);  // Dv: a multiple of 16
}

// Rows r0, r1 (Dv values each) interleaved into dst: dst[2e] = r0[e], dst[2e + 1] = r1[e].
CPX_BF16DOT_INLINE void interleave_pair(const uint16_t* r0, const uint16_t* r1, int Dv, uint16_t* dst) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                             37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int e = 0; e < Dv; e += 32) {
    const __m512i a = load_words(r0 + e, Dv - e), b = load_words(r1 + e, Dv - e);
    _mm512_storeu_si512(dst + 2 * e, _mm512_permutex2var_epi16(a, lo, b));
    if (e + 16 < Dv) _mm512_storeu_si512(dst + 2 * e + 32, _mm512_permutex2var_epi16(a, hi, b));
  }
}

}  // namespace

// The buffer a task needs (floats): the group's queries as bf16 rows padded to 32 values, a chunk's
// values interleaved, and the queries' probabilities as bf16.
size_t bf16_dot_buffer(int max_nq, int D, int Dv) {
  const size_t Dp = size_t(D + 31) / 32 * 32;
  return (size_t(max_nq) * (Dp + kMaxChunk) + size_t(kMaxChunk) * Dv) / 2 + 64;
}

namespace {

constexpr int ls = kMaxChunk;  // a query's scores a chunk (scores: [nq][ls], then corr [nq])

// A task's start: the group's query states reset, its queries rounded to bf16 rows of Dp values (zero
// past D) into qb, and the buffer's other two parts: vb, a chunk's value rows interleaved ([ls / 2][Dv][2]),
// and pb, the queries' probabilities as bf16 ([nq][ls]).
struct TaskBuf {
  uint16_t *qb, *vb, *pb;
};
CPX_BF16DOT_INLINE TaskBuf begin_task(const Layout& L, const Group& g, int D, int Dv, int Dp, const float* q,
                                      float* st, float* buf) {
  const int nq = g.nt * g.nh, sw = 2 + Dv;
  for (int i = 0; i < nq; ++i) {
    st[size_t(i) * sw] = -INFINITY;
    st[size_t(i) * sw + 1] = 0.0f;
    std::fill(st + size_t(i) * sw + 2, st + size_t(i) * sw + 2 + Dv, 0.0f);
  }
  TaskBuf b;
  b.qb = reinterpret_cast<uint16_t*>(buf);
  b.vb = b.qb + size_t(nq) * Dp;
  b.pb = b.vb + size_t(ls) * Dv;
  for (int ti = 0; ti < g.nt; ++ti)
    for (int hi = 0; hi < g.nh; ++hi) {
      const float* src = q + (g.t0 + ti) * L.q_tok + (g.h0 + hi) * L.q_head;
      uint16_t* dst = b.qb + size_t(ti * g.nh + hi) * Dp;
      for (int d = 0; d < Dp; d += 32) {
        const int a = std::clamp(D - d, 0, 16), c = std::clamp(D - d - 16, 0, 16);
        const __m512 x0 = _mm512_maskz_loadu_ps(__mmask16((1u << a) - 1), src + d);
        const __m512 x1 = _mm512_maskz_loadu_ps(__mmask16((1u << c) - 1), src + d + 16);
        _mm512_storeu_si512(dst + d, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(x1, x0)));
      }
    }
  return b;
}

// exp(x) for x <= 0 (a score less the running max): 2^n p(f), x log2(e) = n + f with |f| <= 1/2, p the
// degree-5 Taylor polynomial of 2^f (relative error ~2e-6: the probabilities are rounded to bf16, 4e-3,
// next), and 2^n by vscalefps. About a third of softmax_chunk's exp's instructions (its clamps, its two-part
// range reduction and its integer exponent), where a 4096-token SmolLM2 prefill spent ~35% of this
// kernel's own (non-dot) samples. Arguments below -125 / log2(e) give 2^-125-ish, as the clamp before
// them: never a denormal.
CPX_BF16DOT_INLINE __m512 exp_nonpos(__m512 x) {
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(-125.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// softmax_chunk (attention_kernels.h) for this kernel: the online-softmax update of one query's state sq
// (m, l, acc) for a chunk's nv scores sc (scaled in place, then turned into exp(s - m)), its correction
// corr, each tile's (m, sum) and e into a dump (ds, de) as softmax_chunk writes them, and the probabilities
// rounded to bf16 into pb[0..kMaxChunk), zero past nv (an odd nv's pair partner). softmax_chunk's steps,
// with exp_nonpos for the exp, each tile's sum by one vector reduction (a fixed order per tile, whatever
// the batch), and the rounding done as each pair of tiles is made.
CPX_BF16DOT_INLINE void softmax_chunk_bf16(float* sc, int nv, float scale, float* sq, float& corr, float* de,
                                           float* ds, uint16_t* pb) {
  const int tiles = (nv + kKeyTile - 1) / kKeyTile;
  auto mask = [&](int j) { return __mmask16(nv - j >= 16 ? 0xFFFF : nv - j <= 0 ? 0 : (1u << (nv - j)) - 1); };
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int t = 0; t < tiles; ++t) {
    const int j = t * kKeyTile;
    const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask(j), sc + j), _mm512_set1_ps(scale));
    _mm512_storeu_ps(sc + j, x);
    m = _mm512_mask_max_ps(m, mask(j), m, x);
  }
  const float mx = std::max(sq[0], _mm512_reduce_max_ps(m));
  if (mx == -INFINITY) {  // every score -inf (a -inf query): it adds nothing
    corr = 1.0f;
    std::fill(sc, sc + nv, 0.0f);
    std::fill(pb, pb + kMaxChunk, uint16_t(0));
    if (de) {
      std::fill(de, de + nv, 0.0f);
      for (int t = 0; t < tiles; ++t) ds[2 * t] = mx, ds[2 * t + 1] = 0.0f;
    }
    return;
  }
  corr = sq[0] == mx ? 1.0f : sq[0] == -INFINITY ? 0.0f : vec::exp1(sq[0] - mx);
  float sum = 0.0f;
  __m512 prev = _mm512_setzero_ps();
  for (int t = 0; t < kMaxChunk / kKeyTile; ++t) {
    const int j = t * kKeyTile;
    __m512 e = _mm512_setzero_ps();
    if (t < tiles) {
      e = _mm512_maskz_mov_ps(mask(j), exp_nonpos(_mm512_sub_ps(_mm512_loadu_ps(sc + j), _mm512_set1_ps(mx))));
      _mm512_storeu_ps(sc + j, e);
      const float ts = _mm512_reduce_add_ps(e);
      if (de) ds[2 * t] = mx, ds[2 * t + 1] = ts;
      sum += ts;
    }
    if (t & 1) _mm512_storeu_si512(pb + j - kKeyTile, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e, prev)));
    prev = e;
  }
  sq[0] = mx;
  sq[1] = sq[1] * corr + sum;
  if (de) std::copy(sc, sc + nv, de);  // AttnTokens::dump
}

// softmax_chunk_bf16 on query qi, its probabilities into pb [qi][ls], for softmax_update. (Not always
// inlined: softmax_update has no target of its own, and GCC refuses an AVX-512 always-inline callee there.)
struct SoftmaxChunkBf16 {
  float *scores, *st, *corr;
  int sw;
  float scale;
  uint16_t* pb;
  CPX_BF16DOT void operator()(int qi, int nv, float* de, float* ds) const {
    softmax_chunk_bf16(scores + size_t(qi) * ls, nv, scale, st + size_t(qi) * sw, corr[qi], de, ds,
                       pb + size_t(qi) * ls);
  }
};

template <int DN>
CPX_BF16DOT_INLINE void score_call(int qb, const uint16_t* const* qv, const uint16_t* const* krow, int nv, int D,
                                   float* s, int lss) {
  switch (qb) {
    case 4: score_tile_bf16<4, DN>(qv, krow, nv, D, s, lss); break;
    case 3: score_tile_bf16<3, DN>(qv, krow, nv, D, s, lss); break;
    case 2: score_tile_bf16<2, DN>(qv, krow, nv, D, s, lss); break;
    default: score_tile_bf16<1, DN>(qv, krow, nv, D, s, lss); break;
  }
}

template <int DN>
CPX_BF16DOT_INLINE void pv_call(int qb, float* const* acc, const float* c, const uint32_t* const* pp,
                                const uint16_t* vb, int np, int Dv) {
  switch (qb) {
    case 4: pv_bf16<4, DN>(acc, c, pp, vb, np, Dv); break;
    case 3: pv_bf16<3, DN>(acc, c, pp, vb, np, Dv); break;
    case 2: pv_bf16<2, DN>(acc, c, pp, vb, np, Dv); break;
    default: pv_bf16<1, DN>(acc, c, pp, vb, np, Dv); break;
  }
}

// The values of a QB-query call (queries qi, qi + qs, ...) that sees nv keys of the chunk in vb.
template <int DN>
CPX_BF16DOT_INLINE void values_call(int qi, int qs, int qb, int nv, int Dv, float* st, int sw, const float* corr,
                                    const uint16_t* pb, const uint16_t* vb) {
  float* acc[kQB];
  const uint32_t* pp[kQB];
  float c[kQB];
  bool any = false;
  for (int i = 0; i < qb; ++i) {
    float* sq = st + size_t(qi + i * qs) * sw;
    acc[i] = sq + 2;
    c[i] = corr[qi + i * qs];
    pp[i] = reinterpret_cast<const uint32_t*>(pb + size_t(qi + i * qs) * ls);
    any |= sq[0] != -INFINITY;
  }
  if (any) pv_call<DN>(qb, acc, c, pp, vb, (nv + 1) / 2, Dv);
}

// A chunk's nc value rows, pairs of keys interleaved into vb (a last odd key with its own row again,
// under a zero probability).
template <class Row>
CPX_BF16DOT_INLINE void interleave_chunk(const Row& row, int nc, int Dv, uint16_t* vb) {
  for (int p = 0; p < (nc + 1) / 2; ++p)
    interleave_pair(row(2 * p), 2 * p + 1 < nc ? row(2 * p + 1) : row(2 * p), Dv, vb + size_t(p) * Dv * 2);
}

// One task: run_task's walk (its KV heads in turn, the calls of next_call, four key tiles a chunk, the same
// prefetches), with the scores and the values on vdpbf16ps. MLA is one KV head whose value rows are its key
// rows' first Dv values. DN: the head dim (D == Dv) where it is a constant (fixed_head_dim), else 0.
template <int DN>
CPX_BF16DOT void run_bf16(const PagedKv& kv, const AttnTokens& tok, const Layout& L, const Group& g, int k0,
                              int k1, float scale, const float* q, float* st, float* scores, float* buf) {
  const int D = DN ? DN : L.D, Dv = DN ? DN : L.Dv, Dp = (D + 31) / 32 * 32;
  const int nq = g.nt * g.nh, sw = 2 + Dv;
  const TaskBuf b = begin_task(L, g, D, Dv, Dp, q, st, buf);
  const int32_t* slots = g.slots ? g.slots : kv.table + g.row * kv.table_stride;
  const int hp = g.nh / g.nkv;  // query heads per KV head
  float* corr = scores + size_t(nq) * ls;
  const int kbytes = int(((g.nkv - 1) * L.k_head_off + D) * 2);  // a slot's rows of the group's KV heads
  const int vbytes = L.mla ? 0 : int(((g.nkv - 1) * L.v_head_off + Dv) * 2);
  const bool far_lead = L.far_lead && g.nt == 1;
  const bool by_token = hp <= 2 && g.nt > hp;  // as run_task's with sixteen lanes
  const uint16_t* krow[kKeyTile];
  const uint16_t* qv[kQB];
  int seen[kMaxTokBlock];
  const void* vbase = L.mla ? kv.k : kv.v;  // MLA: the latent rows (v_head_off 0)
  const int64_t vstride = L.mla ? kv.k_stride : kv.v_stride;
  auto krow_at = [&](int j, int64_t head) { return kv_ptr<uint16_t>(kv.k, kv.k_stride, slots[j], head * L.k_head_off); };
  auto vrow_at = [&](int j, int64_t head) { return kv_ptr<uint16_t>(vbase, vstride, slots[j], head * L.v_head_off); };
  for (int kc = k0; kc < k1; kc += ls) {
    const int nc = std::min(ls, k1 - kc);
    for (int kt = kc; kt < kc + nc; kt += kKeyTile) {
      const int nk = std::min(kKeyTile, kc + nc - kt);
      // run_task's prefetches: the first tile's values at the start, then each KV head's share of the leads
      if (kt == k0 && !L.mla)
        for (int j = 0; j < nk; ++j) prefetch_row(vrow_at(kt + j, g.kv_head), vbytes);
      see_keys(tok, g, kt, nk, seen);
      for (int kh = 0; kh < g.nkv; ++kh) {
        prefetch_turn<uint16_t>(kv, L, g, slots, kt, kh, far_lead, kbytes, vbytes);
        const int64_t head = g.kv_head + kh;
        for (int j = 0; j < nk; ++j) krow[j] = krow_at(kt + j, head);
        for (int j = nk; j < kKeyTile; ++j) krow[j] = krow[0];  // a short tile's spare keys read a real row
        QCall qc;
        for (int a = 0, c = 0; next_call(a, c, by_token, kh, hp, g.nt, seen, qc);) {
          const int qi = qc.first(g.nh), qs = qc.step(g.nh);
          for (int i = 0; i < qc.qb; ++i) qv[i] = b.qb + size_t(qi + i * qs) * Dp;
          score_call<DN>(qc.qb, qv, krow, qc.nv, D, scores + size_t(qi) * ls + (kt - kc), ls * qs);
        }
      }
    }
    see_keys(tok, g, kc, nc, seen);
    softmax_update(tok, L, g, seen, kc, SoftmaxChunkBf16{scores, st, corr, sw, scale, b.pb});
    // the values, a KV head at a time: its chunk's rows interleaved once for the calls that read them
    for (int kh = 0; kh < g.nkv; ++kh) {
      const int64_t head = g.kv_head + kh;
      interleave_chunk([&](int j) { return vrow_at(kc + j, head); }, nc, Dv, b.vb);
      QCall qc;
      for (int a = 0, c = 0; next_call(a, c, by_token, kh, hp, g.nt, seen, qc);)
        values_call<DN>(qc.first(g.nh), qc.step(g.nh), qc.qb, qc.nv, Dv, st, sw, corr, b.pb, b.vb);
    }
  }
}

struct Build_avx512bf16 {
  template <class KT, int DN>
  __attribute__((noinline)) static void task(const PagedKv& kv, const AttnTokens& tok, const Layout& L, const Group& g,
                                             int k0, int k1, float scale, const float* q, float* st, float* scores,
                                             float* buf) {
    if constexpr (std::is_same_v<KT, uint16_t>) {
      run_bf16<DN>(kv, tok, L, g, k0, k1, scale, q, st, scores, buf);
    } else {  // attention.cpp sends bf16 caches here, nothing else
      std::abort();
    }
  }
};

}  // namespace

CPX_BF16DOT void task_entry_bf16_dot CPX_ATTN_TASK_PARAMS { task_entry_impl<Build_avx512bf16> CPX_ATTN_TASK_ARGS; }

#else  // no x86: never called (Layout::bf16_dot is false)
size_t bf16_dot_buffer(int, int, int) { return 0; }
void task_entry_bf16_dot CPX_ATTN_TASK_PARAMS { std::abort(); }
#endif

}  // namespace attn
}  // namespace cpx
