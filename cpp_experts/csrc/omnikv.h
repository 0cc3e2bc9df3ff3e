// OmniKV (ICLR 2025) in the native forward: filter layers choose, for each sparse decode token, the
// few KV slots the layers below them attend to. models/omnikv_config.py defines the selection; the
// torch reference is kernels/attention/omnikv.py (`importance`, `select_positions`, `QueryHistory`).
//
// An omni token is a decode token with a budget k, alone in its request row in the batch. Per forward:
//   FILTER layer f, after its (full) attention: the token's query — the one attention used: RoPE'd q
//     [H][D] (GQA), or q_nope·w_kc ‖ RoPE'd q_pe [H][r + P] (MLA) — is recorded in the query history
//     at entry pos % W; the window is the row's recorded queries of positions pos-W+1..pos (oldest
//     first) with the alpha weights of the count present; importance(j) = sum_i alpha_i · max_h
//     softmax_j(scale · q_ih·k_j) over the positions 0..p_i query i saw; kept: the sinks, the recent
//     ones and the k most important between them (score desc, then position asc: a strict order, so
//     the set never depends on the thread count), ascending, as KV slots.
//   SPARSE layer: the token attends to its filter's slots only (attention.h: AttnTokens::sel).
// Scoring runs on the pool over (token, key block) tasks: scores and each block's softmax state (m, l),
// then per token the merge of the blocks' states, then importance per key, then the selection per
// token. Key blocks depend on the context length alone (a token's importances do not depend on the
// batch). Scores are kept between the passes: window × heads × context floats per token, the tokens
// of one forward taken in chunks that bound that memory.
// Where the window is the current query alone (W = 1, or `last_token` weights), the filter layer's
// own attention already computes those probabilities: `attach` hands it a dump (AttnTokens::dump) to
// write them to, and `select` takes the importance from there instead of reading and scoring the
// keys again (on SmolLM2 at an 8K context on a 2-core Zen 5, that scoring was ~10% of an OmniKV
// decode step). The same probabilities, summed in the attention's order: equal up to rounding.
#pragma once
#include <cstdint>
#include <vector>

#include "attention.h"
#include "pool.h"

namespace cpx {

enum class Alpha { LastToken = 0, Uniform = 1, Exponential = 2 };  // OmniKVConfig.alpha_weights
constexpr int kRoleFull = 0, kRoleFilter = 1, kRoleSparse = 2;     // LayerPlan.roles
constexpr int kMaxOmniWindow = 16;                                 // omnikv_config.MAX_WINDOW
constexpr size_t kMaxDumpFloats = size_t(1) << 26;  // attention dumps of one filter layer at most (256 MiB)

struct OmniSpec {
  std::vector<int> roles;   // per layer
  std::vector<int> source;  // per layer: the filter (index among filter layers) a SPARSE layer reads
  std::vector<int> filter_of;  // per layer: its index among the filter layers (FILTER layers), else -1
  int num_filters = 0;
  int64_t sink = 0, recent = 1;
  Alpha alpha = Alpha::LastToken;
  // the query history (QueryHistory): q [rows][F][W][H][D] fp32, pos [rows][F][W] (-1: empty); null: no
  // history (W = 1, the current query alone)
  int window = 1;
  float* hist_q = nullptr;
  int64_t* hist_pos = nullptr;
  int64_t hist_rows = 0;
  int H = 0, D = 0;
};

// One omni token's scoring at one filter layer.
struct OmniItem {
  int t = 0, u = 0;  // batch token, omni token index
  int64_t row = 0, pos = 0, n = 0, k = 0;
  int nw = 0;  // window queries scored (those of weight 0 are left out)
  const float* q[kMaxOmniWindow];
  int64_t qpos[kMaxOmniWindow];
  float alpha[kMaxOmniWindow];
  int nb = 1;       // key blocks
  int64_t bs = 0;   // keys per block (a multiple of 16)
  size_t s_off = 0, st_off = 0, imp_off = 0;  // scores [nw][H][n], block states [nb][nw][H][2], importance [n]
};

// One forward's omni tokens and their selections; the model owns one and reuses its buffers.
class OmniRun {
 public:
  // Starts a forward: omni_k[t] >= 0 marks token t an omni token with that budget (already checked).
  void begin(const OmniSpec* spec, int T, const int64_t* omni_k, const int64_t* rows, const int64_t* pos);
  bool active() const { return spec_ != nullptr; }
  void end() { spec_ = nullptr; }
  int role(int layer) const { return spec_->roles[size_t(layer)]; }
  // At a SPARSE layer: the omni tokens read their filter's selection. At a FILTER layer of H heads
  // whose window is the current query alone: the omni tokens' attention dumps (AttnTokens::dump), when
  // they fit kMaxDumpFloats.
  void attach(int layer, AttnTokens& tok, int H);
  // At a FILTER layer, after its attention: q [T][H][D] the layer's queries, kv its cache and the table.
  void select(Pool& pool, int layer, const PagedKv& kv, const float* q, int H, int Hkv, int D, float scale);
  int64_t selected() const { return selected_; }  // positions kept, summed over filter layers and tokens
  int64_t context() const { return context_; }    // their contexts (pos + 1), summed alike
  // The last forward's selection at filter f of each omni token, in batch order (tests, debugging).
  std::vector<std::vector<int32_t>> selection(int f) const;

 private:
  const OmniSpec* spec_ = nullptr;
  int filters_ = 0;  // of the last forward with omni tokens
  int T_ = 0;
  std::vector<int> tok_;      // batch token of each omni token
  std::vector<int64_t> k_, row_, pos_;
  std::vector<std::vector<int32_t>> sel_;  // [f * tokens + u]: kept slots, ascending positions
  std::vector<std::vector<const int32_t*>> sel_ptr_;  // per filter: [T] (null: not an omni token)
  std::vector<std::vector<int64_t>> sel_n_;
  std::vector<OmniItem> items_;
  std::vector<float> scores_, states_, imp_;
  std::vector<float> dump_;          // the omni tokens' attention dumps at the current filter layer
  std::vector<float*> dump_ptr_;     // [T] (null: not an omni token)
  std::vector<size_t> dump_off_;     // per omni token: its dump's offset in dump_
  int dump_layer_ = -1, dump_H_ = 0;  // the filter layer the dumps are for (-1: none)
  std::vector<std::vector<float>> thread_f_;    // per participant: a key row widened to fp32
  std::vector<std::vector<int32_t>> thread_i_;  // per participant: candidate positions
  int64_t selected_ = 0, context_ = 0;
};

}  // namespace cpx
