// Paged attention (attention.h): query groups x key ranges on the pool, online softmax per query.
//
// A group = query vectors that read the same keys (a few consecutive tokens of one request x a block
// of heads). Its keys are cut into fixed blocks (key_blocks: a function of the group's key count
// only). Within a block keys come in tiles of kKeyTile: their slots are read from the request's row
// of req_to_token, then every query of the group scores the tile (dot products along the head dim)
// and updates its running max m, sum l and weighted value sum acc, skipping keys past its own
// position. Blocks are merged in order by one function (merge_state), either inside one task per
// group or, split-KV, by whichever task finishes the group's last block: the same bits either way, so
// a request's output does not depend on what else is in the batch. A token with its own slot list
// (AttnTokens::sel) is a group of its own whose keys are that list.
#include "attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <string>

#include "attention_kernels.h"
#include "common.h"
#include "vec.h"

namespace cpx {
namespace attn {

// R = R (+) B for nq query states (m, l, acc[Dv]). The one merge of key blocks: a task that runs
// its group's blocks in turn and the pass that merges blocks run as separate tasks both call this
// compiled body, so a query's result has the same bits whether or not its group was split.
CPX_INLINE void merge_state_impl(int nq, int Dv, float* R, const float* B) {
  using namespace vec;
  const int sw = 2 + Dv;
  for (int i = 0; i < nq; ++i) {
    float* r = R + size_t(i) * sw;
    const float* b = B + size_t(i) * sw;
    if (b[1] == 0.0f) continue;  // the block added nothing for this query
    if (r[1] == 0.0f) {
      std::copy(b, b + sw, r);
      continue;
    }
    const float M = std::max(r[0], b[0]);
    const float cr = exp1(r[0] - M), cb = exp1(b[0] - M);
    r[0] = M;
    r[1] = r[1] * cr + b[1] * cb;
    int d = 0;
    for (; d + 8 <= Dv; d += 8) store(r + 2 + d, load(r + 2 + d) * splat(cr) + load(b + 2 + d) * splat(cb));
    for (; d < Dv; ++d) r[2 + d] = r[2 + d] * cr + b[2 + d] * cb;
  }
}
CPX_DISPATCH(void, merge_state, (int nq, int Dv, float* R, const float* B), (nq, Dv, R, B))

}  // namespace attn

using namespace attn;

namespace {

struct Task {
  int group, block;  // a key block of the group (key_blocks)
};

// The build of the kernels this CPU runs (attention_kernels.h).
void task_entry CPX_ATTN_TASK_PARAMS {
  if (L.bf16_dot) return task_entry_bf16_dot CPX_ATTN_TASK_ARGS;
  CPX_DISPATCH_CALL(task_entry, CPX_ATTN_TASK_ARGS);
}

// Groups: runs of tokens of one request at increasing positions within one aligned run of L.tok_block
// positions (positions 4i .. 4i + 3 for a block of 4: where the batch starts the request does not move
// them), times head blocks.
void make_groups(const AttnTokens& tok, const Layout& L, int Hkv, int threads, std::vector<Group>& groups) {
  groups.clear();
  const int H = L.H, tb = L.tok_block;
  const bool mla = L.mla;
  const int heads_per = mla ? std::min(H, kMlaHeadBlock) : H / Hkv;
  const int nheadblocks = mla ? (H + heads_per - 1) / heads_per : Hkv;
  auto own = [&](int t) { return tok.sel && tok.sel[t]; };  // a token with its own slot list
  for (int t = 0; t < tok.T;) {
    int e = t + 1;
    while (!own(t) && e < tok.T && !own(e) && tok.row[e] == tok.row[t] && tok.pos[e] > tok.pos[e - 1] &&
           tok.pos[e] / tb == tok.pos[t] / tb)
      ++e;
    const int64_t keys = own(t) ? tok.sel_n[t] : tok.pos[e - 1] + 1;
    // the keys rounded up to a multiple of the token block: for a run, its aligned run's end; for a slot
    // list that holds the whole context, the same as for the token attending to it all
    const int64_t span = (keys + tb - 1) / tb * tb;
    const int32_t* sel = own(t) ? tok.sel[t] : nullptr;
    const int nb = key_blocks(span).n;
    if (!mla && e - t == 1 && Hkv > 1 && (nb >= 2 * threads || nb % threads == 0 || tok.T >= 2 * threads)) {
      // one decode token whose key blocks keep the threads busy (two per thread, or one each: with another
      // count, as SmolLM2's 3 KV heads at ~200 keys on 2 threads, the per-head tasks balance better), or
      // a batch of at least two tokens per thread, whose tasks balance whatever each one's count: all its
      // KV heads in one group, so a task reads whole slots (every head's row, adjacent) rather than one
      // head's row of each (the same arithmetic per query and key: the same bits). One block per thread
      // (128-191 keys on 2 threads) measured 1.2% faster SmolLM2 decode than per-head tasks (12
      // interleaved rounds, the decode program, attention 285 -> 274 us a step); 4, 8 and 16 requests
      // decoding together at 196-248 keys (3 blocks each) on a 2-core Zen 4 VM: attention 11-14% faster,
      // the step 1.012x, 1.024x, 1.074x (bench/batch_decode_cpu.py, 12 rounds)
      groups.push_back({t, 1, 0, H, 0, Hkv, tok.row[t], keys, sel, span});
    } else {
      for (int b = 0; b < nheadblocks; ++b) {
        const int h0 = b * heads_per, nh = std::min(heads_per, H - h0);
        groups.push_back({t, e - t, h0, nh, mla ? 0 : b, 1, tok.row[t], keys, sel, span});
      }
    }
    t = e;
  }
}

}  // namespace

// A call's groups and tasks (attention.h).
struct AttnPlan {
  PagedKv kv;
  AttnTokens tok;
  Layout L;
  float scale = 1.0f;
  const float* q = nullptr;
  float* out = nullptr;
  std::vector<Group> groups;
  bool split = false;      // a task per key block (else per group)
  std::vector<Task> tasks;  // split: the blocks
  std::vector<int> first;   // split: partial-state index of each group's first block
  std::unique_ptr<std::atomic<int>[]> left;  // split: blocks of each group not yet done
  size_t left_room = 0;
  size_t state = 0;
  size_t scores = 0;  // floats of a thread's scores and corrections (run_task: [nq][chunk], then [nq])
};

AttnScratch::AttnScratch() = default;
AttnScratch::~AttnScratch() = default;
AttnScratch::AttnScratch(AttnScratch&&) noexcept = default;
AttnScratch& AttnScratch::operator=(AttnScratch&&) noexcept = default;

namespace {

int plan(AttnScratch& scratch, int threads, const PagedKv& kv, const AttnTokens& tok, const Layout& L, int Hkv,
         float scale, const float* q, float* out) {
  if (!scratch.plan) scratch.plan = std::make_unique<AttnPlan>();
  AttnPlan& P = *scratch.plan;
  P.kv = kv, P.tok = tok, P.L = L, P.scale = scale, P.q = q, P.out = out;
  if (tok.T <= 0) return 0;
  threads = std::max(1, threads);
  make_groups(tok, L, Hkv, threads, P.groups);
  int max_nq = 0;
  for (const Group& g : P.groups) max_nq = std::max(max_nq, g.nt * g.nh);
  P.state = size_t(max_nq) * (2 + L.Dv);
  // fp32 key and value tiles (bf16 caches), or a group's permuted queries (paired)
  size_t tiles = std::max(size_t(kKeyTile) * (L.D + L.Dv), L.paired ? size_t(max_nq) * L.D : size_t(0));
  if (L.bf16_dot) tiles = std::max(tiles, bf16_dot_buffer(max_nq, L.D, L.Dv));
  P.scores = size_t(max_nq) * (kMaxChunk + 1);
  if (scratch.thread.size() < size_t(threads)) scratch.thread.resize(size_t(threads));
  for (auto& t : scratch.thread)
    if (t.size() < 2 * P.state + P.scores + tiles) t.resize(2 * P.state + P.scores + tiles);
  // Split-KV (a task per key block) only where the groups alone cannot keep every thread busy
  // (about 4 tasks per thread); the blocks are the same either way (key_blocks).
  P.split = int(P.groups.size()) < 4 * threads;
  if (!P.split) return int(P.groups.size());
  P.tasks.clear();
  P.first.assign(P.groups.size() + 1, 0);
  for (int gi = 0; gi < int(P.groups.size()); ++gi) {
    const int n = key_blocks(P.groups[size_t(gi)].span).n;
    P.first[size_t(gi) + 1] = P.first[size_t(gi)] + n;
    for (int b = 0; b < n; ++b) P.tasks.push_back({gi, b});
  }
  scratch.partial.resize(size_t(P.first.back()) * P.state);
  // The task that finishes a group's last block merges the group's blocks, in block order whichever
  // thread it is, and writes its output: no second pass of the pool (one wake-up and wait less per
  // layer). acq_rel: the last task sees every other block's state.
  if (P.left_room < P.groups.size()) {
    P.left.reset(new std::atomic<int>[P.groups.size()]);
    P.left_room = P.groups.size();
  }
  for (size_t gi = 0; gi < P.groups.size(); ++gi)
    P.left[gi].store(P.first[gi + 1] - P.first[gi], std::memory_order_relaxed);
  return int(P.tasks.size());
}

}  // namespace

void check_attention_tokens(const PagedKv& kv, const AttnTokens& tok) {
  int64_t last_row = -1, checked = 0;  // slots of a row are checked once, up to the largest position seen
  for (int t = 0; t < tok.T; ++t) {
    const int64_t row = tok.row[t], pos = tok.pos[t];
    if (row < 0 || row >= kv.table_rows)
      throw ArgError("token " + std::to_string(t) + ": request row " + std::to_string(row) + " is outside [0, " +
                     std::to_string(kv.table_rows) + ")");
    if (pos < 0 || pos >= kv.table_stride)
      throw ArgError("token " + std::to_string(t) + ": position " + std::to_string(pos) + " is outside [0, " +
                     std::to_string(kv.table_stride) + ")");
    if (row != last_row) {
      last_row = row;
      checked = 0;
    }
    for (; checked <= pos; ++checked) {
      const int32_t slot = kv.table[row * kv.table_stride + checked];
      if (slot < 0 || slot >= kv.num_slots)
        throw ArgError("request row " + std::to_string(row) + " position " + std::to_string(checked) + ": KV slot " +
                       std::to_string(slot) + " is outside the pool [0, " + std::to_string(kv.num_slots) + ")");
    }
  }
}

void run_attention_task(AttnScratch& scratch, int i, int tid) {
  AttnPlan& P = *scratch.plan;
  float* base = scratch.thread[size_t(tid)].data();
  float* st0 = base;                    // a group's state
  float* blk = base + P.state;          // a block's state
  float* scores = base + 2 * P.state;   // scores, then tiles
  float* buf = scores + P.scores;
  auto after = [&](const Group& g) {
    if (scratch.after) scratch.after(g.t0, g.nt, int(g.h0 * P.L.o_head), int((g.h0 + g.nh) * P.L.o_head));
  };
  if (!P.split) {
    task_entry(P.kv, P.tok, P.L, P.groups[size_t(i)], -1, P.scale, P.q, st0, blk, scores, buf, P.out);
    after(P.groups[size_t(i)]);
    return;
  }
  const Task& tk = P.tasks[size_t(i)];
  const size_t gi = size_t(tk.group);
  const Group& g = P.groups[gi];
  float* st = scratch.partial.data() + size_t(P.first[gi]) * P.state;
  task_entry(P.kv, P.tok, P.L, g, tk.block, P.scale, P.q, st + size_t(tk.block) * P.state, nullptr, scores, buf,
             nullptr);
  if (P.left[gi].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  for (int bl = 1; bl < P.first[gi + 1] - P.first[gi]; ++bl)
    merge_state(g.nt * g.nh, P.L.Dv, st, st + size_t(bl) * P.state);
  write_out(P.L, g, st, P.out);
  after(g);
}

namespace {
// What task i reads: its group, keys [k0, k1), and of each key a K and a V row (kbytes, vbytes; MLA: no V).
struct TaskRows {
  const Group* g;
  int64_t k0, k1, kbytes, vbytes;
  int64_t key_bytes() const {  // the whole cache lines of one key's rows
    return (kbytes + 63) / 64 * 64 + (vbytes + 63) / 64 * 64;
  }
};
TaskRows task_rows(const AttnPlan& P, int i) {
  TaskRows t{};
  if (!P.split) {
    t.g = &P.groups[size_t(i)];
    t.k0 = 0, t.k1 = t.g->keys;
  } else {
    const Task& tk = P.tasks[size_t(i)];
    t.g = &P.groups[size_t(tk.group)];
    const Blocks B = key_blocks(t.g->span);
    t.k0 = std::min<int64_t>(t.g->keys, tk.block * B.size), t.k1 = std::min<int64_t>(t.g->keys, (tk.block + 1) * B.size);
  }
  const int64_t elt = P.kv.type == KvType::BF16 ? 2 : 4;
  t.kbytes = ((t.g->nkv - 1) * P.L.k_head_off + P.L.D) * elt;
  t.vbytes = P.L.mla ? 0 : ((t.g->nkv - 1) * P.L.v_head_off + P.L.Dv) * elt;
  return t;
}

// Every cache line of [p, p + bytes) into L2 (T1).
void prefetch_lines(const char* p, int64_t bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t l = a & ~uintptr_t(63); l < a + uintptr_t(bytes); l += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(l), 0, 2);
}
}  // namespace

int64_t attention_task_bytes(const AttnScratch& scratch, int i) {
  const TaskRows t = task_rows(*scratch.plan, i);
  return (t.k1 - t.k0) * t.key_bytes();
}

void prefetch_attention_task(const AttnScratch& scratch, int i, int64_t b0, int64_t b1) {
  const AttnPlan& P = *scratch.plan;
  const TaskRows t = task_rows(P, i);
  const Group& g = *t.g;
  const int32_t* slots = g.slots ? g.slots : P.kv.table + g.row * P.kv.table_stride;
  const int64_t elt = P.kv.type == KvType::BF16 ? 2 : 4, kb = t.key_bytes();
  const char* kbase = static_cast<const char*>(P.kv.k);
  const char* vbase = static_cast<const char*>(P.kv.v);
  for (int64_t j = t.k0 + b0 / kb; j < std::min(t.k1, t.k0 + (b1 + kb - 1) / kb); ++j) {
    const int64_t slot = slots[j];
    prefetch_lines(kbase + (slot * P.kv.k_stride + g.kv_head * P.L.k_head_off) * elt, t.kbytes);
    if (t.vbytes) prefetch_lines(vbase + (slot * P.kv.v_stride + g.kv_head * P.L.v_head_off) * elt, t.vbytes);
  }
}

bool attention_bf16_dot() { return vec::has_avx512vl() && cpu_info().avx512_bf16; }

namespace {
// Whether a layer of value width Dv over this cache runs the vdpbf16ps kernels (attention_bf16_dot.cpp:
// values sixteen at a time).
bool bf16_dot_for(const PagedKv& kv, int Dv) {
  return kv.type == KvType::BF16 && attention_bf16_dot() && Dv % 16 == 0;
}

Layout gqa_layout(const PagedKv& kv, int H, int Hkv, int D, int Dv) {
  if (H <= 0 || Hkv <= 0 || H % Hkv) throw ArgError("query heads must be a positive multiple of the KV heads");
  Layout L{H, D, Dv, int64_t(H) * D, D, int64_t(H) * Dv, Dv, D, Dv, false, false};
  L.bf16_dot = bf16_dot_for(kv, Dv);  // else the fp32 kernels, bf16 rows read paired at a fixed head dim
  L.paired = kv.type == KvType::BF16 && !L.bf16_dot && fixed_head_dim(L) != 0;
  L.tok_block = L.bf16_dot ? kMaxTokBlock : kTokBlock;
  return L;
}
void run(Pool& pool, AttnScratch& scratch, const PagedKv& kv, const AttnTokens& tok, const Layout& L, int Hkv,
         float scale, const float* q, float* out) {
  const int tasks = plan(scratch, pool.size(), kv, tok, L, Hkv, scale, q, out);
  pool.run(tasks, [&](int i, int tid) { run_attention_task(scratch, i, tid); });
}
}  // namespace

int plan_attention_gqa(AttnScratch& scratch, int threads, const PagedKv& kv, const AttnTokens& tok, const float* q,
                       int H, int Hkv, int D, int Dv, float scale, float* out) {
  return plan(scratch, threads, kv, tok, gqa_layout(kv, H, Hkv, D, Dv), Hkv, scale, q, out);
}

void attention_gqa(Pool& pool, AttnScratch& scratch, const PagedKv& kv, const AttnTokens& tok, const float* q, int H,
                   int Hkv, int D, int Dv, float scale, float* out) {
  run(pool, scratch, kv, tok, gqa_layout(kv, H, Hkv, D, Dv), Hkv, scale, q, out);
}

void attention_mla(Pool& pool, AttnScratch& scratch, const PagedKv& kv, const AttnTokens& tok, const float* q, int H,
                   int r, int P, float scale, float* out) {
  if (H <= 0 || r <= 0 || P < 0) throw ArgError("MLA attention needs positive heads and rank");
  const int D = r + P;
  Layout L{H, D, r, int64_t(H) * D, D, int64_t(H) * r, r, 0, 0, true, false};
  L.bf16_dot = bf16_dot_for(kv, r);
  run(pool, scratch, kv, tok, L, 1, scale, q, out);
}

}  // namespace cpx
