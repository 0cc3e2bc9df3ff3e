// Several QuantLinears in one run of the pool, for the native model (model.h).
//
// Why: a decode step of a small model is ~200 matrix-vector products of a few hundred microseconds
// or less; waking the pool and waiting for it once per product costs as much as the work. So the
// linears that read the same input (q, k and v; gate and up) are prepared once (`LinearInput`: the
// input quantised to Q8_0 and/or rounded to bf16, each form only if some reader needs it) and run as
// one list of tasks, each task one tile (up to 16 rowblocks of one weight x up to 64 rows of x) with
// the caller's epilogue: store, add into the output (the residual), or SiLU(gate) * up.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "quant_linear.h"

namespace cpx {

// m rows of x (k values each) in the forms its readers need (f32 weights read x itself: the caller's
// rows must stay put until the linears have run).
struct LinearInput {
  int m = 0, k = 0, kp = 0;  // kp: k padded to 32 (bf16 rows)
  bool has_q8 = false, has_s16 = false, has_bf16 = false, has_f32 = false;  // has_s16: a q6_k reader
  const float* x = nullptr;  // the fp32 rows, x[i * ldx + j]
  int64_t ldx = 0;
  Buffer q, d, s, ds, s16;  // Q8_0 per 32 values: int8 q, fp32 d, int32 sum(q), d * sum, sums per 16
  Buffer b;                 // bf16 rows [m][kp]
  QuantRow quantize = nullptr;  // the Q8_0 readers' row quantiser
  ActQ act() const;
  // whether every form `op`'s kernels read was prepared
  bool serves(const QuantLinear& op) const {
    return (!op.reads_q8() || has_q8) && (!op.reads_s16() || has_s16) && (!op.reads_bf16() || has_bf16) &&
           (!op.reads_f32() || has_f32);
  }
  const uint16_t* bf16_rows() const { return reinterpret_cast<const uint16_t*>(b.data()); }
};

// Prepares `in` from fp32 rows x[i * ldx + j] (j < k) for the linears in `readers` (all of in_features k).
void prepare_input(Pool& pool, LinearInput& in, const float* x, int64_t ldx, int m, int k,
                   const std::vector<const QuantLinear*>& readers);
// prepare_input in two parts: the forms and room (no row read yet), then rows t0..t1-1 of x quantised
// / rounded on the calling thread.
void shape_input(LinearInput& in, const float* x, int64_t ldx, int m, int k,
                 const std::vector<const QuantLinear*>& readers);
void fill_input_rows(LinearInput& in, int t0, int t1);
// Columns c0..c1-1 of those rows only (c0 and c1 multiples of 32, or c1 = k): the same bits as the whole
// rows there (Q8_0 blocks are quantised one by one), for a producer that fills an input as it writes it.
void fill_input_cols(LinearInput& in, int t0, int t1, int c0, int c1);

enum class Epilogue {
  Store,    // out = W x + b
  Add,      // out += W x + b
  SiluMul,  // out = silu(W x + b) * (W_up x + b_up)
};

struct LinearCall {
  const QuantLinear* op = nullptr;
  const LinearInput* in = nullptr;
  float* out = nullptr;  // row t at out + t * ldo, op->out_features() values
  int64_t ldo = 0;
  Epilogue ep = Epilogue::Store;
  const QuantLinear* up = nullptr;  // SiluMul only: same shape as op
  int row0 = 0;  // the call reads rows row0..row0+m-1 of its input (and writes out rows 0..m-1)
  int rows = -1;  // this call's m, where the calls' counts differ (a MoE's experts); -1: run_linears' m
  // Store only, or null: argmax[t] = the column of row t's largest output (the first of equal maxima,
  // NaN counting as the largest, as torch's argmax). Each task scans the columns it has just written,
  // still in its core's cache: a greedy pick then never reads the [m][N] output, which the other
  // cores' caches hold (on a 2-core Zen 4 VM a numpy argmax of SmolLM2's 49152 logits right after the
  // forward took ~90-170 us, against ~14 us once they were in the reading core's cache).
  int64_t* argmax = nullptr;
};

// Runs every call over m rows of its input (its own `rows` where set), as one list of tasks on the pool.
void run_linears(Pool& pool, const std::vector<LinearCall>& calls, int m);

// run_linears in parts, for callers that run the tasks themselves (the model's decode program, model.h).
// A tile: rowblocks rb0..rb1-1 of the call's weight (step 0), or (step > 0) the `count` groups
// g0, g0 + step, ... (QuantLinear::tile_groups), for rows t0..t0+nt-1.
struct LinearTask {
  int call, rb0, rb1, t0, nt;
  int g0 = 0, step = 0, count = 0;
};
struct LinearBest {  // a row's largest output so far in a task's columns (LinearCall::argmax)
  float v = 0.0f;
  int64_t col = -1;
};
struct LinearPass {
  std::vector<LinearCall> calls;
  std::vector<LinearTask> tasks;
  int m = 0, ldc = 0;
  size_t tile = 0;  // floats of one output tile
  bool any_argmax = false;
  std::vector<LinearBest> best;
  // null, or called by a task after it wrote output columns [n0, n0 + ncols) of call `call`, rows
  // t0..t0+nt-1 (the decode program's RoPE and KV store for the heads a q·k·v task made, and its
  // quantising of gate·up's output into down's input)
  std::function<void(int call, int n0, int ncols, int t0, int nt)> after;
};
// The tasks run_linears would give `threads` participants (checks the calls as it does).
void plan_linears(LinearPass& pass, const std::vector<LinearCall>& calls, int m, int threads);
// Task i of the pass; `in` (null: each call's own) replaces the calls' input, for a participant that
// prepared its own copy of it (the same bits).
void run_linear_task(LinearPass& pass, int i, const LinearInput* in);
// After every task: the argmax of each row of the calls that asked for it.
void finish_linears(const LinearPass& pass);

}  // namespace cpx
