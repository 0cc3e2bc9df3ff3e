// CpuModel (model.h): the blocks of a decoder and one forward over a batch.
//
// Each block reads the residual stream x [T][hidden], normalises it into xn, and adds its output to x
// (the last linear of a block stores with Epilogue::Add). Row-wise work (norms, RoPE, KV stores) is
// spread over the pool by rows when the batch is large enough to pay for it, else done on the
// calling thread while the workers spin briefly between the linears' runs. With OmniKV tokens in the
// forward, an attention block of a FILTER layer makes their selections after its attention, and one of
// a SPARSE layer hands them to the attention (omnikv.h).
#include "model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <unordered_map>

#include "vec.h"

namespace cpx {
namespace {

constexpr int kRowChunk = 4;  // rows per task of the row-wise passes

// fn(t) for t < T: inline for a few rows, else in chunks on the pool.
template <class F>
void for_rows(Pool& pool, int T, F&& fn) {
  if (T <= kRowChunk) {
    for (int t = 0; t < T; ++t) fn(t);
    return;
  }
  pool.run((T + kRowChunk - 1) / kRowChunk, [&](int task, int) {
    for (int t = task * kRowChunk; t < std::min(T, (task + 1) * kRowChunk); ++t) fn(t);
  });
}

// y = x / sqrt(mean(x^2) + eps) * w (HF's RMSNorm in fp32); y may be x.
CPX_INLINE void rmsnorm_row_impl(const float* x, const float* w, float eps, int n, float* y) {
  using namespace vec;
  v8f acc = splat(0.0f);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8f v = load(x + i);
    acc += v * v;
  }
  float ss = hsum(acc);
  for (; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / float(n) + eps);
  for (i = 0; i + 8 <= n; i += 8) store(y + i, load(w + i) * (load(x + i) * splat(inv)));
  for (; i < n; ++i) y[i] = w[i] * (x[i] * inv);
}

CPX_DISPATCH(void, rmsnorm_row, (const float* x, const float* w, float eps, int n, float* y), (x, w, eps, n, y))

CPX_INLINE float dot_f32_impl(const float* a, const float* b, int n) { return vec::dot(a, b, n); }
CPX_DISPATCH(float, dot_f32, (const float* a, const float* b, int n), (a, b, n))

void rope_apply(float* v, const Rope& r, int64_t p) {
  const int half = r.dim / 2;
  const float* c = r.cos_sin + p * half;
  const float* s = r.cos_sin + r.max_pos * half + p * half;
  if (r.interleaved) {
    for (int i = 0; i < half; ++i) {
      const float x1 = v[2 * i], x2 = v[2 * i + 1];
      v[2 * i] = x1 * c[i] - x2 * s[i];
      v[2 * i + 1] = x2 * c[i] + x1 * s[i];
    }
  } else {
    for (int i = 0; i < half; ++i) {
      const float x1 = v[i], x2 = v[i + half];
      v[i] = x1 * c[i] - x2 * s[i];
      v[i + half] = x2 * c[i] + x1 * s[i];
    }
  }
}

// One query or key head of D values: RMS-normalised first where `norm` has weights (Qwen3's q_norm / k_norm),
// then rotated.
void head_norm_rope(float* v, const Norm& norm, int D, const Rope& r, int64_t p) {
  if (!norm.w.empty()) rmsnorm_row(v, norm.w.data(), norm.eps, D, v);
  rope_apply(v, r, p);
}

// n values into a cache row (fp32, or bf16 rounded to nearest even as torch rounds).
void put(void* cache, KvType type, int64_t at, const float* src, int n) {
  if (type == KvType::BF16) {
    uint16_t* dst = static_cast<uint16_t*>(cache) + at;
    for (int i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
  } else {
    std::memcpy(static_cast<float*>(cache) + at, src, size_t(n) * 4);
  }
}

void check_norm(const Norm& n, int size, const char* what) {
  if (int(n.w.size()) != size)
    throw ArgError(std::string(what) + " norm has " + std::to_string(n.w.size()) + " weights, expected " +
                   std::to_string(size));
}

void check_linear(const QuantLinear* op, int out, int in, const std::string& what) {
  if (!op) throw ArgError(what + " is missing");
  if (op->out_features() != out || op->in_features() != in)
    throw ArgError(what + " is " + std::to_string(op->out_features()) + " x " + std::to_string(op->in_features()) +
                   ", expected " + std::to_string(out) + " x " + std::to_string(in));
}

void check_rope(const Rope& r, int dim_limit, const char* what) {
  if (!r.cos_sin || r.max_pos <= 0 || r.dim <= 0 || r.dim % 2 || r.dim > dim_limit)
    throw ArgError(std::string(what) + ": bad rotary table (dim " + std::to_string(r.dim) + ", head dim " +
                   std::to_string(dim_limit) + ")");
}

}  // namespace

// A phase of the forward timed into a profile (CpuProfile), or nothing where the profile is null.
class Timed {
 public:
  Timed(CpuProfile* prof, Pool& pool, Phase p) : prof_(prof), pool_(pool), p_(p) {
    if (!prof_) return;
    runs0_ = pool_.timed_runs();
    wait0_ = pool_.timed_wait_ns();
    t0_ = std::chrono::steady_clock::now();
  }
  ~Timed() {
    if (!prof_) return;
    PhaseStat& st = prof_->phase[int(p_)];
    st.calls += 1;
    st.ns += uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_).count());
    st.pool_runs += pool_.timed_runs() - runs0_;
    st.wait_ns += pool_.timed_wait_ns() - wait0_;
  }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  CpuProfile* prof_;
  Pool& pool_;
  Phase p_;
  uint64_t runs0_ = 0, wait0_ = 0;
  std::chrono::steady_clock::time_point t0_;
};

// One forward's state, shared by the blocks.
struct Ctx {
  Pool& pool;
  int T;
  const int64_t* pos;
  const int64_t* rows;
  const int64_t* out_loc;
  int hidden;
  float* x;   // [T][hidden] residual stream
  float* xn;  // [T][hidden] normalised
  LinearInput& in;
  const PagedKv& table;
  int layer = 0;              // the layer whose block runs
  OmniRun* omni = nullptr;    // this forward's OmniKV tokens, or null
  CpuProfile* prof = nullptr;  // the model's profile while it is on, else null

  Timed timed(Phase p) { return Timed(prof, pool, p); }

  void norm(const Norm& n) {
    Timed ph = timed(Phase::Norm);
    for_rows(pool, T, [&](int t) { rmsnorm_row(x + size_t(t) * hidden, n.w.data(), n.eps, hidden, xn + size_t(t) * hidden); });
  }
  // The tokens for this layer's attention (H query heads): at a SPARSE layer the omni tokens read their
  // selections; at a FILTER layer their attention may dump its probabilities for `select`.
  AttnTokens tokens(int H) {
    AttnTokens tok{T, rows, pos};
    if (omni) omni->attach(layer, tok, H);
    return tok;
  }
  // After a layer's attention: a FILTER layer selects for the omni tokens (q as attention read it).
  void select(const PagedKv& kv, const float* q, int H, int Hkv, int D, float scale) {
    if (omni && omni->role(layer) == kRoleFilter) {
      Timed ph = timed(Phase::Select);
      omni->select(pool, layer, kv, q, H, Hkv, D, scale);
    }
  }
};

struct Block {
  virtual ~Block() = default;
  virtual void run(Ctx& c) = 0;
};

namespace {

struct GqaBlock final : Block {
  GqaSpec s;
  std::vector<float> q, k, v, a;
  AttnScratch scratch;

  void run(Ctx& c) override {
    const int T = c.T, qw = s.H * s.D, kw = s.Hkv * s.D;
    c.norm(s.norm);
    q.resize(size_t(T) * qw);
    k.resize(size_t(T) * kw);
    v.resize(size_t(T) * kw);
    a.resize(size_t(T) * qw);
    {
      Timed ph = c.timed(Phase::QkvProj);
      prepare_input(c.pool, c.in, c.xn, c.hidden, T, c.hidden, {s.q, s.k, s.v});
      run_linears(c.pool, {{s.q, &c.in, q.data(), qw}, {s.k, &c.in, k.data(), kw}, {s.v, &c.in, v.data(), kw}}, T);
    }
    {
      Timed ph = c.timed(Phase::RopeStore);
      for_rows(c.pool, T, [&](int t) {
        for (int h = 0; h < s.H; ++h) head_norm_rope(q.data() + size_t(t) * qw + h * s.D, s.q_norm, s.D, s.rope, c.pos[t]);
        for (int h = 0; h < s.Hkv; ++h) head_norm_rope(k.data() + size_t(t) * kw + h * s.D, s.k_norm, s.D, s.rope, c.pos[t]);
        put(s.k_cache, s.kv_type, c.out_loc[t] * kw, k.data() + size_t(t) * kw, kw);
        put(s.v_cache, s.kv_type, c.out_loc[t] * kw, v.data() + size_t(t) * kw, kw);
      });
    }
    PagedKv kv = c.table;
    kv.k = s.k_cache;
    kv.v = s.v_cache;
    kv.type = s.kv_type;
    kv.k_stride = kv.v_stride = kw;
    {
      Timed ph = c.timed(Phase::Attention);
      attention_gqa(c.pool, scratch, kv, c.tokens(s.H), q.data(), s.H, s.Hkv, s.D, s.D, s.scale, a.data());
    }
    c.select(kv, q.data(), s.H, s.Hkv, s.D, s.scale);
    Timed ph = c.timed(Phase::OProj);
    prepare_input(c.pool, c.in, a.data(), qw, T, qw, {s.o});
    run_linears(c.pool, {{s.o, &c.in, c.x, c.hidden, Epilogue::Add}}, T);
  }
};

struct MlaBlock final : Block {
  MlaSpec s;
  std::vector<float> q, qa, kv, qcat, heads, lat, vo;
  LinearInput in_q, in_heads;
  AttnScratch scratch;

  void run(Ctx& c) override {
    const int T = c.T, H = s.H, N = s.N, P = s.P, r = s.r, V = s.V;
    const int qw = H * (N + P), kvw = r + P, cw = H * (r + P);
    c.norm(s.norm);
    const QuantLinear* first = s.q ? s.q : s.q_a;
    q.resize(size_t(T) * qw);
    kv.resize(size_t(T) * kvw);
    std::optional<Timed> ph;
    ph.emplace(c.prof, c.pool, Phase::QkvProj);
    prepare_input(c.pool, c.in, c.xn, c.hidden, T, c.hidden, {first, s.kv_a});
    if (s.q) {
      run_linears(c.pool, {{s.q, &c.in, q.data(), qw}, {s.kv_a, &c.in, kv.data(), kvw}}, T);
    } else {
      const int qlr = s.q_a->out_features();
      qa.resize(size_t(T) * qlr);
      run_linears(c.pool, {{s.q_a, &c.in, qa.data(), qlr}, {s.kv_a, &c.in, kv.data(), kvw}}, T);
      for_rows(c.pool, T, [&](int t) {
        float* row = qa.data() + size_t(t) * qlr;
        rmsnorm_row(row, s.q_a_norm.w.data(), s.q_a_norm.eps, qlr, row);
      });
      prepare_input(c.pool, in_q, qa.data(), qlr, T, qlr, {s.q_b});
      run_linears(c.pool, {{s.q_b, &in_q, q.data(), qw}}, T);
    }
    // the latent of the new tokens (normalised c_kv ‖ RoPE'd k_pe) into the cache; RoPE'd q_pe; q_nope
    // gathered head-major, so that one prepared input serves every head's absorption
    heads.resize(size_t(H) * T * std::max(N, r));
    ph.emplace(c.prof, c.pool, Phase::RopeStore);
    for_rows(c.pool, T, [&](int t) {
      float* row = kv.data() + size_t(t) * kvw;
      rmsnorm_row(row, s.kv_norm.w.data(), s.kv_norm.eps, r, row);
      rope_apply(row + r, s.rope, c.pos[t]);
      put(s.latent, s.kv_type, c.out_loc[t] * kvw, row, kvw);
      for (int h = 0; h < H; ++h) {
        float* qh = q.data() + size_t(t) * qw + size_t(h) * (N + P);
        rope_apply(qh + N, s.rope, c.pos[t]);
        std::memcpy(heads.data() + (size_t(h) * T + t) * N, qh, size_t(N) * 4);
      }
    });
    // q_latent = q_nope · w_kc per head, next to q_pe: the query rows [T][H][r + P]
    qcat.resize(size_t(T) * cw);
    ph.emplace(c.prof, c.pool, Phase::Absorb);
    prepare_input(c.pool, in_heads, heads.data(), N, H * T, N, s.w_kc);
    std::vector<LinearCall> calls;
    for (int h = 0; h < H; ++h) calls.push_back({s.w_kc[size_t(h)], &in_heads, qcat.data() + size_t(h) * (r + P), cw,
                                                 Epilogue::Store, nullptr, h * T});
    run_linears(c.pool, calls, T);
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h)
        std::memcpy(qcat.data() + size_t(t) * cw + size_t(h) * (r + P) + r,
                    q.data() + size_t(t) * qw + size_t(h) * (N + P) + N, size_t(P) * 4);
    // MQA over the latent cache, then each head's latent output through w_vc, then o_proj
    lat.resize(size_t(T) * H * r);
    PagedKv cache = c.table;
    cache.k = s.latent;
    cache.type = s.kv_type;
    cache.k_stride = kvw;
    ph.emplace(c.prof, c.pool, Phase::Attention);
    attention_mla(c.pool, scratch, cache, c.tokens(H), qcat.data(), H, r, P, s.scale, lat.data());
    ph.reset();
    c.select(cache, qcat.data(), H, 1, r + P, s.scale);
    ph.emplace(c.prof, c.pool, Phase::ValueUp);
    for_rows(c.pool, T, [&](int t) {
      for (int h = 0; h < H; ++h)
        std::memcpy(heads.data() + (size_t(h) * T + t) * r, lat.data() + (size_t(t) * H + h) * r, size_t(r) * 4);
    });
    vo.resize(size_t(T) * H * V);
    prepare_input(c.pool, in_heads, heads.data(), r, H * T, r, s.w_vc);
    calls.clear();
    for (int h = 0; h < H; ++h)
      calls.push_back({s.w_vc[size_t(h)], &in_heads, vo.data() + size_t(h) * V, int64_t(H) * V, Epilogue::Store,
                       nullptr, h * T});
    run_linears(c.pool, calls, T);
    ph.emplace(c.prof, c.pool, Phase::OProj);
    prepare_input(c.pool, c.in, vo.data(), H * V, T, H * V, {s.o});
    run_linears(c.pool, {{s.o, &c.in, c.x, c.hidden, Epilogue::Add}}, T);
  }
};

struct DenseMlpBlock final : Block {
  DenseMlpSpec s;
  std::vector<float> h;

  void run(Ctx& c) override {
    const int T = c.T, I = s.gate->out_features();
    c.norm(s.norm);
    h.resize(size_t(T) * I);
    {
      Timed ph = c.timed(Phase::GateUp);
      prepare_input(c.pool, c.in, c.xn, c.hidden, T, c.hidden, {s.gate, s.up});
      run_linears(c.pool, {{s.gate, &c.in, h.data(), I, Epilogue::SiluMul, s.up}}, T);
    }
    Timed ph = c.timed(Phase::Down);
    prepare_input(c.pool, c.in, h.data(), I, T, I, {s.down});
    run_linears(c.pool, {{s.down, &c.in, c.x, c.hidden, Epilogue::Add}}, T);
  }
};

struct MoeBlock final : Block {
  MoeSpec s;
  std::vector<float> logits, weights, routed, h;
  std::vector<int32_t> ids;

  // DeepSeek's routers (models/moe_routing.py): softmax or sigmoid scores; top-k directly, inside the
  // best groups by max score (V2), or on bias-corrected scores inside the best groups by their top-2
  // sum (V3, whose weights stay the uncorrected scores); then renormalised and scaled.
  void route(int t) {
    const int E = s.E, K = s.K;
    const float* lg = logits.data() + size_t(t) * E;
    std::vector<float> score(static_cast<size_t>(E)), choice(static_cast<size_t>(E));
    if (s.sigmoid) {
      for (int e = 0; e < E; ++e) score[size_t(e)] = 1.0f / (1.0f + std::exp(-lg[e]));
    } else {
      const float mx = *std::max_element(lg, lg + E);
      float sum = 0.0f;
      for (int e = 0; e < E; ++e) sum += score[size_t(e)] = std::exp(lg[e] - mx);
      for (float& v : score) v /= sum;
    }
    // A hidden state that overflowed (NaN or infinite logits: a damaged or hostile file's weights) gives
    // its token zero routed weights instead of NaN ones, which the experts refuse and which would make the
    // ordering below undefined: that token's output is garbage either way, the engine keeps running.
    for (float& v : score)
      if (!std::isfinite(v)) v = 0.0f;
    for (int e = 0; e < E; ++e) choice[size_t(e)] = score[size_t(e)] + (s.bias.empty() ? 0.0f : s.bias[size_t(e)]);
    const bool grouped = s.n_group > 1 && s.method != TopkMethod::Greedy;
    if (grouped) {
      const int per = E / s.n_group;
      std::vector<float> gscore(static_cast<size_t>(s.n_group));
      for (int g = 0; g < s.n_group; ++g) {
        std::vector<float> v(choice.begin() + g * per, choice.begin() + (g + 1) * per);
        if (s.method == TopkMethod::NoauxTc) {
          std::partial_sort(v.begin(), v.begin() + std::min(2, per), v.end(), std::greater<float>());
          gscore[size_t(g)] = v[0] + (per > 1 ? v[1] : 0.0f);
        } else {
          gscore[size_t(g)] = *std::max_element(v.begin(), v.end());
        }
      }
      std::vector<int> order(static_cast<size_t>(s.n_group));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return gscore[size_t(a)] > gscore[size_t(b)]; });
      std::vector<bool> keep(static_cast<size_t>(s.n_group), false);
      for (int i = 0; i < s.topk_group; ++i) keep[size_t(order[size_t(i)])] = true;
      // V3 masks the dropped groups' choices to -inf; V2 their scores to 0
      for (int e = 0; e < E; ++e)
        if (!keep[size_t(e / per)]) choice[size_t(e)] = s.method == TopkMethod::NoauxTc ? -INFINITY : 0.0f;
    }
    std::vector<int> idx(static_cast<size_t>(E));
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + K, idx.end(),
                      [&](int a, int b) { return choice[size_t(a)] > choice[size_t(b)] || (choice[size_t(a)] == choice[size_t(b)] && a < b); });
    float sum = 0.0f;
    for (int k = 0; k < K; ++k) {
      const int e = idx[size_t(k)];
      ids[size_t(t) * K + k] = e;
      // V2 grouped: the weights are the masked scores themselves (0 outside the groups)
      const float w = s.method == TopkMethod::GroupLimitedGreedy && grouped ? choice[size_t(e)] : score[size_t(e)];
      weights[size_t(t) * K + k] = w;
      sum += w;
    }
    for (int k = 0; k < K; ++k) {
      float& w = weights[size_t(t) * K + k];
      if (s.norm_topk) w /= sum + 1e-20f;  // k = 1 too, as HF transformers and llama.cpp
      w *= s.scaling;
    }
  }

  void run(Ctx& c) override {
    const int T = c.T, E = s.E, K = s.K, Hd = c.hidden;
    c.norm(s.norm);
    logits.resize(size_t(T) * E);
    ids.resize(size_t(T) * K);
    weights.resize(size_t(T) * K);
    routed.resize(size_t(T) * Hd);
    constexpr int kExpertChunk = 16;
    const int chunks = (E + kExpertChunk - 1) / kExpertChunk;
    std::optional<Timed> ph;
    ph.emplace(c.prof, c.pool, Phase::Router);
    c.pool.run(T * chunks, [&](int task, int) {
      const int t = task / chunks, e0 = (task % chunks) * kExpertChunk;
      for (int e = e0; e < std::min(E, e0 + kExpertChunk); ++e)
        logits[size_t(t) * E + e] = dot_f32(c.xn + size_t(t) * Hd, s.router.data() + size_t(e) * Hd, Hd);
    });
    for_rows(c.pool, T, [&](int t) { route(t); });
    Job job;
    job.hidden = c.xn;
    job.tokens = T;
    job.ids = ids.data();
    job.weights = weights.data();
    job.out = routed.data();
    ph.emplace(c.prof, c.pool, Phase::Experts);
    s.experts->forward(job);
    ph.reset();
    if (s.shared_gate) {
      ph.emplace(c.prof, c.pool, Phase::Shared);
      const int I = s.shared_gate->out_features();
      prepare_input(c.pool, c.in, c.xn, Hd, T, Hd, {s.shared_gate, s.shared_up});
      h.resize(size_t(T) * I);
      run_linears(c.pool, {{s.shared_gate, &c.in, h.data(), I, Epilogue::SiluMul, s.shared_up}}, T);
      if (!s.shared_scale.empty())  // the gate scales each token's activations: down(g·h) = g·down(h)
        for_rows(c.pool, T, [&](int t) {
          const float g = 1.0f / (1.0f + std::exp(-dot_f32(c.xn + size_t(t) * Hd, s.shared_scale.data(), Hd)));
          float* hr = h.data() + size_t(t) * I;
          for (int i = 0; i < I; ++i) hr[i] *= g;
        });
      prepare_input(c.pool, c.in, h.data(), I, T, I, {s.shared_down});
      run_linears(c.pool, {{s.shared_down, &c.in, c.x, Hd, Epilogue::Add}}, T);
      ph.reset();
    }
    for_rows(c.pool, T, [&](int t) {
      float* xr = c.x + size_t(t) * Hd;
      const float* rr = routed.data() + size_t(t) * Hd;
      for (int i = 0; i < Hd; ++i) xr[i] += rr[i];
    });
  }

};

}  // namespace

CpuModel::CpuModel(std::shared_ptr<Pool> pool, int hidden, const QuantLinear* embed, const QuantLinear* lm_head,
                   Norm final_norm)
    : pool_(std::move(pool)), hidden_(hidden), embed_(embed), lm_head_(lm_head), final_norm_(std::move(final_norm)) {
  if (!pool_) throw ArgError("CpuModel needs a pool");
  if (hidden_ <= 0) throw ArgError("hidden size must be positive");
  if (!embed_ || embed_->in_features() != hidden_) throw ArgError("the embedding must be [vocab][hidden]");
  if (!lm_head_ || lm_head_->in_features() != hidden_) throw ArgError("the LM head must be [vocab][hidden]");
  check_norm(final_norm_, hidden_, "final");
}

CpuModel::~CpuModel() = default;

void CpuModel::set_table(const int32_t* table, int64_t rows, int64_t stride, int64_t num_slots) {
  if (!table || rows <= 0 || stride <= 0 || num_slots <= 0) throw ArgError("bad req_to_token table or pool size");
  std::lock_guard<std::mutex> lock(m_);
  table_.table = table;
  table_.table_rows = rows;
  table_.table_stride = stride;
  table_.num_slots = num_slots;
  prog_.reset();  // its layers hold copies of the table
}

void CpuModel::add_gqa(GqaSpec s) {
  check_norm(s.norm, hidden_, "attention");
  if (s.H <= 0 || s.Hkv <= 0 || s.H % s.Hkv || s.D <= 0) throw ArgError("bad attention heads");
  check_linear(s.q, s.H * s.D, hidden_, "q_proj");
  check_linear(s.k, s.Hkv * s.D, hidden_, "k_proj");
  check_linear(s.v, s.Hkv * s.D, hidden_, "v_proj");
  check_linear(s.o, hidden_, s.H * s.D, "o_proj");
  check_rope(s.rope, s.D, "attention");
  if (!s.k_cache || !s.v_cache) throw ArgError("the layer's K/V cache is missing");
  if (blocks_.size() % 2) throw ArgError("an attention block must follow an MLP block");
  rope_positions_ = std::min(rope_positions_, s.rope.max_pos);
  auto b = std::make_unique<GqaBlock>();
  b->s = std::move(s);
  blocks_.push_back(std::move(b));
}

void CpuModel::add_mla(MlaSpec s) {
  check_norm(s.norm, hidden_, "attention");
  if (s.H <= 0 || s.N <= 0 || s.P <= 0 || s.V <= 0 || s.r <= 0) throw ArgError("bad MLA sizes");
  const int qw = s.H * (s.N + s.P);
  if (s.q) {
    check_linear(s.q, qw, hidden_, "q_proj");
  } else {
    if (!s.q_a || !s.q_b) throw ArgError("MLA needs q_proj, or q_a_proj and q_b_proj");
    check_linear(s.q_a, s.q_a->out_features(), hidden_, "q_a_proj");
    check_linear(s.q_b, qw, s.q_a->out_features(), "q_b_proj");
    check_norm(s.q_a_norm, s.q_a->out_features(), "q_a");
  }
  check_linear(s.kv_a, s.r + s.P, hidden_, "kv_a_proj_with_mqa");
  check_norm(s.kv_norm, s.r, "kv_a");
  if (int(s.w_kc.size()) != s.H || int(s.w_vc.size()) != s.H) throw ArgError("w_kc and w_vc need one linear per head");
  for (int h = 0; h < s.H; ++h) {
    check_linear(s.w_kc[size_t(h)], s.r, s.N, "w_kc[" + std::to_string(h) + "]");
    check_linear(s.w_vc[size_t(h)], s.V, s.r, "w_vc[" + std::to_string(h) + "]");
  }
  check_linear(s.o, hidden_, s.H * s.V, "o_proj");
  check_rope(s.rope, s.P, "MLA");
  if (!s.latent) throw ArgError("the layer's latent cache is missing");
  if (blocks_.size() % 2) throw ArgError("an attention block must follow an MLP block");
  rope_positions_ = std::min(rope_positions_, s.rope.max_pos);
  auto b = std::make_unique<MlaBlock>();
  b->s = std::move(s);
  blocks_.push_back(std::move(b));
}

void CpuModel::add_dense_mlp(DenseMlpSpec s) {
  check_norm(s.norm, hidden_, "MLP");
  if (!s.gate) throw ArgError("gate_proj is missing");
  const int I = s.gate->out_features();
  check_linear(s.gate, I, hidden_, "gate_proj");
  check_linear(s.up, I, hidden_, "up_proj");
  check_linear(s.down, hidden_, I, "down_proj");
  if (blocks_.size() % 2 == 0) throw ArgError("an MLP block must follow an attention block");
  auto b = std::make_unique<DenseMlpBlock>();
  b->s = std::move(s);
  blocks_.push_back(std::move(b));
}

void CpuModel::add_moe(MoeSpec s) {
  check_norm(s.norm, hidden_, "MoE");
  if (s.E <= 0 || s.K <= 0 || s.K > s.E) throw ArgError("bad expert count or top-k");
  if (int64_t(s.router.size()) != int64_t(s.E) * hidden_) throw ArgError("the router must be [experts][hidden]");
  if (!s.bias.empty() && int(s.bias.size()) != s.E) throw ArgError("the correction bias must be [experts]");
  if (s.n_group <= 0 || s.E % s.n_group || s.topk_group <= 0 || s.topk_group > s.n_group)
    throw ArgError("bad expert groups");
  if (!s.experts) throw ArgError("the routed experts are missing");
  if (s.shared_gate) {
    const int I = s.shared_gate->out_features();
    check_linear(s.shared_gate, I, hidden_, "shared gate_proj");
    check_linear(s.shared_up, I, hidden_, "shared up_proj");
    check_linear(s.shared_down, hidden_, I, "shared down_proj");
  }
  if (!s.shared_scale.empty() && (!s.shared_gate || int64_t(s.shared_scale.size()) != hidden_)) {
    throw ArgError("the shared experts' gate needs shared experts and one weight per hidden value");
  }
  if (blocks_.size() % 2 == 0) throw ArgError("an MLP block must follow an attention block");
  auto b = std::make_unique<MoeBlock>();
  b->s = std::move(s);
  blocks_.push_back(std::move(b));
}

void CpuModel::set_omnikv(OmniSpec s) {
  std::lock_guard<std::mutex> lock(m_);
  const int L = num_layers();
  if (L == 0 || blocks_.size() % 2) throw ArgError("set_omnikv() needs the model's layers first");
  if (int(s.roles.size()) != L || int(s.source.size()) != L)
    throw ArgError("OmniKV: roles and source need one entry per layer (" + std::to_string(L) + ")");
  s.filter_of.assign(size_t(L), -1);
  std::vector<int> filter_layer;
  for (int l = 0; l < L; ++l) {
    const int role = s.roles[size_t(l)];
    if (role < kRoleFull || role > kRoleSparse) throw ArgError("OmniKV: layer " + std::to_string(l) + " has role " + std::to_string(role));
    if (role == kRoleFilter) {
      s.filter_of[size_t(l)] = int(filter_layer.size());
      filter_layer.push_back(l);
    }
  }
  s.num_filters = int(filter_layer.size());
  if (s.num_filters == 0) throw ArgError("OmniKV: the plan has no filter layer");
  for (int l = 0; l < L; ++l) {
    const int src = s.source[size_t(l)];
    if (s.roles[size_t(l)] == kRoleSparse && (src < 0 || src >= s.num_filters || filter_layer[size_t(src)] >= l))
      throw ArgError("OmniKV: sparse layer " + std::to_string(l) + " must read a filter layer above it, got " +
                     std::to_string(src));
  }
  if (s.sink < 0 || s.recent < 1) throw ArgError("OmniKV: sink must be >= 0 and recent >= 1");
  if (int(s.alpha) < 0 || int(s.alpha) > 2) throw ArgError("OmniKV: unknown alpha mode");
  if (s.hist_q || s.hist_pos) {
    if (!s.hist_q || !s.hist_pos) throw ArgError("OmniKV: the query history needs both q and pos");
    if (s.window < 1 || s.window > kMaxOmniWindow)
      throw ArgError("OmniKV: window must be in [1, " + std::to_string(kMaxOmniWindow) + "]");
    if (!table_.table) throw ArgError("set_table() before set_omnikv()");
    if (s.hist_rows < table_.table_rows)
      throw ArgError("OmniKV: the query history has " + std::to_string(s.hist_rows) + " rows, req_to_token " +
                     std::to_string(table_.table_rows));
    for (int l : filter_layer) {
      int H = 0, D = 0;
      if (auto* g = dynamic_cast<GqaBlock*>(blocks_[size_t(2 * l)].get())) H = g->s.H, D = g->s.D;
      if (auto* m = dynamic_cast<MlaBlock*>(blocks_[size_t(2 * l)].get())) H = m->s.H, D = m->s.r + m->s.P;
      if (H != s.H || D != s.D)
        throw ArgError("OmniKV: the query history holds " + std::to_string(s.H) + " x " + std::to_string(s.D) +
                       " queries, filter layer " + std::to_string(l) + " makes " + std::to_string(H) + " x " +
                       std::to_string(D));
    }
  } else {
    s.window = 1;
  }
  omni_ = std::make_unique<OmniSpec>(std::move(s));
}

// The decode program (model.h: CpuModel::Program).
struct CpuModel::Program {
  struct Part {  // one participant's own normed rows (its inputs are per pass: `inputs`)
    std::vector<float> xn;
  };
  struct alignas(64) Counter {
    std::atomic<int> v{0};
  };
  struct Pass {
    Phase phase = Phase::QkvProj;  // where a profile counts it (its serial work and barrier wait included)
    int tasks = 0;
    std::vector<int> bounds;             // participant p's own tasks: [bounds[p], bounds[p + 1])
    std::function<void(int tid)> prep;   // each participant's serial work before it takes tasks (or null)
    std::function<void(int i, int tid)> task;
  };
  // what the program was built for
  int T = -1, N = -1, P = 0;
  size_t blocks = 0;
  const float* x = nullptr;
  const int32_t* table = nullptr;  // req_to_token (its layers' caches are copied with it)
  // this forward's tokens (the passes read them here)
  const int64_t *pos = nullptr, *rows = nullptr, *out_loc = nullptr, *logit_rows = nullptr;
  std::vector<Part> parts;
  std::vector<Pass> passes;
  std::vector<std::unique_ptr<LinearPass>> lin;  // the linear passes (stable addresses: the tasks hold them)
  LinearPass* head = nullptr;
  std::vector<int64_t> head_argmax;  // where the head's argmax goes when the forward asks for none
  std::vector<std::unique_ptr<LinearInput>> inputs;  // per linear pass x participant, as they were added
  struct Layer {  // a layer's activations and attention state (the blocks' own stay the other path's)
    std::vector<float> q, k, v, a, h;
    AttnScratch scratch;
    PagedKv kv;
    int pass = 0;  // index of its attention pass
    int down = 0;  // index of its down pass
    std::vector<int64_t> kv_bytes;  // this forward's KV bytes per attention task (ask_kv)
  };
  std::vector<Layer> layers;
  std::unique_ptr<Counter[]> done, next;  // per pass x participant: tasks it has done; its range's next task
  int64_t wait_ns = 0;                    // participant 0's waits at the barriers, this forward
  CpuProfile* prof = nullptr;             // this forward's profile (participant 0 times the passes), or null
  const Pool* pool = nullptr;             // whose wait policy the barriers follow (Pool::wait_until)

  static void even_bounds(std::vector<int>& b, int tasks, int P) {
    b.resize(size_t(P) + 1);
    for (int p = 0; p <= P; ++p) b[size_t(p)] = int(int64_t(tasks) * p / P);
  }
  void add(Pass ps) { passes.push_back(std::move(ps)); }
  // The KV rows of layer l's attention are asked for (prefetched into L2) by the tasks of the pass before
  // it that streams weights, the down pass of the layer before (layer 0's: its q·k·v pass), each
  // participant's for its own attention tasks, its r-th of n own tasks there the r-th n-th of the first
  // kKvAheadBytes of those rows (a task taken from another's range asks for none). Read by the attention
  // itself they are scattered lines of a cold cache, which it waited for at about a third of the memory
  // bandwidth; asked for among the weights they arrive at its pace. SmolLM2 Q4_1 decode after a
  // 128-token prompt on a 2-core Zen 4 VM (generations alternating in one process): attention ~610 ->
  // ~360 us a step, down ~600 -> ~720, the step 1.015-1.047x in three runs of 20-40 pairs. At long
  // contexts the attention is bound by its arithmetic and keeps up with its own prefetch, so asking
  // ahead only moves bytes (512 and 1536 tokens: 1.00x, 1.02x): the cap.
  static constexpr int64_t kKvAheadBytes = 128 << 10;
  bool kv_ahead = true;  // this forward asks ahead (CpuModel::set_kv_ahead)
  void ask_kv(int k, int i, int tid, int l) const {
    const Pass& ps = passes[size_t(k)];
    const int b0 = ps.bounds[size_t(tid)], n = ps.bounds[size_t(tid) + 1] - b0, r = i - b0;
    if (r < 0 || r >= n) return;
    const Layer& ly = layers[size_t(l)];
    const Pass& ap = passes[size_t(ly.pass)];
    const int a0 = ap.bounds[size_t(tid)], a1 = ap.bounds[size_t(tid) + 1];
    int64_t total = 0;
    for (int j = a0; j < a1 && total < kKvAheadBytes; ++j) total += ly.kv_bytes[size_t(j)];
    total = std::min(total, kKvAheadBytes);
    int64_t b = total * r / n, e = total * (r + 1) / n;  // this task's share, from the first of tid's tasks
    for (int j = a0; j < a1 && b < e; ++j) {
      const int64_t nb = ly.kv_bytes[size_t(j)];
      if (b < nb) prefetch_attention_task(ly.scratch, j, b, std::min(e, nb));
      b = std::max<int64_t>(0, b - nb), e -= nb;
    }
  }
  // A linear pass over m rows of k values (ldx floats apart, from x(tid)), shaped for `readers`. Its input
  // is each participant's own, prepared in the pass's serial work after `before(tid)` (a norm into
  // x(tid), or null); or, with `shared`, one input that the pass before fills as it writes the rows
  // (fill_input_cols from its tasks' epilogues) and every participant reads: no participant then
  // quantises the whole input again, nor first reads the rows the other cores wrote.
  LinearPass& add_linear(Phase phase, std::vector<LinearCall> calls, const std::function<const float*(int tid)>& x,
                         int64_t ldx, int m, int k, const std::vector<const QuantLinear*>& readers,
                         std::function<void(int tid)> before, LinearInput* shared = nullptr) {
    const size_t base = inputs.size();
    if (shared) {
      shape_input(*shared, x(0), ldx, m, k, readers);
    } else {
      for (int tid = 0; tid < P; ++tid) {
        inputs.push_back(std::make_unique<LinearInput>());
        shape_input(*inputs.back(), x(tid), ldx, m, k, readers);
      }
    }
    // the calls' own input: the shared one, or participant 0's, for the plan's checks
    for (LinearCall& c : calls) c.in = shared ? shared : inputs[base].get();
    lin.push_back(std::make_unique<LinearPass>());
    LinearPass* l = lin.back().get();
    plan_linears(*l, calls, m, P);
    Pass ps;
    ps.phase = phase;
    ps.tasks = int(l->tasks.size());
    even_bounds(ps.bounds, ps.tasks, P);
    if (shared) {
      ps.prep = std::move(before);
      ps.task = [l](int i, int) { run_linear_task(*l, i, nullptr); };
    } else {
      ps.prep = [this, base, m, before = std::move(before)](int tid) {
        if (before) before(tid);
        fill_input_rows(*inputs[base + size_t(tid)], 0, m);
      };
      ps.task = [this, l, base](int i, int tid) { run_linear_task(*l, i, inputs[base + size_t(tid)].get()); };
    }
    add(std::move(ps));
    return *l;
  }
  LinearInput* new_input() {
    inputs.push_back(std::make_unique<LinearInput>());
    return inputs.back().get();
  }
  bool all_done(int k) const {
    int n = 0;
    for (int p = 0; p < P; ++p) n += done[size_t(k) * P + p].v.load(std::memory_order_acquire);
    return n == passes[size_t(k)].tasks;
  }
  // Until pass k's tasks are all done; participant 0 counts the time it waits.
  int64_t wait_done(int k, int tid) {
    if (all_done(k)) return 0;
    const auto t0 = std::chrono::steady_clock::now();
    pool->wait_until([this, k] { return all_done(k); });
    const int64_t w = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    if (tid == 0) wait_ns += w;
    return w;
  }
  void run(int tid) {
    const int npass = int(passes.size());
    const bool timed = prof && tid == 0;
    auto t0 = std::chrono::steady_clock::now();
    auto account = [&](int k, int64_t waited) {  // pass k done, for the profile
      const auto t = std::chrono::steady_clock::now();
      PhaseStat& st = prof->phase[int(passes[size_t(k)].phase)];
      st.calls += 1;
      st.ns += uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(t - t0).count());
      st.pool_runs += 1;
      st.wait_ns += uint64_t(waited);
      t0 = t;
    };
    for (int k = 0; k < npass; ++k) {
      Pass& ps = passes[size_t(k)];
      if (k > 0) {
        const int64_t w = wait_done(k - 1, tid);
        if (timed) account(k - 1, w);
      }
      Counter* nx = next.get() + size_t(k) * P;
      // its own range first: another's counter is a line the other core is writing
      bool left = false;
      for (int j = 0; j < P && !left; ++j) {
        const int p = (tid + j) % P;
        left = nx[p].v.load(std::memory_order_relaxed) < ps.bounds[size_t(p) + 1];
      }
      if (!left) continue;  // taken by the others (this participant came late): nothing to prepare
      if (ps.prep) ps.prep(tid);
      // its own range, then the others' (work stealing: without it, 0.966 of the speed in 10
      // interleaved rounds; looking at a range's counter before taking from it, 0.99)
      for (int j = 0; j < P; ++j) {
        const int p = (tid + j) % P, end = ps.bounds[size_t(p) + 1];
        for (int i; (i = nx[p].v.fetch_add(1, std::memory_order_relaxed)) < end;) {
          ps.task(i, tid);
          // only this participant writes its count: a plain store, no locked add on a line the
          // others read (on a VM whose vCPUs sit on two core complexes a locked add on the other's
          // line stalls ~0.4 us)
          std::atomic<int>& d = done[size_t(k) * P + tid].v;
          d.store(d.load(std::memory_order_relaxed) + 1, std::memory_order_release);
        }
      }
    }
    if (npass > 0) {
      const int64_t w = wait_done(npass - 1, tid);
      if (timed) account(npass - 1, w);
    }
  }
  void reset() {
    const int npass = int(passes.size());
    for (int k = 0; k < npass; ++k) {
      for (int p = 0; p < P; ++p) done[size_t(k) * P + p].v.store(0, std::memory_order_relaxed);
      for (int p = 0; p < P; ++p) next[size_t(k) * P + p].v.store(passes[size_t(k)].bounds[size_t(p)], std::memory_order_relaxed);
    }
    wait_ns = 0;
  }
};

bool CpuModel::program_fits(int T) const {
  if (!prog_on_ || prog_unfit_ || T > kGroupStreamRows || pool_->size() < 2) return false;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const Block* b = blocks_[i].get();
    if (i % 2 == 0 ? dynamic_cast<const GqaBlock*>(b) == nullptr : dynamic_cast<const DenseMlpBlock*>(b) == nullptr)
      return false;
  }
  return true;
}

void CpuModel::set_decode_program(bool on) {
  std::lock_guard<std::mutex> lock(m_);
  prog_on_ = on;
}

bool CpuModel::decode_program() {
  std::lock_guard<std::mutex> lock(m_);
  return prog_on_;
}

void CpuModel::set_kv_ahead(bool on) {
  std::lock_guard<std::mutex> lock(m_);
  kv_ahead_ = on;
}

bool CpuModel::kv_ahead() {
  std::lock_guard<std::mutex> lock(m_);
  return kv_ahead_;
}

// Whether every task of a q·k·v pass writes whole heads of D columns (its RoPE and KV store run in the
// task: model.h, CpuModel::Program).
static bool whole_heads(const LinearPass& lp, int D) {
  constexpr int kCols = kGroupRowblocks * 16;
  for (const LinearTask& tk : lp.tasks) {
    const int N = lp.calls[size_t(tk.call)].op->out_features();
    auto ok = [&](int n0, int n1) { return n0 % D == 0 && (std::min(n1, N) % D == 0 || n1 >= N); };
    if (tk.step > 0) {
      for (int g = 0; g < tk.count; ++g)
        if (!ok((tk.g0 + g * tk.step) * kCols, (tk.g0 + g * tk.step + 1) * kCols)) return false;
    } else if (!ok(tk.rb0 * 16, tk.rb1 * 16)) {
      return false;
    }
  }
  return true;
}

void CpuModel::build_program(int T, int N) {
  prog_.reset();
  auto pg = std::make_unique<Program>();
  Program& G = *pg;
  const int P = pool_->size(), H = hidden_;
  G.T = T, G.N = N, G.P = P, G.x = x_.data(), G.blocks = blocks_.size(), G.table = table_.table;
  float* x = x_.data();
  G.parts.resize(size_t(P));
  for (auto& pt : G.parts) pt.xn.assign(size_t(std::max(T, N)) * H, 0.0f);
  auto xn = [&G](int tid) -> const float* { return G.parts[size_t(tid)].xn.data(); };
  Program* gp = &G;
  auto norm_into = [gp, x, T, H](const Norm& n) {
    const Norm* np = &n;
    return [gp, x, T, H, np](int tid) {
      float* y = gp->parts[size_t(tid)].xn.data();
      for (int t = 0; t < T; ++t) rmsnorm_row(x + size_t(t) * H, np->w.data(), np->eps, H, y + size_t(t) * H);
    };
  };
  const int L = num_layers();
  G.layers.resize(size_t(L));
  for (int l = 0; l < L; ++l) {
    const GqaSpec& s = static_cast<GqaBlock&>(*blocks_[size_t(2 * l)]).s;
    const DenseMlpSpec& d = static_cast<DenseMlpBlock&>(*blocks_[size_t(2 * l + 1)]).s;
    Program::Layer& ly = G.layers[size_t(l)];
    const int qw = s.H * s.D, kw = s.Hkv * s.D, I = d.gate->out_features();
    ly.q.assign(size_t(T) * qw, 0.0f);
    ly.k.assign(size_t(T) * kw, 0.0f);
    ly.v.assign(size_t(T) * kw, 0.0f);
    ly.a.assign(size_t(T) * qw, 0.0f);
    ly.h.assign(size_t(T) * I, 0.0f);
    ly.kv = table_;
    ly.kv.k = s.k_cache;
    ly.kv.v = s.v_cache;
    ly.kv.type = s.kv_type;
    ly.kv.k_stride = ly.kv.v_stride = kw;
    // q·k·v, each task's heads RoPE'd and their K/V stored
    LinearPass& qkv = G.add_linear(Phase::QkvProj, {{s.q, nullptr, ly.q.data(), qw}, {s.k, nullptr, ly.k.data(), kw},
                                    {s.v, nullptr, ly.v.data(), kw}},
                                   xn, H, T, H, {s.q, s.k, s.v}, norm_into(s.norm));
    const GqaSpec* sp = &s;
    Program::Layer* lp = &ly;
    // head h of call `call` (q, k, v) for token t: RoPE (q, k) and the store into the KV pool (k, v)
    auto head = [gp, sp, lp](int call, int t, int h) {
      const int D = sp->D, qw2 = sp->H * D, kw2 = sp->Hkv * D;
      if (call == 0) {
        head_norm_rope(lp->q.data() + size_t(t) * qw2 + size_t(h) * D, sp->q_norm, D, sp->rope, gp->pos[t]);
      } else if (call == 1) {
        float* kh = lp->k.data() + size_t(t) * kw2 + size_t(h) * D;
        head_norm_rope(kh, sp->k_norm, D, sp->rope, gp->pos[t]);
        put(sp->k_cache, sp->kv_type, gp->out_loc[t] * kw2 + int64_t(h) * D, kh, D);
      } else {
        put(sp->v_cache, sp->kv_type, gp->out_loc[t] * kw2 + int64_t(h) * D, lp->v.data() + size_t(t) * kw2 + size_t(h) * D, D);
      }
    };
    if (whole_heads(qkv, s.D)) {
      qkv.after = [head, sp](int call, int n0, int ncols, int t0, int nt) {
        for (int t = t0; t < t0 + nt; ++t)
          for (int h = n0 / sp->D; h < (n0 + ncols) / sp->D; ++h) head(call, t, h);
      };
    } else {
      // a head size whose heads the tasks' column groups cut (64 columns: head dims 80, 96, 100, ...): the
      // heads in a pass of their own after q·k·v, one task per participant (as the pass-by-pass path does
      // them after its q·k·v run; the same bits)
      Program::Pass ps;
      ps.phase = Phase::RopeStore;
      ps.tasks = P;
      Program::even_bounds(ps.bounds, ps.tasks, P);
      ps.task = [gp, sp, head, P](int i, int) {
        const int n = sp->H + 2 * sp->Hkv;  // q heads, then k heads, then v heads
        for (int j = n * i / P; j < n * (i + 1) / P; ++j) {
          const int call = j < sp->H ? 0 : j < sp->H + sp->Hkv ? 1 : 2;
          const int h = call == 0 ? j : call == 1 ? j - sp->H : j - sp->H - sp->Hkv;
          for (int t = 0; t < gp->T; ++t) head(call, t, h);
        }
      };
      G.add(std::move(ps));
    }
    // attention: planned per forward (its key blocks follow the positions)
    {
      Program::Pass ps;
      ps.phase = Phase::Attention;
      ps.task = [gp, l](int i, int tid) {
        run_attention_task(gp->layers[size_t(l)].scratch, i, tid);
      };
      ly.pass = int(G.passes.size());
      G.add(std::move(ps));
    }
    const float* a = ly.a.data();
    // o reads the attention's output as the attention tasks quantise it (a group's heads as the group's
    // output is written), down reads gate·up's as its tasks quantise it: each participant's serial
    // work before them was ~0.6 and ~0.9 us a layer on a Zen 5 VM whose two vCPUs sat on two core
    // complexes, most of it reading the rows the other core had just written (a decode step's o
    // 159 -> 133 us and down 324 -> 313 us, 10 interleaved rounds; the same bits)
    LinearInput* ain = s.D % 32 == 0 ? G.new_input() : nullptr;  // whole Q8_0 blocks per head
    G.add_linear(Phase::OProj, {{s.o, nullptr, x, H, Epilogue::Add}}, [a](int) { return a; }, qw, T, qw, {s.o}, nullptr,
                 ain);
    if (ain) ly.scratch.after = [ain](int t0, int nt, int c0, int c1) { fill_input_cols(*ain, t0, t0 + nt, c0, c1); };
    LinearPass& gu = G.add_linear(Phase::GateUp, {{d.gate, nullptr, ly.h.data(), I, Epilogue::SiluMul, d.up}}, xn, H, T,
                                  H, {d.gate, d.up}, norm_into(d.norm));
    const float* h = ly.h.data();
    LinearInput* hin = G.new_input();
    G.add_linear(Phase::Down, {{d.down, nullptr, x, H, Epilogue::Add}}, [h](int) { return h; }, I, T, I, {d.down}, nullptr,
                 hin);
    ly.down = int(G.passes.size()) - 1;
    gu.after = [hin](int, int n0, int ncols, int t0, int nt) { fill_input_cols(*hin, t0, t0 + nt, n0, n0 + ncols); };
  }
  // layer l's KV rows, asked for by the down pass before it (layer 0's by its q·k·v pass: Program::ask_kv)
  for (int l = 0; l < L; ++l) {
    const int k = l ? G.layers[size_t(l) - 1].down : 0;
    Program::Pass& ps = G.passes[size_t(k)];
    ps.task = [gp, k, l, inner = std::move(ps.task)](int i, int tid) {
      if (gp->kv_ahead) gp->ask_kv(k, i, tid, l);
      inner(i, tid);
    };
  }
  if (N > 0) {
    G.head_argmax.assign(size_t(N), 0);
    // planned with an output and an argmax, which each forward points at its own (plan_linears only
    // checks them)
    LinearCall head{lm_head_, nullptr, x, embed_->out_features()};
    head.argmax = G.head_argmax.data();
    const Norm* fn = &final_norm_;
    G.head = &G.add_linear(Phase::Head, {head}, xn, H, N, H, {lm_head_}, [gp, x, H, N, fn](int tid) {
      float* y = gp->parts[size_t(tid)].xn.data();
      for (int i = 0; i < N; ++i) rmsnorm_row(x + size_t(gp->logit_rows[i]) * H, fn->w.data(), fn->eps, H, y + size_t(i) * H);
    });
  }
  G.done.reset(new Program::Counter[G.passes.size() * size_t(P)]);
  G.next.reset(new Program::Counter[G.passes.size() * size_t(P)]);
  prog_ = std::move(pg);
}

std::vector<std::vector<int32_t>> CpuModel::omnikv_selection(int f) {
  std::lock_guard<std::mutex> lock(m_);
  return omni_run_.selection(f);
}

void CpuModel::forward(int T, const int64_t* ids, const int64_t* pos, const int64_t* rows, const int64_t* out_loc,
                       int N, const int64_t* logit_rows, float* logits, const int64_t* omni_k,
                       int64_t* omni_counts, int64_t* argmax) {
  std::lock_guard<std::mutex> lock(m_);
  if (T <= 0) throw ArgError("a forward needs at least one token");
  if (blocks_.empty() || blocks_.size() % 2) throw ArgError("the model has no complete layer");
  if (!table_.table) throw ArgError("set_table() first");
  const int vocab = embed_->out_features();
  for (int t = 0; t < T; ++t) {
    if (ids[t] < 0 || ids[t] >= vocab)
      throw ArgError("token " + std::to_string(t) + ": id " + std::to_string(ids[t]) + " is outside the vocabulary");
    if (out_loc[t] < 0 || out_loc[t] >= table_.num_slots)
      throw ArgError("token " + std::to_string(t) + ": KV slot " + std::to_string(out_loc[t]) + " is outside the pool");
  }
  for (int i = 0; i < N; ++i)
    if (logit_rows[i] < 0 || logit_rows[i] >= T) throw ArgError("logit row " + std::to_string(logit_rows[i]) + " is outside the batch");
  check_attention_tokens(table_, AttnTokens{T, rows, pos});
  bool omni = false;
  if (omni_k) {
    for (int t = 0; t < T; ++t) {
      if (omni_k[t] < -1) throw ArgError("token " + std::to_string(t) + ": OmniKV budget " + std::to_string(omni_k[t]));
      omni = omni || omni_k[t] >= 0;
    }
  }
  if (omni) {
    if (!omni_) throw ArgError("a token has an OmniKV budget, but the model has no OmniKV plan (set_omnikv)");
    if (int(omni_->roles.size()) != num_layers()) throw ArgError("layers were added after set_omnikv()");
    // one token per request row: its selection is its row's, and its query fills the row's history
    std::unordered_map<int64_t, int> per_row;
    for (int t = 0; t < T; ++t) ++per_row[rows[t]];
    for (int t = 0; t < T; ++t) {
      if (omni_k[t] < 0) continue;
      if (per_row[rows[t]] != 1)
        throw ArgError("token " + std::to_string(t) + ": an OmniKV token must be the only token of its request row " +
                       std::to_string(rows[t]) + " in the batch");
      if (omni_->hist_q && rows[t] >= omni_->hist_rows)
        throw ArgError("token " + std::to_string(t) + ": request row " + std::to_string(rows[t]) +
                       " is outside the query history");
    }
  }
  for (int t = 0; t < T; ++t)
    if (pos[t] >= rope_positions_)
      throw ArgError("position " + std::to_string(pos[t]) + " is past the rotary table (" +
                     std::to_string(rope_positions_) + " positions)");
  Pool& pool = *pool_;
  x_.resize(size_t(T) * hidden_);
  xn_.resize(size_t(T) * hidden_);
  CpuProfile* prof = prof_.on ? &prof_ : nullptr;
  const auto t_forward = std::chrono::steady_clock::now();
  {
    Timed ph(prof, pool, Phase::Embed);
    for_rows(pool, T, [&](int t) { embed_->dequant_row(int(ids[t]), x_.data() + size_t(t) * hidden_); });
  }
  bool program = !omni && program_fits(T) && !pool.solo_next();
  if (program && (!prog_ || prog_->T != T || prog_->N != N || prog_->x != x_.data() || prog_->P != pool.size() ||
                  prog_->blocks != blocks_.size() || prog_->table != table_.table)) {
    try {
      build_program(T, N);
    } catch (const ArgError&) {  // shapes its tasks cannot take: the layers run
      prog_unfit_ = true;
      program = false;
    }
  }
  if (program) {
    // the decode program (model.h)
    Program& G = *prog_;
    G.pos = pos, G.rows = rows, G.out_loc = out_loc, G.logit_rows = logit_rows;
    for (int l = 0; l < num_layers(); ++l) {
      const GqaSpec& s = static_cast<GqaBlock&>(*blocks_[size_t(2 * l)]).s;
      Program::Layer& ly = G.layers[size_t(l)];
      Program::Pass& ps = G.passes[size_t(ly.pass)];
      ps.tasks = plan_attention_gqa(ly.scratch, G.P, ly.kv, AttnTokens{T, rows, pos}, ly.q.data(), s.H, s.Hkv, s.D,
                                    s.D, s.scale, ly.a.data());
      Program::even_bounds(ps.bounds, ps.tasks, G.P);
      ly.kv_bytes.resize(size_t(ps.tasks));
      if (kv_ahead_)
        for (int i = 0; i < ps.tasks; ++i) ly.kv_bytes[size_t(i)] = attention_task_bytes(ly.scratch, i);
    }
    if (N > 0) {
      G.head->calls[0].out = logits;
      G.head->calls[0].argmax = argmax ? argmax : G.head_argmax.data();
      std::fill(G.head->best.begin(), G.head->best.end(), LinearBest{});  // the tasks' argmax, from scratch
    }
    G.reset();
    G.kv_ahead = kv_ahead_;
    G.prof = prof;
    G.pool = &pool;
    pool.run(G.P, [&](int i, int) {
      G.run(i);
      if (i == 0) pool.add_inner_wait(G.wait_ns);
    });
    if (N > 0) finish_linears(*G.head);
    if (prof) prof->program_forwards += 1;
  }
  Ctx c{pool, T, pos, rows, out_loc, hidden_, x_.data(), xn_.data(), in_, table_};
  c.prof = prof;
  if (omni) {
    omni_run_.begin(omni_.get(), T, omni_k, rows, pos);
    c.omni = &omni_run_;
  }
  for (size_t i = 0; i < blocks_.size() && !program; ++i) {
    c.layer = int(i / 2);
    blocks_[i]->run(c);
  }
  if (omni_counts) {
    omni_counts[0] = omni ? omni_run_.selected() : 0;
    omni_counts[1] = omni ? omni_run_.context() : 0;
  }
  omni_run_.end();
  if (N > 0 && !program) {
    // the final norm and the LM head on the rows that need logits only
    Timed ph(prof, pool, Phase::Head);
    for (int i = 0; i < N; ++i)
      rmsnorm_row(x_.data() + size_t(logit_rows[i]) * hidden_, final_norm_.w.data(), final_norm_.eps, hidden_,
                  xn_.data() + size_t(i) * hidden_);
    prepare_input(pool, in_, xn_.data(), hidden_, N, hidden_, {lm_head_});
    LinearCall head{lm_head_, &in_, logits, vocab};
    head.argmax = argmax;
    run_linears(pool, {head}, N);
  }
  if (prof) {
    prof->forwards += 1;
    prof->forward_ns += uint64_t(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t_forward).count());
  }
}

const char* phase_name(Phase p) {
  static const char* const kNames[int(Phase::kCount)] = {
      "embed", "norm", "qkv_proj", "rope_store", "absorb", "attention", "omnikv_select", "value_up",
      "o_proj", "gate_up", "down", "router", "experts", "shared_experts", "lm_head"};
  const int i = int(p);
  return i >= 0 && i < int(Phase::kCount) ? kNames[i] : "?";
}

void CpuModel::set_profiling(bool on) {
  std::lock_guard<std::mutex> lock(m_);
  prof_.on = on;
  pool_->set_timing(on);
}

CpuProfile CpuModel::profile() {
  std::lock_guard<std::mutex> lock(m_);
  return prof_;
}

void CpuModel::reset_profile() {
  std::lock_guard<std::mutex> lock(m_);
  const bool on = prof_.on;
  prof_ = CpuProfile{};
  prof_.on = on;
}

}  // namespace cpx
