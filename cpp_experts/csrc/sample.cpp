// sample.h says what; executor/sampler.py's torch code is the definition each step here follows:
// `_top_k_top_p_candidates` (top_k keeps the ties of the k-th; top_k's probabilities are normalised over
// what it keeps, top_p's alone over the whole row with exp's argument clamped at -87), `_log_min_p`,
// `_first_best`. Sums are in double where torch's are in fp32, so a cumulative probability within fp32
// rounding of top_p may keep one token more or less than torch would.
//
// Per row: one vector pass divides and finds the best (and any NaN); top_k finds its k-th value in a
// heap of k fed only by blocks that beat it (the heap logprobs take their k best from); top_p sums the
// row's exponentials in a second pass, then gathers the tokens whose probability reaches 1e-4 (1e-5,
// 1e-6, 1e-8, then all, where those fall short of top_p) and sorts those alone. The noise is drawn for
// the few candidates left.
#include "sample.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "vec.h"

namespace cpx {
namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
// exp's argument is clamped here by top_p's normaliser (executor.sampler._TINY_EXP)
constexpr float kTinyExp = -87.0f;
// Rows without top_k / top_p test every token's noise against the score to beat with this much room
// for the test's fp32 arithmetic (rest_contenders says why it is enough)
constexpr float kSlack = 1e-4f;
// above the largest noise there is, -log(-log(1 - 2^-53)) = 36.74
constexpr double kNoiseMax = 36.8;

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

inline double gumbel(uint64_t key, int64_t id) { return -std::log(-std::log(noise_uniform(key, id))); }

struct Cand {
  float v;
  int32_t id;
};
inline bool before(const Cand& a, const Cand& b) { return a.v > b.v || (a.v == b.v && a.id < b.id); }

// Whether any lane of a comparison's result is set (three shuffles; the baseline build has no movemask).
CPX_INLINE bool any_lane(vec::v8i h) {
  h |= __builtin_shufflevector(h, h, 4, 5, 6, 7, 0, 1, 2, 3);
  h |= __builtin_shufflevector(h, h, 2, 3, 0, 1, 6, 7, 4, 5);
  h |= __builtin_shufflevector(h, h, 1, 0, 3, 2, 5, 4, 7, 6);
  return h[0] != 0;
}

// y = x / t over n values (kScale; else y is not written); returns the largest y, *nan set where one is NaN.
template <bool kScale>
CPX_INLINE float max_of(const float* x, float t, int n, float* y, int* nan) {
  using namespace vec;
  float m = -INFINITY;
  bool bad = false;
  int j = 0;
  if (n >= 8) {
    const v8f tt = splat(t);
    v8f m8 = splat(-INFINITY);
    v8i nan8 = {};
    for (; j + 8 <= n; j += 8) {
      const v8f v = kScale ? load(x + j) / tt : load(x + j);
      if (kScale) store(y + j, v);
      m8 = v > m8 ? v : m8;
      nan8 |= v != v;
    }
    m = hmax(m8);
    for (int i = 0; i < 8; ++i) bad = bad || nan8[i];
  }
  for (; j < n; ++j) {
    const float v = kScale ? x[j] / t : x[j];
    if (kScale) y[j] = v;
    m = v > m ? v : m;
    bad = bad || v != v;
  }
  *nan = bad;
  return m;
}
CPX_INLINE float scale_max_impl(const float* x, float t, int n, float* y, int* nan) {
  return max_of<true>(x, t, n, y, nan);
}
CPX_INLINE float row_max_impl(const float* x, int n, int* nan) { return max_of<false>(x, 1.0f, n, nullptr, nan); }
CPX_DISPATCH(float, scale_max, (const float* x, float t, int n, float* y, int* nan), (x, t, n, y, nan))
CPX_DISPATCH(float, row_max, (const float* x, int n, int* nan), (x, n, nan))

// The sum of exp(max(y - sub, -87)) over n values, y <= sub: fp32 lanes over blocks of 512, the blocks in
// double. Eight values all below sub - 40 add less than 8 e^-40 (3e-17) each to a sum of at least 1 (the
// best's): they are left out (at temperature 0.2 that is most of a real row).
CPX_INLINE double exp_sum_impl(const float* y, int n, float sub) {
  using namespace vec;
  double total = 0.0;
  int j = 0;
  const v8f s = splat(sub), lo = splat(kTinyExp), far = splat(-40.0f);
  const v16f s16 = splat16(sub), lo16 = splat16(kTinyExp);
  while (j + 16 <= n) {
    v16f acc = {};
    const int end = std::min(n, j + 512) & ~15;
    for (; j < end; j += 16) {
      const v8f a = load(y + j) - s, b = load(y + j + 8) - s;
      if (!any_lane((a >= far) | (b >= far))) continue;
      v16f v = load16(y + j) - s16;
      v = v < lo16 ? lo16 : v;
      acc += exp16(v);
    }
    total += hsum(fold(acc));
  }
  while (j + 8 <= n) {
    v8f v = load(y + j) - s;
    v = v < lo ? lo : v;
    total += hsum(exp8(v));
    j += 8;
  }
  for (; j < n; ++j) total += std::exp(std::max(y[j] - sub, kTinyExp));
  return total;
}
CPX_DISPATCH(double, exp_sum, (const float* y, int n, float sub), (y, n, sub))

// Appends (y[i], i) for every y[i] >= thr to out, 64 values a test where none reaches thr (most).
CPX_INLINE void collect_impl(const float* y, int n, float thr, std::vector<Cand>* out) {
  using namespace vec;
  int j = 0;
  const v8f t = splat(thr);
  for (; j + 64 <= n; j += 64) {
    v8i hit = load(y + j) >= t;
    for (int b = 8; b < 64; b += 8) hit |= load(y + j + b) >= t;
    if (!any_lane(hit)) continue;
    for (int i = j; i < j + 64; ++i)
      if (y[i] >= thr) out->push_back({y[i], i});
  }
  for (; j < n; ++j)
    if (y[j] >= thr) out->push_back({y[j], j});
}
CPX_DISPATCH(void, collect, (const float* y, int n, float thr, std::vector<Cand>* out), (y, n, thr, out))

// The k best of y[0..n) (k <= n) by value, then the smaller id, as a heap (`before` its order) whose front
// is the worst of them, fed by the blocks of 64 that hold a value above it (a later equal value, its id
// larger, never enters).
CPX_INLINE void best_k_impl(const float* y, int n, int k, std::vector<Cand>* heap) {
  using namespace vec;
  std::vector<Cand>& h = *heap;
  h.clear();
  for (int i = 0; i < k; ++i) h.push_back({y[i], i});
  std::make_heap(h.begin(), h.end(), before);
  auto feed = [&](int i) {
    if (y[i] > h.front().v) {
      std::pop_heap(h.begin(), h.end(), before);
      h.back() = {y[i], i};
      std::push_heap(h.begin(), h.end(), before);
    }
  };
  int j = k;
  for (; j < n && (j & 63); ++j) feed(j);
  for (; j + 64 <= n; j += 64) {
    const v8f m = splat(h.front().v);
    v8i hit = load(y + j) > m;
    for (int b = 8; b < 64; b += 8) hit |= load(y + j + b) > m;
    if (any_lane(hit))
      for (int i = j; i < j + 64; ++i) feed(i);
  }
  for (; j < n; ++j) feed(j);
}
CPX_DISPATCH(void, best_k, (const float* y, int n, int k, std::vector<Cand>* heap), (y, n, k, heap))

// The k-th largest of y[0..n) counting repeats (torch's topk value), 1 <= k < n, no NaN among them: the
// last of best_k's for small k (`heap` its room), a selection for the rest (`buf` its room).
float kth_largest(const float* y, int n, int k, std::vector<float>& buf, std::vector<Cand>& heap) {
  if (k <= 256) {
    best_k(y, n, k, &heap);
    return heap.front().v;
  }
  buf.assign(y, y + n);
  std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), std::greater<float>());
  return buf[k - 1];
}

typedef double v8d __attribute__((vector_size(64)));
CPX_INLINE v8d splat_d(double x) { return v8d{x, x, x, x, x, x, x, x}; }
CPX_INLINE float hmin(vec::v8f v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = v[i] < m ? v[i] : m;
  return m;
}

// The tokens of a row without top_k / top_p that may reach score s0 (the best token's): token i needs
// noise -log(-log(u_i)) >= d_i = s0 - y_i, that is u_i >= exp(-exp(-d_i)). Eight at a time, the test runs
// in fp32 on an upper bound of u_i (its top 24 bits, plus one) against that bound less kSlack of it,
// which covers d_i's rounding to fp32 (relative error 6e-8: 133 x that in the bound at worst, d >= -3.7)
// and expf's 2 ulp; where every d_i >= 10 the bound is above 1 - 5e-5, and u_i >= 1 - 1.5e-4 alone
// passes, without the exps; where every d_i > 36.8 no noise reaches, and the hashes are not computed.
// About 1.5e-4 of the tokens pass beyond those that can win; their exact scores then decide. Tokens that
// min_p drops (y_i - m < lmp) never pass.
CPX_INLINE void rest_contenders_impl(const float* y, int n, float m, float lmp, uint64_t key, double s0,
                                     std::vector<Cand>* out) {
  using namespace vec;
  typedef uint64_t v8q __attribute__((vector_size(64)));
  const v8q step = {1, 2, 3, 4, 5, 6, 7, 8};
  const float far_u = 1.0f - 1.5e-4f;
  v8q base = key + step * kGolden;  // key + (id + 1) * golden for ids j..j+7
  // below this no noise lifts a token to s0 (rounded down: a superset)
  float reach = float(s0 - kNoiseMax);
  if (double(reach) > s0 - kNoiseMax) reach = std::nextafter(reach, -INFINITY);
  const v8f reach8 = splat(reach);
  int j = 0;
  for (; j + 8 <= n; j += 8, base += 8 * kGolden) {
    const v8f v = load(y + j);
    if (!any_lane(v >= reach8)) continue;
    const v8f d = __builtin_convertvector(splat_d(s0) - __builtin_convertvector(v, v8d), v8f);
    v8q z = base;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z = z ^ (z >> 31);
    const v8u top = __builtin_convertvector((z >> 40) + 1, v8u);
    const v8f u = __builtin_convertvector(top, v8f) * splat(0x1p-24f);
    v8i hit;
    if (hmin(d) >= 10.0f) {
      hit = u >= splat(far_u);
    } else {
      const v8f bound = exp8(-exp8(-d));
      hit = u >= bound * splat(1.0f - kSlack);
    }
    hit &= (v - splat(m)) >= splat(lmp);
    if (!any_lane(hit)) continue;
    for (int i = 0; i < 8; ++i)
      if (hit[i]) out->push_back({y[j + i], j + i});
  }
  for (; j < n; ++j)
    if (!(y[j] - m < lmp)) out->push_back({y[j], j});
}
CPX_DISPATCH(void, rest_contenders,
             (const float* y, int n, float m, float lmp, uint64_t key, double s0, std::vector<Cand>* out),
             (y, n, m, lmp, key, s0, out))

// The best score among the first `kept` candidates (ties to the smallest id).
int64_t draw(const Cand* c, size_t kept, uint64_t key) {
  double best = -INFINITY;
  int64_t id = -1;
  for (size_t j = 0; j < kept; ++j) {
    const double s = double(c[j].v) + gumbel(key, c[j].id);
    if (id < 0 || s > best || (s == best && c[j].id < id)) {
      best = s;
      id = c[j].id;
    }
  }
  return id;
}

// How many of the sorted candidates top_p keeps: position j goes once the probability before it
// reaches p. prob(j) is candidate j's probability; false where the candidates' whole mass falls short
// (every one is kept then, and tokens beyond them may be too) or there are none.
template <class Prob>
bool top_p_cut(const std::vector<Cand>& c, float p, Prob prob, size_t* kept) {
  double cum = 0.0;
  float before_j = 0.0f;
  for (size_t j = 0; j < c.size(); ++j) {
    if (j > 0 && before_j >= p) {
      *kept = j;
      return true;
    }
    cum += prob(c[j]);
    before_j = float(cum);
  }
  *kept = c.size();
  return !c.empty() && before_j >= p;
}

int64_t sample_row(const float* x, int n, const SampleSpec& s, std::vector<float>& y, std::vector<float>& buf,
                   std::vector<Cand>& c) {
  y.resize(n);
  int nan = 0;
  const float m = scale_max(x, s.temperature, n, y.data(), &nan);
  if (nan || !std::isfinite(m)) return -1;
  const float* v = y.data();
  c.clear();
  size_t kept = 0;
  if (s.top_k >= 1 && s.top_k < n) {
    const float kth = kth_largest(v, n, int(s.top_k), buf, c);
    c.clear();
    collect(v, n, kth, &c);
    if (kth == -INFINITY)  // fewer than k finite: those alone
      c.erase(std::remove_if(c.begin(), c.end(), [](const Cand& a) { return a.v == -INFINITY; }), c.end());
    std::sort(c.begin(), c.end(), before);
    kept = c.size();
    if (s.top_p < 1.0f) {  // softmax over what top_k kept (fp32 terms, as torch's)
      const float best = c[0].v;
      double total = 0.0;
      for (const Cand& a : c) total += std::exp(a.v - best);
      const float sum = float(total);
      top_p_cut(c, s.top_p, [&](const Cand& a) { return double(std::exp(a.v - best) / sum); }, &kept);
    }
  } else if (s.top_p < 1.0f) {  // probabilities over the whole row
    const float log_total = float(std::log(float(exp_sum(v, n, m)))) + m;
    auto prob = [&](const Cand& a) { return double(std::exp(std::max(a.v - log_total, kTinyExp))); };
    bool enough = false;
    for (const float eps : {1e-4f, 1e-5f, 1e-6f, 1e-8f, 0.0f}) {
      c.clear();
      collect(v, n, eps > 0.0f ? log_total + std::log(eps) : -INFINITY, &c);
      std::sort(c.begin(), c.end(), before);
      enough = top_p_cut(c, s.top_p, prob, &kept);
      if (enough) break;
    }
  } else {  // every token: those whose noise may lift them to the best token's score, then their scores
    const int best = int(std::find(v, v + n, m) - v);
    rest_contenders(v, n, m, s.log_min_p, s.key, double(m) + gumbel(s.key, best), &c);
    return draw(c.data(), c.size(), s.key);
  }
  if (s.log_min_p > -INFINITY)  // min_p: more than log(min_p) below the row's best (m), the survivors kept in order
    kept = size_t(std::remove_if(c.begin(), c.begin() + kept, [&](const Cand& a) { return a.v - m < s.log_min_p; }) -
                  c.begin());
  return draw(c.data(), kept, s.key);
}


}  // namespace

double noise_uniform(uint64_t key, int64_t id) {
  const uint64_t h = mix64(key + uint64_t(id + 1) * kGolden);
  return double((h >> 12) * 2 + 1) * 0x1p-53;
}

void noise_uniforms(const uint64_t* keys, int64_t rows, const int64_t* ids, int64_t width, double* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < width; ++j)
      out[r * width + j] = noise_uniform(keys[r], ids ? ids[r * width + j] : j);
}

void sample_rows(const float* x, int64_t stride, int64_t vocab, const std::vector<SampleSpec>& specs, int64_t* out) {
  thread_local std::vector<float> y, buf;
  thread_local std::vector<Cand> c;
  for (size_t i = 0; i < specs.size(); ++i)
    out[i] = sample_row(x + specs[i].row * stride, int(vocab), specs[i], y, buf, c);
}

void row_logprobs(const float* x, int64_t stride, int64_t vocab, const std::vector<int64_t>& rows,
                  const std::vector<int64_t>& targets, int k, float* logprob, int64_t* top_ids, float* top_values,
                  int32_t* top_count, uint8_t* ok) {
  thread_local std::vector<Cand> c;
  const int n = int(vocab);
  const int kk = std::min(k, n);
  for (size_t i = 0; i < rows.size(); ++i) {
    const float* y = x + rows[i] * stride;
    int nan = 0;
    const float m = row_max(y, n, &nan);
    ok[i] = !nan && std::isfinite(m);
    top_count[i] = 0;
    if (!ok[i]) continue;
    // log_softmax = y - m - log(sum exp(y - m)), in double before the fp32 result
    const double log_sum = std::log(exp_sum(y, n, m));
    logprob[i] = float(double(y[targets[i]]) - double(m) - log_sum);
    if (kk <= 0) continue;
    best_k(y, n, kk, &c);
    std::sort(c.begin(), c.end(), before);  // best first
    int32_t count = 0;
    for (const Cand& a : c) {
      if (a.v == -INFINITY) break;
      top_ids[i * k + count] = a.id;
      top_values[i * k + count] = float(double(a.v) - double(m) - log_sum);
      ++count;
    }
    top_count[i] = count;
  }
}

}  // namespace cpx
