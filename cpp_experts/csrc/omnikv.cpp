// OmniKV's token selection (omnikv.h): the window, importance on the pool, the top-k per token.
//
// Passes over one chunk of omni tokens, each on the pool:
//   1. (token, key block): every window query's scores against the block's keys, kept in `scores_`,
//      and per (query, head) the block's softmax state: m = max score, l = sum exp(s - m); the scores
//      become exp(s - m) in place.
//   2. (token): the blocks' states merged in block order: M, L, and per block the factor
//      exp(m_b - M) / L that turns its exp(s - m_b) into probabilities.
//   3. (token, key block): importance(j) = sum_i alpha_i · max_h P_ih(j) for the block's keys.
//   4. (token): sinks + recent + top k of the middle, as slots.
#include "omnikv.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common.h"
#include "vec.h"

namespace cpx {
namespace {

constexpr int64_t kMinBlockKeys = 64;  // keys per block at least (a short context: one block)
constexpr int64_t kMaxKeyBlocks = 32;  // blocks per token at most: one token alone still fills the pool
constexpr size_t kScoreBudget = size_t(1) << 25;  // score floats per chunk of tokens (128 MiB; one token may exceed it)

// The key blocks of a context of n keys: a function of n alone.
void key_blocks(OmniItem& it) {
  const int64_t want = std::clamp<int64_t>(it.n / kMinBlockKeys, 1, kMaxKeyBlocks);
  it.bs = ((it.n + want - 1) / want + 15) / 16 * 16;
  it.nb = int((it.n + it.bs - 1) / it.bs);
}

// alpha_i of the i-th (0-based, oldest first) of `present` window queries (OmniKVConfig.alpha_weights).
float alpha_weight(Alpha mode, int i, int present) {
  switch (mode) {
    case Alpha::LastToken: return i == present - 1 ? 1.0f : 0.0f;
    case Alpha::Uniform: return 1.0f;
    default: return std::ldexp(1.0f, i + 1 - present);
  }
}

// Pass 1 for one key block, keys of type KT. S: the token's scores [nw][H][n]; st: its block states
// [nb][nw][H][2]; buf: D floats (a bf16 key row widened).
template <class KT>
CPX_INLINE void score_block_t(const PagedKv& kv, const OmniItem& it, int b, int H, int Hkv, int D, float scale,
                              float* S, float* st, float* buf) {
  using namespace vec;
  const int64_t n = it.n, j0 = b * it.bs, j1 = std::min(n, j0 + it.bs);
  const int G = H / Hkv;
  const int32_t* slots = kv.table + it.row * kv.table_stride;
  for (int64_t j = j0; j < j1; ++j) {
    const KT* base = static_cast<const KT*>(kv.k) + int64_t(slots[j]) * kv.k_stride;
    for (int g = 0; g < Hkv; ++g) {
      const KT* src = base + size_t(g) * D;
      const float* key;
      if constexpr (std::is_same_v<KT, float>) {
        key = src;
      } else {
        int d = 0;
        for (; d + 8 <= D; d += 8) store(buf + d, load(src + d));
        for (; d < D; ++d) buf[d] = scalar(src[d]);
        key = buf;
      }
      for (int i = 0; i < it.nw; ++i) {
        if (j > it.qpos[i]) continue;  // an older query did not see this key
        for (int h = g * G; h < (g + 1) * G; ++h)
          S[(size_t(i) * H + h) * n + j] = dot(it.q[i] + size_t(h) * D, key, D) * scale;
      }
    }
  }
  for (int i = 0; i < it.nw; ++i) {
    const int64_t e = std::min(j1, it.qpos[i] + 1);
    for (int h = 0; h < H; ++h) {
      float* sb = st + ((size_t(b) * it.nw + i) * H + h) * 2;
      float* s = S + (size_t(i) * H + h) * n;
      float m = -INFINITY;
      for (int64_t j = j0; j < e; ++j) m = std::max(m, s[j]);
      sb[0] = m;
      sb[1] = 0.0f;
      if (m == -INFINITY) continue;  // no key here for this query (or every score -inf): adds nothing
      float sum = 0.0f;
      int64_t j = j0;
      for (; j + 8 <= e; j += 8) {
        const v8f p = exp8(load(s + j) - splat(m));
        store(s + j, p);
        sum += hsum(p);
      }
      for (; j < e; ++j) sum += s[j] = exp1(s[j] - m);
      sb[1] = sum;
    }
  }
}

CPX_INLINE void score_block_impl(const PagedKv& kv, const OmniItem& it, int b, int H, int Hkv, int D, float scale,
                                 float* S, float* st, float* buf) {
  if (kv.type == KvType::BF16)
    score_block_t<uint16_t>(kv, it, b, H, Hkv, D, scale, S, st, buf);
  else
    score_block_t<float>(kv, it, b, H, Hkv, D, scale, S, st, buf);
}
CPX_DISPATCH(void, score_block,
             (const PagedKv& kv, const OmniItem& it, int b, int H, int Hkv, int D, float scale, float* S, float* st,
              float* buf),
             (kv, it, b, H, Hkv, D, scale, S, st, buf))

// count softmax states (m, l) at st, st + stride, ... (a query's key blocks, or a dump's tiles): with
// M = max m and L = sum l exp(m - M) over those that added something (l > 0), in order, each m becomes
// its factor exp(m - M) / L (0 where the state added nothing), which turns its exp(s - m) into
// probabilities.
CPX_INLINE void softmax_factors(float* st, int64_t count, size_t stride) {
  float M = -INFINITY;
  for (int64_t i = 0; i < count; ++i)
    if (st[i * stride + 1] > 0.0f) M = std::max(M, st[i * stride]);
  float L = 0.0f;
  for (int64_t i = 0; i < count; ++i) {
    float* s = st + i * stride;
    s[0] = s[1] > 0.0f ? vec::exp1(s[0] - M) : 0.0f;
    L += s[1] * s[0];
  }
  const float inv = L > 0.0f ? 1.0f / L : 0.0f;
  for (int64_t i = 0; i < count; ++i) st[i * stride] *= inv;
}

// Pass 2 for one token: the key blocks' states of each (query, head) into factors.
CPX_INLINE void merge_blocks_impl(const OmniItem& it, int H, float* st) {
  for (int q = 0; q < it.nw * H; ++q) softmax_factors(st + size_t(q) * 2, it.nb, size_t(it.nw) * H * 2);
}
CPX_DISPATCH(void, merge_blocks, (const OmniItem& it, int H, float* st), (it, H, st))

// Pass 3 for one key block: importance(j) = sum_i alpha_i · max_h exp(s - m_b) · factor.
CPX_INLINE void importance_block_impl(const OmniItem& it, int b, int H, const float* S, const float* st, float* imp) {
  using namespace vec;
  const int64_t n = it.n, j0 = b * it.bs, j1 = std::min(n, j0 + it.bs);
  std::fill(imp + j0, imp + j1, 0.0f);
  for (int i = 0; i < it.nw; ++i) {
    const int64_t e = std::min(j1, it.qpos[i] + 1);
    const float a = it.alpha[i];
    const float* c = st + (size_t(b) * it.nw + i) * H * 2;  // factor of head h at c[2h]
    const float* s = S + size_t(i) * H * n;
    int64_t j = j0;
    for (; j + 8 <= e; j += 8) {
      v8f mx = splat(0.0f);
      for (int h = 0; h < H; ++h) {
        const v8f p = load(s + size_t(h) * n + j) * splat(c[2 * h]);
        mx = p > mx ? p : mx;
      }
      store(imp + j, load(imp + j) + splat(a) * mx);
    }
    for (; j < e; ++j) {
      float mx = 0.0f;
      for (int h = 0; h < H; ++h) mx = std::max(mx, s[size_t(h) * n + j] * c[2 * h]);
      imp[j] += a * mx;
    }
  }
}
CPX_DISPATCH(void, importance_block, (const OmniItem& it, int b, int H, const float* S, const float* st, float* imp),
             (it, b, H, S, st, imp))

// From an attention dump (AttnTokens::dump) instead of passes 1-3, for a token whose window is its
// current query alone: each head's tile states into factors, as pass 2 does for key blocks.
CPX_INLINE void dump_factors_impl(const OmniItem& it, int H, float* dump) {
  const int64_t tiles = (it.n + kAttnDumpTile - 1) / kAttnDumpTile;
  for (int h = 0; h < H; ++h) softmax_factors(dump + size_t(H) * it.n + size_t(h) * tiles * 2, tiles, 2);
}
CPX_DISPATCH(void, dump_factors, (const OmniItem& it, int H, float* dump), (it, H, dump))

// importance(j) = alpha · max_h e_hj · factor_h,tile(j) for one key block (a multiple of the tile).
CPX_INLINE void dump_importance_block_impl(const OmniItem& it, int b, int H, const float* dump, float* imp) {
  using namespace vec;
  static_assert(kAttnDumpTile % 8 == 0, "8 keys at a time stay within a tile");
  const int64_t n = it.n, j0 = b * it.bs, j1 = std::min(n, j0 + it.bs), tiles = (n + kAttnDumpTile - 1) / kAttnDumpTile;
  const float a = it.alpha[0];
  const float* f = dump + size_t(H) * n;  // factor of head h, tile i at f[(h * tiles + i) * 2]
  int64_t j = j0;
  for (; j + 8 <= j1; j += 8) {
    v8f mx = splat(0.0f);
    for (int h = 0; h < H; ++h) {
      const v8f p = load(dump + size_t(h) * n + j) * splat(f[(size_t(h) * tiles + j / kAttnDumpTile) * 2]);
      mx = p > mx ? p : mx;
    }
    store(imp + j, splat(a) * mx);
  }
  for (; j < j1; ++j) {
    float mx = 0.0f;
    for (int h = 0; h < H; ++h) mx = std::max(mx, dump[size_t(h) * n + j] * f[(size_t(h) * tiles + j / kAttnDumpTile) * 2]);
    imp[j] = a * mx;
  }
}
CPX_DISPATCH(void, dump_importance_block, (const OmniItem& it, int b, int H, const float* dump, float* imp),
             (it, b, H, dump, imp))

}  // namespace

void OmniRun::begin(const OmniSpec* spec, int T, const int64_t* omni_k, const int64_t* rows, const int64_t* pos) {
  spec_ = spec;
  filters_ = spec->num_filters;
  T_ = T;
  tok_.clear();
  k_.clear();
  row_.clear();
  pos_.clear();
  for (int t = 0; t < T; ++t)
    if (omni_k[t] >= 0) {
      tok_.push_back(t);
      k_.push_back(omni_k[t]);
      row_.push_back(rows[t]);
      pos_.push_back(pos[t]);
    }
  sel_.resize(size_t(spec->num_filters) * tok_.size());
  for (auto& s : sel_) s.clear();
  sel_ptr_.resize(size_t(spec->num_filters));
  sel_n_.resize(size_t(spec->num_filters));
  for (auto& p : sel_ptr_) p.clear();
  selected_ = context_ = 0;
  dump_layer_ = -1;
}

void OmniRun::attach(int layer, AttnTokens& tok, int H) {
  const int role = spec_->roles[size_t(layer)];
  if (role == kRoleFilter) {
    dump_layer_ = -1;
    // the window is the current query alone: W = 1 (no history), or every older query weighs 0
    if (spec_->hist_q && spec_->alpha != Alpha::LastToken) return;
    size_t need = 0;
    dump_off_.resize(tok_.size());
    for (size_t u = 0; u < tok_.size(); ++u) {
      dump_off_[u] = need;
      need += attn_dump_floats(H, pos_[u] + 1);
    }
    if (need > kMaxDumpFloats) return;  // scored as a window instead (in chunks of bounded memory)
    if (dump_.size() < need) dump_.resize(need);
    dump_ptr_.assign(size_t(T_), nullptr);
    for (size_t u = 0; u < tok_.size(); ++u) dump_ptr_[size_t(tok_[u])] = dump_.data() + dump_off_[u];
    tok.dump = dump_ptr_.data();
    dump_layer_ = layer;
    dump_H_ = H;
    return;
  }
  if (role != kRoleSparse) return;
  const int f = spec_->source[size_t(layer)];
  if (int(sel_ptr_[size_t(f)].size()) != T_)  // set_omnikv orders every filter before its sparse layers
    throw std::logic_error("OmniKV: layer " + std::to_string(layer) + " reads a selection its filter never made");
  tok.sel = sel_ptr_[size_t(f)].data();
  tok.sel_n = sel_n_[size_t(f)].data();
}

void OmniRun::select(Pool& pool, int layer, const PagedKv& kv, const float* q, int H, int Hkv, int D, float scale) {
  const OmniSpec& sp = *spec_;
  const int f = sp.filter_of[size_t(layer)];
  const int N = int(tok_.size());
  const int W = sp.hist_q ? sp.window : 1;
  const size_t qsize = size_t(H) * D;
  // the window of each token: its query recorded first, then the row's entries of pos-W+1..pos
  items_.resize(size_t(N));
  for (int u = 0; u < N; ++u) {
    OmniItem& it = items_[size_t(u)];
    it.t = tok_[size_t(u)];
    it.u = u;
    it.row = row_[size_t(u)];
    it.pos = pos_[size_t(u)];
    it.n = it.pos + 1;
    it.k = k_[size_t(u)];
    const float* cur = q + size_t(it.t) * qsize;
    const float* wq[kMaxOmniWindow];
    int64_t wp[kMaxOmniWindow];
    int present = 0;
    if (sp.hist_q) {
      const size_t base = (size_t(it.row) * sp.num_filters + size_t(f)) * size_t(W);
      const size_t e = base + size_t(it.pos % W);
      std::memcpy(sp.hist_q + e * qsize, cur, qsize * sizeof(float));
      sp.hist_pos[e] = it.pos;
      for (int64_t p = std::max<int64_t>(0, it.pos - W + 1); p <= it.pos; ++p) {
        const size_t ep = base + size_t(p % W);
        if (sp.hist_pos[ep] != p) continue;
        wq[present] = sp.hist_q + ep * qsize;
        wp[present++] = p;
      }
    } else {
      wq[0] = cur;
      wp[0] = it.pos;
      present = 1;
    }
    it.nw = 0;
    for (int i = 0; i < present; ++i) {
      const float a = alpha_weight(sp.alpha, i, present);
      if (a == 0.0f) continue;  // adds nothing: not scored
      it.q[it.nw] = wq[i];
      it.qpos[it.nw] = wp[i];
      it.alpha[it.nw++] = a;
    }
    key_blocks(it);
  }
  const int threads = pool.size();
  thread_f_.resize(size_t(threads));
  thread_i_.resize(size_t(threads));
  for (auto& b : thread_f_) b.resize(size_t(D));
  const int32_t* table = kv.table;
  const int64_t stride = kv.table_stride;
  // the selection of one token from its importance (imp_ at its imp_off): sinks, recent, top k between
  auto choose = [&](const OmniItem& it, int tid) {
    const int64_t n = it.n, lo = std::min(sp.sink, n), hi = std::max(lo, n - sp.recent);
    const int32_t* slots = table + it.row * stride;
    std::vector<int32_t>& out = sel_[size_t(f) * N + size_t(it.u)];
    out.clear();
    if (it.k >= hi - lo) {  // the whole context
      out.assign(slots, slots + n);
      return;
    }
    const float* im = imp_.data() + it.imp_off;
    // a strict order (NaN ranks last): score descending, then position ascending
    auto key = [im](int32_t p) { return std::isnan(im[p]) ? -INFINITY : im[p]; };
    auto before = [&key](int32_t a, int32_t b) {
      const float ka = key(a), kb = key(b);
      return ka > kb || (ka == kb && a < b);
    };
    std::vector<int32_t>& cand = thread_i_[size_t(tid)];
    cand.resize(size_t(hi - lo));
    std::iota(cand.begin(), cand.end(), int32_t(lo));
    std::nth_element(cand.begin(), cand.begin() + it.k, cand.end(), before);
    std::sort(cand.begin(), cand.begin() + it.k);
    out.reserve(size_t(lo + it.k + n - hi));
    out.insert(out.end(), slots, slots + lo);
    for (int64_t i2 = 0; i2 < it.k; ++i2) out.push_back(slots[cand[size_t(i2)]]);
    out.insert(out.end(), slots + hi, slots + n);
  };
  std::vector<std::pair<int, int>> tasks;
  // the filter layer's attention dumped its probabilities (attach): importance from them
  bool dumped = dump_layer_ == layer && dump_H_ == H;
  dump_layer_ = -1;  // a dump serves its own layer once
  for (const OmniItem& it : items_) dumped = dumped && it.nw == 1 && it.qpos[0] == it.pos;
  if (dumped) {
    size_t nimp = 0;
    for (OmniItem& it : items_) {
      it.imp_off = nimp;
      nimp += size_t(it.n);
    }
    if (imp_.size() < nimp) imp_.resize(nimp);
    for (int u = 0; u < N; ++u)
      for (int b = 0; b < items_[size_t(u)].nb; ++b) tasks.push_back({u, b});
    pool.run(N, [&](int u, int) { dump_factors(items_[size_t(u)], H, dump_.data() + dump_off_[size_t(u)]); });
    pool.run(int(tasks.size()), [&](int i, int) {
      const int u = tasks[size_t(i)].first;
      const OmniItem& it = items_[size_t(u)];
      dump_importance_block(it, tasks[size_t(i)].second, H, dump_.data() + dump_off_[size_t(u)],
                            imp_.data() + it.imp_off);
    });
    pool.run(N, [&](int u, int tid) { choose(items_[size_t(u)], tid); });
  }
  for (int c0 = 0; c0 < N && !dumped;) {
    // a chunk of tokens whose scores fit the budget (at least one token)
    size_t ns = 0, nst = 0, nimp = 0;
    int c1 = c0;
    for (; c1 < N; ++c1) {
      OmniItem& it = items_[size_t(c1)];
      const size_t need = size_t(it.nw) * H * size_t(it.n);
      if (c1 > c0 && ns + need > kScoreBudget) break;
      it.s_off = ns;
      it.st_off = nst;
      it.imp_off = nimp;
      ns += need;
      nst += size_t(it.nb) * it.nw * H * 2;
      nimp += size_t(it.n);
    }
    if (scores_.size() < ns) scores_.resize(ns);
    if (states_.size() < nst) states_.resize(nst);
    if (imp_.size() < nimp) imp_.resize(nimp);
    tasks.clear();
    for (int u = c0; u < c1; ++u)
      for (int b = 0; b < items_[size_t(u)].nb; ++b) tasks.push_back({u, b});
    float* S = scores_.data();
    float* st = states_.data();
    float* imp = imp_.data();
    pool.run(int(tasks.size()), [&](int i, int tid) {
      const OmniItem& it = items_[size_t(tasks[size_t(i)].first)];
      score_block(kv, it, tasks[size_t(i)].second, H, Hkv, D, scale, S + it.s_off, st + it.st_off,
                  thread_f_[size_t(tid)].data());
    });
    pool.run(c1 - c0, [&](int i, int) {
      const OmniItem& it = items_[size_t(c0 + i)];
      merge_blocks(it, H, st + it.st_off);
    });
    pool.run(int(tasks.size()), [&](int i, int) {
      const OmniItem& it = items_[size_t(tasks[size_t(i)].first)];
      importance_block(it, tasks[size_t(i)].second, H, S + it.s_off, st + it.st_off, imp + it.imp_off);
    });
    pool.run(c1 - c0, [&](int i, int tid) { choose(items_[size_t(c0 + i)], tid); });
    c0 = c1;
  }
  // the lists the sparse layers below read, and the counts (as OmniKVBatch.observe counts them)
  std::vector<const int32_t*>& ptr = sel_ptr_[size_t(f)];
  std::vector<int64_t>& cnt = sel_n_[size_t(f)];
  ptr.assign(size_t(T_), nullptr);
  cnt.assign(size_t(T_), 0);
  for (int u = 0; u < N; ++u) {
    const std::vector<int32_t>& s = sel_[size_t(f) * N + size_t(u)];
    ptr[size_t(tok_[size_t(u)])] = s.data();
    cnt[size_t(tok_[size_t(u)])] = int64_t(s.size());
    selected_ += int64_t(s.size());
    context_ += items_[size_t(u)].n;
  }
}

std::vector<std::vector<int32_t>> OmniRun::selection(int f) const {
  if (f < 0 || f >= filters_) throw ArgError("no such OmniKV filter selection");
  const size_t N = tok_.size();
  return std::vector<std::vector<int32_t>>(sel_.begin() + f * N, sel_.begin() + (f + 1) * N);
}

}  // namespace cpx
