// Paged attention on the CPU over the KV pool the executor owns, read through `req_to_token`, for
// decode and for extend (prefill, chunked prefill, mixed batches) alike.
//
// Every new token's K/V (or MLA latent) is in the pool before attention runs, so one rule serves
// every batch: token t of request row `row[t]` at position `pos[t]` attends to positions 0..pos[t] of
// that row (causal). Two layer kinds:
//   GQA/MHA  q [T][H][D] (RoPE'd) -> out [T][H][Dv]; K [slots][Hkv][D], V [slots][Hkv][Dv].
//   MLA      q [T][H][r + P] = (q_nope · w_kc ‖ RoPE'd q_pe) against the latent rows
//            [slots][r + P] = (c_kv ‖ k_pe): score = q · row, value = c_kv -> out [T][H][r].
//            One latent row serves every head (MQA over the 576-wide cache).
// Pool dtype fp32 or bf16; arithmetic in fp32 (online softmax, as flash attention).
//
// Sparse tokens (OmniKV, omnikv.h): a token may carry its own list of KV slots (AttnTokens::sel); it
// then attends to those sel_n[t] keys, all of them (as a token whose position is sel_n[t] - 1 would),
// instead of its row's positions 0..pos[t]. Its key blocks depend on that count alone, as a full
// token's on its position, so a list holding the row's slots 0..pos[t] in order gives the same bits
// as full attention.
//
// Work split: a query group is the queries that read the same keys — up to 4 consecutive tokens of one
// request (8 in the vdpbf16ps GQA kernel) times the heads of one KV head (GQA), or times a block of
// heads (MLA). When groups are fewer than the pool's threads can keep busy (decode of a few requests),
// each group's keys are also split into ranges (split-KV) whose partial softmax states are merged
// afterwards.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "pool.h"

namespace cpx {

enum class KvType { F32 = 0, BF16 = 1 };

// One layer's cache and the request table.
struct PagedKv {
  const void* k = nullptr;  // GQA: [slots][Hkv][D]; MLA: latent [slots][r + P]
  const void* v = nullptr;  // GQA: [slots][Hkv][Dv]; MLA: null (the value is the latent's first r columns)
  KvType type = KvType::F32;
  int64_t k_stride = 0, v_stride = 0;  // elements from one slot to the next
  const int32_t* table = nullptr;      // req_to_token [rows][table_stride]
  int64_t table_stride = 0;
  int64_t table_rows = 0;  // rows of the table, and slots of the pool: every read is checked against them
  int64_t num_slots = 0;
};

// The batch's tokens: request row and position of each, and optionally per token a slot list.
struct AttnTokens {
  int T = 0;
  const int64_t* row = nullptr;
  const int64_t* pos = nullptr;
  // null: every token reads its row; else per token null (its row) or sel_n[t] slots of the pool
  // (valid slots: the caller took them from the token's checked row)
  const int32_t* const* sel = nullptr;
  const int64_t* sel_n = nullptr;
  // null, or per token null or a buffer its softmax is written to as attention computes it (OmniKV's
  // filter layers take their importance from it instead of scoring the keys again; a token with a slot
  // list has none). For a token at position p, n = p + 1 keys, tiles of kAttnDumpTile keys, H heads:
  //   e  [H][n]            exp(s_hj - m_h,tile(j)), s the scaled score;
  //   st [H][tiles][2]     per tile the running max m its e are relative to, and the tile's sum of e;
  // so that softmax_j = e_hj · exp(m_h,tile(j) - M_h) / L_h, M_h = max of m, L_h = sum of sum · exp(m - M_h).
  float* const* dump = nullptr;
};
constexpr int kAttnDumpTile = 16;
inline size_t attn_dump_floats(int H, int64_t n) {
  return size_t(H) * size_t(n + 2 * ((n + kAttnDumpTile - 1) / kAttnDumpTile));
}

// Scratch reused across calls (the model owns one; grows to the largest call).
struct AttnPlan;  // a call's groups and tasks (attention.cpp)
struct AttnScratch {
  std::vector<float> partial;  // split-KV states: per (task, query): m, l, acc[Dv]
  std::vector<std::vector<float>> thread;  // per participant: scores and running states of one group
  std::unique_ptr<AttnPlan> plan;  // the call's plan, its vectors kept for the next call
  // null, or called by the task that wrote a group's output: tokens t0..t0+nt-1, output columns
  // [c0, c1) of each (the decode program quantises the o projection's input there, model.h)
  std::function<void(int t0, int nt, int c0, int c1)> after;
  AttnScratch();
  ~AttnScratch();
  AttnScratch(AttnScratch&&) noexcept;
  AttnScratch& operator=(AttnScratch&&) noexcept;
};

void attention_gqa(Pool& pool, AttnScratch& scratch, const PagedKv& kv, const AttnTokens& tok, const float* q,
                   int H, int Hkv, int D, int Dv, float scale, float* out);

// attention_gqa in parts, for callers that run the tasks themselves (the model's decode program,
// model.h): plan into the scratch for `threads` participants (returns the task count), then run every
// task i once, as participant tid (the scratch, kv, tokens, q and out must stay put until the last
// task is done).
int plan_attention_gqa(AttnScratch& scratch, int threads, const PagedKv& kv, const AttnTokens& tok, const float* q,
                       int H, int Hkv, int D, int Dv, float scale, float* out);
void run_attention_task(AttnScratch& scratch, int i, int tid);
// The KV bytes task i of the scratch's plan reads (its keys' K and V rows, whole cache lines), and a
// prefetch into L2 of bytes [b0, b1) of them, in the order the task reads its keys: the decode program
// asks for a layer's rows while the layer before it streams its weights (model.h).
int64_t attention_task_bytes(const AttnScratch& scratch, int i);
void prefetch_attention_task(const AttnScratch& scratch, int i, int64_t b0, int64_t b1);
// Whether attention over a bf16 cache (MLA, and GQA/MHA whose value width is a multiple of 16) runs the
// vdpbf16ps kernels (attention_bf16_dot.cpp): AVX512_BF16, and the AVX2 build not forced
// (MLASERVE_CPP_EXPERTS_KERNEL=avx2). Their results are within bf16 rounding of the fp32 kernels', not
// equal to them: queries and probabilities are rounded to bf16, as GPU flash kernels round P.
bool attention_bf16_dot();
void attention_mla(Pool& pool, AttnScratch& scratch, const PagedKv& kv, const AttnTokens& tok, const float* q,
                   int H, int r, int P, float scale, float* out);

// Checks that every token's row, position and slot is inside the table and the pool (a bad index
// would read outside them); throws ArgError naming the token otherwise.
void check_attention_tokens(const PagedKv& kv, const AttnTokens& tok);

}  // namespace cpx
