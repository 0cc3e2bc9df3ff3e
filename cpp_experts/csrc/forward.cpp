// MoE::compute: routing -> per-slot activations -> job 1 (gate+up, SiLU·mul) -> job 2 (down and
// the weighted sum per token). A "slot" is one (token, k) pair; slots are grouped by expert (in
// token order within an expert) so that every expert's activations are contiguous rows.
#include <algorithm>

#include "moe.h"

namespace cpx {
namespace {
constexpr int kRowBlock = 64;   // output rows per task
constexpr int kTokChunk = 128;  // tokens per kernel call (bounds the per-thread scratch)
constexpr int kAmxMinTokens = 5;
constexpr int kActChunk = 8;    // slots per activation-conversion task

struct Task1 {
  int e, n0, s0, s1;  // expert, first row of I, slot range
};
}  // namespace

void MoE::compute(const Job& job) {
  const int T = job.tokens, S = T * K_;
  if (T == 0) return;
  const bool quant = fmt_ != Format::BF16;
  const int nthreads = pool_->size();

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

  // ---- buffers
  if (quant) {
    act_.resize(size_t(S) * Hp_);
    act_d_.resize(size_t(S) * (Hp_ / 32) * 4);
    act_s_.resize(size_t(S) * (Hp_ / 32) * 4);
    inter_.resize(size_t(S) * Ip_);
    inter_d_.resize(size_t(S) * (Ip_ / 32) * 4);
    inter_s_.resize(size_t(S) * (Ip_ / 32) * 4);
  } else {
    act_.resize(size_t(S) * Hp_ * 2);
    inter_.resize(size_t(S) * Ip_ * 2);
  }
  if (job.out_bf16) acc_.resize(size_t(T) * H_ * 4);
  for (auto& sc : scratch_) sc.resize(size_t(2) * kTokChunk * kRowBlock + size_t(std::max(Hp_, Ip_)));
  const QAct act_q{reinterpret_cast<int8_t*>(act_.data()), reinterpret_cast<float*>(act_d_.data()),
                   reinterpret_cast<int32_t*>(act_s_.data()), Hp_};
  const QAct inter_q{reinterpret_cast<int8_t*>(inter_.data()), reinterpret_cast<float*>(inter_d_.data()),
                     reinterpret_cast<int32_t*>(inter_s_.data()), Ip_};
  uint16_t* act_b = reinterpret_cast<uint16_t*>(act_.data());
  uint16_t* inter_b = reinterpret_cast<uint16_t*>(inter_.data());

  // ---- job 0: each slot's activation row in the kernel's format (bf16, or Q8_0 per 32)
  pool_->run((S + kActChunk - 1) / kActChunk, [&](int task, int tid) {
    float* row = scratch_[size_t(tid)].data() + size_t(2) * kTokChunk * kRowBlock;
    for (int s = task * kActChunk; s < std::min(S, (task + 1) * kActChunk); ++s) {
      const size_t t = size_t(slot_tok_[size_t(s)]);
      if (!quant && job.hidden_bf16) {
        uint16_t* dst = act_b + size_t(s) * Hp_;
        std::memcpy(dst, static_cast<const uint16_t*>(job.hidden) + t * H_, size_t(H_) * 2);
        std::fill(dst + H_, dst + Hp_, uint16_t(0));
        continue;
      }
      for (int i = 0; i < H_; ++i)
        row[i] = job.hidden_bf16 ? bf16_to_f32(static_cast<const uint16_t*>(job.hidden)[t * H_ + i])
                                 : static_cast<const float*>(job.hidden)[t * H_ + i];
      std::fill(row + H_, row + Hp_, 0.0f);
      if (quant) {
        quantize_row_q8(row, Hp_, act_q.q + size_t(s) * Hp_, act_q.d + size_t(s) * (Hp_ / 32),
                        act_q.sum + size_t(s) * (Hp_ / 32));
      } else {
        uint16_t* dst = act_b + size_t(s) * Hp_;
        for (int i = 0; i < Hp_; ++i) dst[i] = f32_to_bf16(row[i]);
      }
    }
  });

  // ---- job 1: for every (expert, 64 rows of I, up to 128 of its slots): gate and up, SiLU·mul
  std::vector<Task1> tasks1;
  for (int e = 0; e < E_; ++e) {
    const int s0 = offset_[size_t(e)], s1 = offset_[size_t(e) + 1];
    for (int n0 = 0; n0 < Ip_; n0 += kRowBlock)
      for (int s = s0; s < s1; s += kTokChunk) tasks1.push_back({e, n0, s, std::min(s1, s + kTokChunk)});
  }
  auto gemm = [&](const Mat& m, int rb0, int nrb, int row0, int n, int expert_tokens, const uint16_t* ab,
                  const QAct& aq, int lda, float* c, int ldc) {
    if (quant) {
      kern_->gemm_q(m, rb0, nrb, aq, row0, n, c, ldc);
    } else if (amx_ && expert_tokens >= kAmxMinTokens) {
      amx_gemm_bf16(m, rb0, nrb, ab + size_t(row0) * lda, size_t(lda), n, c, ldc);
    } else {
      kern_->gemm_bf16(m, rb0, nrb, ab + size_t(row0) * lda, size_t(lda), n, c, ldc);
    }
  };
  pool_->run(int(tasks1.size()), [&](int task, int tid) {
    const Task1& tk = tasks1[size_t(task)];
    const int nb = std::min(kRowBlock, Ip_ - tk.n0), n = tk.s1 - tk.s0;
    const int tokens = count_[size_t(tk.e)];
    float* cg = scratch_[size_t(tid)].data();
    float* cu = cg + size_t(kTokChunk) * kRowBlock;
    gemm(mat(tk.e, 0), tk.n0 / 16, nb / 16, tk.s0, n, tokens, act_b, act_q, Hp_, cg, kRowBlock);
    gemm(mat(tk.e, 1), tk.n0 / 16, nb / 16, tk.s0, n, tokens, act_b, act_q, Hp_, cu, kRowBlock);
    for (int i = 0; i < n; ++i) {
      float* h = cg + size_t(i) * kRowBlock;
      kern_->silu_mul(h, cu + size_t(i) * kRowBlock, h, nb);
      const size_t s = size_t(tk.s0 + i);
      if (quant) {
        quantize_row_q8(h, nb, inter_q.q + s * Ip_ + tk.n0, inter_q.d + s * (Ip_ / 32) + tk.n0 / 32,
                        inter_q.sum + s * (Ip_ / 32) + tk.n0 / 32);
      } else {
        uint16_t* dst = inter_b + s * Ip_ + tk.n0;
        for (int j = 0; j < nb; ++j) dst[j] = f32_to_bf16(h[j]);
      }
    }
  });

  // ---- job 2: for every (64 columns of H, token range): down projection of every expert's slots
  // of those tokens, weighted and summed into the token's output row (disjoint per task).
  const int ncol = (Hp_ + kRowBlock - 1) / kRowBlock;
  const int ntc = std::min(T, std::max(1, (4 * nthreads + ncol - 1) / ncol));
  float* acc = job.out_bf16 ? reinterpret_cast<float*>(acc_.data()) : static_cast<float*>(job.out);
  pool_->run(ncol * ntc, [&](int task, int tid) {
    const int c0 = (task % ncol) * kRowBlock, nc = std::min(kRowBlock, Hp_ - c0);
    const int c1 = std::min(c0 + nc, H_);
    const int t0 = int(int64_t(T) * (task / ncol) / ntc), t1 = int(int64_t(T) * (task / ncol + 1) / ntc);
    for (int t = t0; t < t1; ++t) std::fill(acc + size_t(t) * H_ + c0, acc + size_t(t) * H_ + c1, 0.0f);
    float* cd = scratch_[size_t(tid)].data();
    for (int e = 0; e < E_; ++e) {
      const auto b = slot_tok_.begin();
      const int s0 = int(std::lower_bound(b + offset_[size_t(e)], b + offset_[size_t(e) + 1], t0) - b);
      const int s1 = int(std::lower_bound(b + s0, b + offset_[size_t(e) + 1], t1) - b);
      for (int s = s0; s < s1; s += kTokChunk) {
        const int n = std::min(kTokChunk, s1 - s);
        gemm(mat(e, 2), c0 / 16, nc / 16, s, n, count_[size_t(e)], inter_b, inter_q, Ip_, cd, kRowBlock);
        for (int i = 0; i < n; ++i) {
          const float w = slot_w_[size_t(s + i)];
          float* dst = acc + size_t(slot_tok_[size_t(s + i)]) * H_;
          const float* src = cd + size_t(i) * kRowBlock - c0;
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
