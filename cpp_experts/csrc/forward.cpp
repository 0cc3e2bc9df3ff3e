// MoE::compute: routing -> the slots' activations -> job 1 (gate and up, SiLU·mul) -> the
// intermediate's inputs -> job 2 (down) -> the routing-weighted sum per token. A "slot" is one
// (token, k) pair; slots are grouped by expert (in token order within an expert), so that every
// expert's rows are contiguous in one prepared input and each weight tile is read once for all of
// its tokens. Jobs 1 and 2 are each one run_linears list (linear_calls.h) with one call per touched
// expert over its slots' rows: the experts' QuantLinears' tiles (any weight format, the CPU's best
// kernels) in the dense layers' tasks. Those read a down weight one expert at a time, where the
// earlier tasks (64 output columns of every touched expert, summed into each token's row as they
// went) read six weights' rows in turn: on a 2-core Zen 4 VM (DeepSeek-V2-Lite's 64 Q8_0 experts,
// top-6, interleaved rounds) the layer took 3-8% less time at 1-16 tokens and ~4% at 128-1024, with
// the same output bits.
#include <algorithm>

#include "linear_calls.h"
#include "moe.h"

namespace cpx {
namespace {
constexpr int kRowChunk = 8;  // rows per task of the activation copy (slots) and of the weighted sum (tokens)
}  // namespace

void MoE::compute(const Job& job) {
  const int K = job.k ? job.k : K_;  // (validated)
  const int T = job.tokens, S = T * K;
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
      slot_tok_[size_t(slot)] = s / K;
      slot_w_[size_t(slot)] = job.weights[s];
    }
  }
  // each token's slots, in expert order (the order the weighted sum adds them in)
  tok_slots_.resize(size_t(S));
  {
    std::vector<int> filled(size_t(T), 0);
    for (int s = 0; s < S; ++s) {
      const int t = slot_tok_[size_t(s)];
      tok_slots_[size_t(t) * K + size_t(filled[size_t(t)]++)] = s;
    }
  }

  // ---- job 0: each slot's activation row (fp32), prepared once for every gate and up
  xs_.resize(size_t(S) * H_);
  pool.run((S + kRowChunk - 1) / kRowChunk, [&](int task, int) {
    for (int s = task * kRowChunk; s < std::min(S, (task + 1) * kRowChunk); ++s) {
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

  int most = 0;  // the most slots of one expert: run_linears' m
  for (int e = 0; e < E_; ++e) most = std::max(most, count_[size_t(e)]);
  std::vector<LinearCall> calls;
  // expert e's call: its slots' rows of `in` into those rows of `out` (ld values a row)
  auto add = [&](int e, const QuantLinear* op, const QuantLinear* up, const LinearInput* in, float* out, int ld) {
    LinearCall c;
    c.op = op, c.up = up, c.in = in, c.ldo = ld;
    c.row0 = offset_[size_t(e)], c.rows = count_[size_t(e)];
    c.out = out + size_t(c.row0) * ld;
    c.ep = up ? Epilogue::SiluMul : Epilogue::Store;
    calls.push_back(c);
  };

  // ---- job 1: gate and up of each touched expert, SiLU·mul, into the slots' intermediate rows
  inter_.resize(size_t(S) * I_);
  for (int e = 0; e < E_; ++e)
    if (count_[size_t(e)]) add(e, experts_[size_t(e)][0].get(), experts_[size_t(e)][1].get(), &in_x_, inter_.data(), I_);
  run_linears(pool, calls, most);
  prepare_input(pool, in_h_, inter_.data(), I_, S, I_, down_);

  // ---- job 2: down of each touched expert into the slots' output rows (xs_: job 1 has read it)
  calls.clear();
  for (int e = 0; e < E_; ++e)
    if (count_[size_t(e)]) add(e, experts_[size_t(e)][2].get(), nullptr, &in_h_, xs_.data(), H_);
  run_linears(pool, calls, most);

  // ---- each token's slots weighted and summed, in fp32 (then rounded where the output is bf16)
  if (job.out_bf16) acc_.resize(size_t(T) * H_);
  float* acc = job.out_bf16 ? acc_.data() : static_cast<float*>(job.out);
  pool.run((T + kRowChunk - 1) / kRowChunk, [&](int task, int) {
    for (int t = task * kRowChunk; t < std::min(T, (task + 1) * kRowChunk); ++t) {
      float* dst = acc + size_t(t) * H_;
      std::fill(dst, dst + H_, 0.0f);
      for (int k = 0; k < K; ++k) {
        const int s = tok_slots_[size_t(t) * K + size_t(k)];
        const float w = slot_w_[size_t(s)];
        const float* src = xs_.data() + size_t(s) * H_;
        for (int i = 0; i < H_; ++i) dst[i] += w * src[i];
      }
      if (job.out_bf16) {
        uint16_t* out = static_cast<uint16_t*>(job.out) + size_t(t) * H_;
        for (int i = 0; i < H_; ++i) out[i] = f32_to_bf16(dst[i]);
      }
    }
  });
}

}  // namespace cpx
