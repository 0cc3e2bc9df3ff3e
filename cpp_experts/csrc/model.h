// CpuModel: a whole decoder forward on the CPU in one call — the CPU counterpart of a captured CUDA
// graph. The Python side builds it once from a loaded model (its QuantLinears, norm weights, rotary
// table, MoE operators) and the executor's pools (the KV buffers and req_to_token), then calls
// `forward` for every batch: decode, prefill, chunked prefill or a mix, since attention reads every
// token's keys through req_to_token after the batch's own K/V are stored (attention.h).
//
//   x = embed(ids)                                    rows of the embedding, decoded from its blocks
//   per layer:  x += attention(rmsnorm(x))            GQA (Llama) or MLA (DeepSeek, absorbed)
//               x += mlp(rmsnorm(x))                  gated MLP, or MoE (router, routed experts, shared)
//   logits = lm_head(rmsnorm(x[logit rows]))
//
// Activations stay fp32 from the embedding to the logits (the linears quantise their inputs per 32
// values for int8 dot products, or round them to bf16, as their weight format asks). Every linear
// layer and the attention run on the one worker pool; the linears that read the same input run in
// one pass of the pool (linear_calls.h). Objects given to the model (operators, caches, the table)
// must outlive it; the Python wrapper holds them.
//
// OmniKV (omnikv.h), after `set_omnikv`: a forward may mark decode tokens (each the only token of its
// request row in the batch) with a budget k. At each FILTER layer, after its full attention, those
// tokens' queries go into the query history and each gets its selection (sinks, recent, top-k by
// importance) as KV slots; at each SPARSE layer they attend to the selection of the layer's filter,
// every other token as before. Selections live for the forward only. The forward reports the kept
// and the context positions, summed over filter layers and tokens.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "attention.h"
#include "linear_calls.h"
#include "moe.h"
#include "omnikv.h"
#include "pool.h"

namespace cpx {

// RoPE over the first `dim` values of each head: pairs (2i, 2i+1) when interleaved (DeepSeek), else
// (i, i + dim/2) (Llama), rotated by the angle of the position in the fp32 table
// cos_sin [2][max_pos][dim/2] (cos, then sin; YaRN's attention factor already applied).
struct Rope {
  const float* cos_sin = nullptr;
  int64_t max_pos = 0;
  int dim = 0;
  bool interleaved = false;
};

struct Norm {
  std::vector<float> w;
  float eps = 1e-6f;
};

struct GqaSpec {
  Norm norm;
  const QuantLinear *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;
  int H = 0, Hkv = 0, D = 0;  // query heads, KV heads, head dim (of K and V)
  float scale = 1.0f;
  Rope rope;
  Norm q_norm, k_norm;  // Qwen3: an RMSNorm over each query / key head before RoPE (weights [D]); empty: none
  void* k_cache = nullptr;  // [slots][Hkv][D]
  void* v_cache = nullptr;
  KvType kv_type = KvType::F32;
};

struct MlaSpec {
  Norm norm;
  const QuantLinear* q = nullptr;  // q_proj, or (q-LoRA) q_a -> q_a_norm -> q_b
  const QuantLinear* q_a = nullptr;
  Norm q_a_norm;
  const QuantLinear* q_b = nullptr;
  const QuantLinear* kv_a = nullptr;  // -> c_kv [r] ‖ k_pe [P]
  Norm kv_norm;
  std::vector<const QuantLinear*> w_kc;  // per head: [r out][N in]
  std::vector<const QuantLinear*> w_vc;  // per head: [V out][r in]
  const QuantLinear* o = nullptr;
  int H = 0, N = 0, P = 0, V = 0, r = 0;  // heads, nope dim, rope dim, value dim, kv_lora_rank
  float scale = 1.0f;
  Rope rope;  // dim == P (interleaved in DeepSeek's checkpoints)
  void* latent = nullptr;  // [slots][r + P]
  KvType kv_type = KvType::F32;
};

struct DenseMlpSpec {
  Norm norm;
  const QuantLinear *gate = nullptr, *up = nullptr, *down = nullptr;
};

enum class TopkMethod { Greedy = 0, GroupLimitedGreedy = 1, NoauxTc = 2 };

struct MoeSpec {
  Norm norm;
  std::vector<float> router;  // [E][hidden] fp32
  std::vector<float> bias;    // [E] score correction (noaux_tc), or empty
  int E = 0, K = 0;
  bool sigmoid = false;
  TopkMethod method = TopkMethod::Greedy;
  int n_group = 1, topk_group = 1;
  bool norm_topk = false;
  float scaling = 1.0f;
  MoE* experts = nullptr;
  const QuantLinear *shared_gate = nullptr, *shared_up = nullptr, *shared_down = nullptr;  // null: none
  std::vector<float> shared_scale;  // [hidden]: Qwen2-MoE's gate, the shared output times sigmoid(x·w); empty: none
};

// Where a forward's time goes, phase by phase, measured on the calling thread when asked
// (CpuModel::set_profiling; off, a phase costs one branch). A phase's time includes the caller's
// serial work in it (norms, quantising the linears' input, RoPE) and its waits for the pool; the
// pool's counters say how many parallel runs it made and how long the caller waited after its own
// share of them (the runs' imbalance). Decode has no other way to show this: the passes are tens of
// microseconds, below a sampling profiler's resolution, and a VM has no hardware counters.
enum class Phase : int {
  Embed,      // the tokens' embedding rows
  Norm,       // the blocks' input RMSNorms
  QkvProj,    // q, k, v (MLA: q or q_a -> q_b, and kv_a), their input quantised
  RopeStore,  // RoPE and the new tokens' K/V (latent) into the cache
  Absorb,     // MLA: q_nope through w_kc
  Attention,  // attention over the cache
  Select,     // OmniKV: a filter layer's selections
  ValueUp,    // MLA: the latent output through w_vc
  OProj,      // o_proj (added into the residual)
  GateUp,     // gate and up, SiLU(gate) * up
  Down,       // down_proj (added into the residual)
  Router,     // MoE: router logits and top-k
  Experts,    // MoE: the routed experts
  Shared,     // MoE: the shared experts
  Head,       // final norm and the LM head (and its argmax)
  kCount
};
const char* phase_name(Phase p);

struct PhaseStat {
  uint64_t calls = 0, ns = 0;        // times the phase ran, its wall time on the caller
  uint64_t pool_runs = 0, wait_ns = 0;  // its parallel pool runs, the caller's wait after its share
};

struct CpuProfile {
  bool on = false;
  uint64_t forwards = 0, forward_ns = 0;
  uint64_t program_forwards = 0;  // of them, run as the decode program (its norms and RoPE are counted in
                                  // the q·k·v and gate·up passes that do them)
  PhaseStat phase[int(Phase::kCount)];
};

struct Block;

class CpuModel {
 public:
  // `embed`: the token embedding as a [vocab][hidden] QuantLinear (its rows are decoded per token);
  // `lm_head`: [vocab][hidden] (the same operator when the embedding is tied).
  CpuModel(std::shared_ptr<Pool> pool, int hidden, const QuantLinear* embed, const QuantLinear* lm_head,
           Norm final_norm);
  ~CpuModel();
  // req_to_token [rows][stride] (int32) and the number of KV slots every layer's cache holds.
  void set_table(const int32_t* table, int64_t rows, int64_t stride, int64_t num_slots);
  void add_gqa(GqaSpec s);
  void add_mla(MlaSpec s);
  void add_dense_mlp(DenseMlpSpec s);
  void add_moe(MoeSpec s);
  // OmniKV's plan (after every layer): roles and sources per layer, sinks, recent, alpha, and the
  // query history (hist_q/hist_pos null: none, the current query alone); checks it against the layers.
  void set_omnikv(OmniSpec s);
  // T tokens: ids, positions, req_to_token rows and KV slots (the slots already recorded in the
  // table); logits [N][vocab] fp32 for the token indices `logit_rows`. omni_k (null, or [T]): the
  // OmniKV budget of each token, -1 for a token attending fully; omni_counts (null, or [2]): the
  // positions kept and the context positions, summed over filter layers and omni tokens; argmax (null,
  // or [N]): each logits row's argmax, found by the LM head's tasks as they write it (linear_calls.h).
  void forward(int T, const int64_t* ids, const int64_t* pos, const int64_t* rows, const int64_t* out_loc, int N,
               const int64_t* logit_rows, float* logits, const int64_t* omni_k = nullptr,
               int64_t* omni_counts = nullptr, int64_t* argmax = nullptr);
  int num_layers() const { return int(blocks_.size()) / 2; }
  // The last OmniKV forward's slots kept at filter f, per omni token in batch order.
  std::vector<std::vector<int32_t>> omnikv_selection(int f);
  // Whether a decode forward of a dense GQA model may run as one program of its passes on every
  // participant of the pool (below; on by default). Off, every pass is a run of the pool, as a prefill
  // is: benchmarks time the two in one process.
  void set_decode_program(bool on);
  bool decode_program();
  // Whether the decode program asks for each layer's KV rows while the layer before it runs
  // (Program::ask_kv; on by default, the same bits either way): benchmarks switch it to compare.
  void set_kv_ahead(bool on);
  bool kv_ahead();
  // Phase timing of the forwards from now on (on), or off; the totals so far, and zeroing them.
  void set_profiling(bool on);
  CpuProfile profile();
  void reset_profile();

 private:
  std::shared_ptr<Pool> pool_;
  int hidden_;
  const QuantLinear* embed_;
  const QuantLinear* lm_head_;
  Norm final_norm_;
  PagedKv table_;  // the table part; blocks fill in their caches
  std::vector<std::unique_ptr<Block>> blocks_;
  std::mutex m_;  // one forward at a time (the scratch)
  std::vector<float> x_, xn_;
  LinearInput in_;
  std::unique_ptr<OmniSpec> omni_;  // null: no OmniKV plan
  int64_t rope_positions_ = INT64_MAX;  // the shortest rotary table of any layer (checked per forward)
  OmniRun omni_run_;
  CpuProfile prof_;  // guarded by m_
  bool kv_ahead_ = true;  // set_kv_ahead
  // The decode program: a forward of at most kGroupStreamRows tokens (a decode batch of a few requests)
  // through GQA attention and dense MLP blocks, without OmniKV tokens, while the pool is not in a solo
  // period. Every participant of one run of the pool walks the same list of passes (a
  // layer's q·k·v with RoPE and the KV store, or, for a head size its column groups cut, q·k·v then a
  // RoPE and store pass; attention, o, gate·up, down; then the LM head), each
  // pass's tasks split into one range per participant with work stealing, and the participants'
  // counts of done tasks (each on its own line) as the barrier between passes. The serial work between
  // passes (a norm, quantising a linear's input) is done by every participant for itself, except where
  // the tasks of the pass before can do it as they write their outputs: o's input is quantised by the
  // attention tasks, down's by gate·up's (one shared input, filled a block at a time). Why: with a run
  // of the pool per pass the worker waited while the caller did that work and then had to fetch what
  // the caller had just written (the run's task list, its input) a cache miss at a time, and on a VM
  // whose two vCPUs sit on different core complexes a miss between them takes ~0.2 us (the round trip
  // ~0.4 us, against ~0.1 us on one complex): ~3.6 us a pass. Same tasks, same kernels: the same bits
  // as the passes run one by one.
  struct Program;
  std::unique_ptr<Program> prog_;
  bool prog_on_ = true;
  bool prog_unfit_ = false;  // build_program refused this model's shapes: its layers run one by one
  bool program_fits(int T) const;
  void build_program(int T, int N);  // prog_ for T tokens and N logits rows (throws where it cannot)
};

}  // namespace cpx
