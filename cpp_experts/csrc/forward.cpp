// MoE::compute: routing -> the slots' activations -> job 1 (gate and up, SiLU·mul) -> the
// intermediate's inputs -> job 2 (down and the weighted sum per token). A "slot" is one (token, k)
// pair; slots are grouped by expert (in token order within an expert), so that every expert's rows
// are contiguous in one prepared input and each weight tile is read once for all of its tokens.
// The tiles themselves are the experts' QuantLinears' (any weight format, the CPU's best kernels).
#include <algorithm>

#include "moe.h"
#include "vec.h"

namespace cpx {
namespace {
constexpr int kRowBlocks = 4;   // 64 output rows per task
constexpr int kTokChunk = 64;   // slots per task (bounds the per-thread tiles)
constexpr int kCopyChunk = 8;   // slots per activation-copy task

struct Task1 {
  int e, rb0, rb1, s0, s1;  // expert, rowblocks of I, slot range
};

thread_local std::vector<float> t_tiles;

// h[i] = silu(g[i]) * u[i] over nt rows of n values (g, u with row stride ldc; h with row stride ldh).
CPX_INLINE void silu_mul_rows_impl(const float* g, const float* u, int ldc, int nt, int n, float* h, size_t ldh) {
  using namespace vec;
  for (int t = 0; t < nt; ++t) {
    const float* gr = g + size_t(t) * ldc;
    const float* ur = u + size_t(t) * ldc;
    float* hr = h + size_t(t) * ldh;
    int j = 0;
    for (; j + 8 <= n; j += 8) store(hr + j, silu8(load(gr + j)) * load(ur + j));
    for (; j < n; ++j) hr[j] = gr[j] / (1.0f + exp1(-gr[j])) * ur[j];
  }
}
CPX_DISPATCH(void, silu_mul_rows, (const float* g, const float* u, int ldc, int nt, int n, float* h, size_t ldh),
             (g, u, ldc, nt, n, h, ldh))

}  // namespace

void MoE::compute(const Job& job) {
  const int T = job.tokens, S = T * K_;
  if (T == 0) return;
  Pool& pool = *pool_;

  // ---- routing: counting sort of slots by expert (stable, so token order within an expert)
  count_.assign(size_t(E_), 0);
  offset_.assign(size_t(E_) + 1, 0);
  slot_tok_.resize(size_t(S));
  slot_w_.resize(size_t(S));
  for (int s = 0; s < S; ++s) ++count_[size_t(job.ids[s])];
  for (int e = 0; e < E_; ++e) offset_[size_t(e) + 1] = offset_[size_t(e)] + count_[size_t(e)];
  {
    std::vector<int> fill(offset_.begin(), offset_.end() - 1);
    for (int s = 0; s < S; ++s) {
      const int slot = fill[size_t(job.ids[s])]++;
      slot_tok_[size_t(slot)] = s / K_;
      slot_w_[size_t(slot)] = job.weights[s];
    }
  }

  // ---- job 0: each slot's activation row (fp32), prepared once for every gate and up
  xs_.resize(size_t(S) * H_);
  pool.run((S + kCopyChunk - 1) / kCopyChunk, [&](int task, int) {
    for (int s = task * kCopyChunk; s < std::min(S, (task + 1) * kCopyChunk); ++s) {
      const size_t t = size_t(slot_tok_[size_t(s)]);
      float* dst = xs_.data() + size_t(s) * H_;
      if (job.hidden_bf16) {
        const uint16_t* src = static_cast<const uint16_t*>(job.hidden) + t * H_;
        for (int i = 0; i < H_; ++i) dst[i] = bf16_to_f32(src[i]);
      } else {
        std::memcpy(dst, static_cast<const float*>(job.hidden) + t * H_, size_t(H_) * 4);
      }
    }
  });
  prepare_input(pool, in_x_, xs_.data(), H_, S, H_, gate_up_);

  // ---- job 1: for every (expert, 64 rows of I, up to 64 of its slots): gate and up, SiLU·mul
  std::vector<Task1> tasks1;
  for (int e = 0; e < E_; ++e) {
    const int s0 = offset_[size_t(e)], s1 = offset_[size_t(e) + 1];
    const int nrb = experts_[size_t(e)][0]->rowblocks();
    for (int rb = 0; rb < nrb; rb += kRowBlocks)
      for (int s = s0; s < s1; s += kTokChunk) tasks1.push_back({e, rb, std::min(nrb, rb + kRowBlocks), s, std::min(s1, s + kTokChunk)});
  }
  constexpr int ldc = kRowBlocks * 16;
  constexpr size_t tile = size_t(kTokChunk) * ldc;
  inter_.resize(size_t(S) * I_);
  pool.run(int(tasks1.size()), [&](int task, int) {
    const Task1& tk = tasks1[size_t(task)];
    if (t_tiles.size() < 2 * tile) t_tiles.resize(2 * tile);
    float* cg = t_tiles.data();
    float* cu = cg + tile;
    const Expert& ex = experts_[size_t(tk.e)];
    const int n = tk.s1 - tk.s0;
    ex[0]->tile(in_x_, tk.rb0, tk.rb1, tk.s0, n, cg, ldc);
    ex[1]->tile(in_x_, tk.rb0, tk.rb1, tk.s0, n, cu, ldc);
    const int n0 = tk.rb0 * 16, ncols = std::min(I_, tk.rb1 * 16) - n0;
    silu_mul_rows(cg, cu, ldc, n, ncols, inter_.data() + size_t(tk.s0) * I_ + n0, size_t(I_));
  });
  prepare_input(pool, in_h_, inter_.data(), I_, S, I_, down_);

  // ---- job 2: for every (64 columns of H, token range): down projection of every expert's slots
  // of those tokens, weighted and summed into the token's output row (disjoint per task).
  const int ncol = (H_ + ldc - 1) / ldc;
  const int nthreads = pool.size();
  const int ntc = std::min(T, std::max(1, (4 * nthreads + ncol - 1) / ncol));
  float* acc = static_cast<float*>(job.out);
  if (job.out_bf16) {
    acc_.resize(size_t(T) * H_);
    acc = acc_.data();
  }
  pool.run(ncol * ntc, [&](int task, int) {
    const int c0 = (task % ncol) * ldc, c1 = std::min(c0 + ldc, H_);
    const int t0 = int(int64_t(T) * (task / ncol) / ntc), t1 = int(int64_t(T) * (task / ncol + 1) / ntc);
    for (int t = t0; t < t1; ++t) std::fill(acc + size_t(t) * H_ + c0, acc + size_t(t) * H_ + c1, 0.0f);
    if (t_tiles.size() < tile) t_tiles.resize(2 * tile);
    float* cd = t_tiles.data();
    for (int e = 0; e < E_; ++e) {
      const auto b = slot_tok_.begin();
      const int s0 = int(std::lower_bound(b + offset_[size_t(e)], b + offset_[size_t(e) + 1], t0) - b);
      const int s1 = int(std::lower_bound(b + s0, b + offset_[size_t(e) + 1], t1) - b);
      for (int s = s0; s < s1; s += kTokChunk) {
        const int n = std::min(kTokChunk, s1 - s);
        experts_[size_t(e)][2]->tile(in_h_, c0 / 16, (c1 + 15) / 16, s, n, cd, ldc);
        for (int i = 0; i < n; ++i) {
          const float w = slot_w_[size_t(s + i)];
          float* dst = acc + size_t(slot_tok_[size_t(s + i)]) * H_;
          const float* src = cd + size_t(i) * ldc - c0;
          for (int c = c0; c < c1; ++c) dst[c] += w * src[c];
        }
      }
    }
    if (job.out_bf16) {
      uint16_t* out = static_cast<uint16_t*>(job.out);
      for (int t = t0; t < t1; ++t)
        for (int c = c0; c < c1; ++c) out[size_t(t) * H_ + c] = f32_to_bf16(acc[size_t(t) * H_ + c]);
    }
  });
}

}  // namespace cpx
