// linear_calls.h: input preparation, tiles of several linears in one pool run, their epilogues, and
// single rows of a packed weight decoded back to fp32.
#include "linear_calls.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "vec.h"

namespace cpx {
namespace {

constexpr int kTokChunk = 64;        // rows of x per task
constexpr int kMaxTaskRowblocks = 16;
constexpr int kPrepChunk = 8;        // rows of x per input-preparation task

float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// Per-thread output tiles (pool workers live as long as the pool; the tiles grow to the largest task).
thread_local std::vector<float> t_tile;

CPX_INLINE void epilogue_impl(Epilogue ep, const float* c, const float* cu, int ldc, int nt, int ncols,
                              const float* bias, const float* bias_up, float* out, int64_t ldo) {
  using namespace vec;
  for (int t = 0; t < nt; ++t) {
    const float* cr = c + size_t(t) * ldc;
    float* o = out + t * ldo;
    int j = 0;
    if (ep == Epilogue::SiluMul) {
      const float* ur = cu + size_t(t) * ldc;
      for (; j + 8 <= ncols; j += 8) {
        v8f g = load(cr + j), u = load(ur + j);
        if (bias) g += load(bias + j);
        if (bias_up) u += load(bias_up + j);
        store(o + j, silu8(g) * u);
      }
      for (; j < ncols; ++j) {
        const float g = cr[j] + (bias ? bias[j] : 0.0f), u = ur[j] + (bias_up ? bias_up[j] : 0.0f);
        o[j] = g / (1.0f + exp1(-g)) * u;
      }
      continue;
    }
    const bool add = ep == Epilogue::Add;
    for (; j + 8 <= ncols; j += 8) {
      v8f v = load(cr + j);
      if (bias) v += load(bias + j);
      store(o + j, add ? load(o + j) + v : v);
    }
    for (; j < ncols; ++j) {
      const float v = cr[j] + (bias ? bias[j] : 0.0f);
      o[j] = add ? o[j] + v : v;
    }
  }
}

CPX_DISPATCH(void, epilogue,
             (Epilogue ep, const float* c, const float* cu, int ldc, int nt, int ncols, const float* bias,
              const float* bias_up, float* out, int64_t ldo),
             (ep, c, cu, ldc, nt, ncols, bias, bias_up, out, ldo))

// Decode passes read each weight once, and a task that reads kGroupStreams consecutive groups reads
// kGroupStreams streams of one group each (23 KiB at SmolLM2's 576 inputs and Q4_1), which end
// before the hardware prefetcher is up to speed on them. Task i of a strided call reads the groups
// i, i + Q, i + 2Q, ... instead (Q tasks): the tasks one thread takes in turn continue the same
// streams, each over Q / threads consecutive groups. On a 2-core Zen 3 VM (SmolLM2 Q4_1 decode at
// 160 tokens, interleaved runs) gate·up's pass took 7-10% less time and the Q8_0 LM head's 12% less;
// calls of fewer groups (9 in o and down) keep whole-group tasks: with Q = 3 tasks on 2 threads one
// thread would read twice the other's share.
constexpr int kStridedMinTasks = 2;  // strided tasks per thread at least (Q >= kStridedMinTasks x threads)

// whether the call's m rows take the kernels' one pass that reads groups as parallel streams
bool reads_streams(const LinearCall& c, int m) {
  return m <= kGroupStreamRows && c.op->reads_group_streams() && (!c.up || c.up->reads_group_streams());
}
bool strided(const LinearCall& c, int m, int threads) {
  const int q = (c.op->groups() + kGroupStreams - 1) / kGroupStreams;
  return reads_streams(c, m) && q >= kStridedMinTasks * threads;
}

// The best of a row's outputs so far for argmax (LinearBest): the larger value, NaN above every
// number, the smaller column between equals.
bool beats(float v, int64_t col, const LinearBest& b) {
  if (b.col < 0) return true;
  const bool vn = std::isnan(v), bn = std::isnan(b.v);
  if (vn != bn) return vn;
  if (!vn && v != b.v) return v > b.v;
  return col < b.col;
}
// The index of the first maximum of o[0..n), n > 0, or of the first NaN where there is one.
CPX_INLINE int first_max_impl(const float* o, int n) {
  using namespace vec;
  float m = o[0];
  bool nan = false;
  int j = 0;
  if (n >= 8) {
    v8f m8 = load(o);
    v8i nan8 = {};
    for (; j + 8 <= n; j += 8) {
      const v8f v = load(o + j);
      m8 = v > m8 ? v : m8;
      nan8 |= v != v;
    }
    m = hmax(m8);
    for (int i = 0; i < 8; ++i) nan = nan || nan8[i];
  }
  for (; j < n; ++j) {
    m = o[j] > m ? o[j] : m;
    nan = nan || o[j] != o[j];
  }
  j = 0;
  if (nan) {
    while (!std::isnan(o[j])) ++j;
  } else {
    while (o[j] != m) ++j;
  }
  return j;
}

CPX_DISPATCH(int, first_max, (const float* o, int n), (o, n))

// Folds o[0..n) (columns n0..n0+n-1) into b.
void fold_best(const float* o, int n, int64_t n0, LinearBest& b) {
  if (n <= 0) return;
  const int j = first_max(o, n);
  if (beats(o[j], n0 + j, b)) b = {o[j], n0 + j};
}

}  // namespace

ActQ LinearInput::act() const {
  return ActQ{reinterpret_cast<const int8_t*>(q.data()), reinterpret_cast<const float*>(d.data()),
              reinterpret_cast<const int32_t*>(s.data()), reinterpret_cast<const float*>(ds.data()),
              reinterpret_cast<const int32_t*>(s16.data()), k};
}

void shape_input(LinearInput& in, const float* x, int64_t ldx, int m, int k,
                 const std::vector<const QuantLinear*>& readers) {
  in.m = m;
  in.k = k;
  in.kp = int(round_up(size_t(k), 32));
  in.has_q8 = in.has_s16 = in.has_bf16 = in.has_f32 = false;
  in.x = x;
  in.ldx = ldx;
  in.quantize = nullptr;
  for (const QuantLinear* op : readers) {
    if (op->in_features() != k)
      throw ArgError("a linear of in_features " + std::to_string(op->in_features()) + " reads an input of " +
                     std::to_string(k) + " values");
    if (op->reads_q8() && !in.has_q8) {
      in.has_q8 = true;
      in.quantize = op->quantizer();
    }
    in.has_s16 = in.has_s16 || op->reads_s16();
    in.has_bf16 = in.has_bf16 || op->reads_bf16();
    in.has_f32 = in.has_f32 || op->reads_f32();
  }
  if (m <= 0) return;
  const int nb = k / 32;
  if (in.has_q8) {
    if (k % 32) throw ArgError("Q8_0 activations need a multiple of 32 values, got " + std::to_string(k));
    in.q.resize(size_t(m) * k);
    in.d.resize(size_t(m) * nb * 4);
    in.s.resize(size_t(m) * nb * 4);
    in.ds.resize(size_t(m) * nb * 4);
    if (in.has_s16) in.s16.resize(size_t(m) * nb * 8);
  }
  if (in.has_bf16) in.b.resize(size_t(m) * in.kp * 2);
}

void fill_input_rows(LinearInput& in, int t0, int t1) { fill_input_cols(in, t0, t1, 0, in.k); }

void fill_input_cols(LinearInput& in, int t0, int t1, int c0, int c1) {
  const int k = in.k, nb = k / 32, n = c1 - c0, b0 = c0 / 32;
  if (c0 < 0 || c1 > k || n < 0 || (in.has_q8 && (c0 % 32 || n % 32)))
    throw ArgError("fill_input_cols: not whole blocks of the row");
  int8_t* q = reinterpret_cast<int8_t*>(in.q.data());
  float* d = reinterpret_cast<float*>(in.d.data());
  int32_t* s = reinterpret_cast<int32_t*>(in.s.data());
  float* ds = reinterpret_cast<float*>(in.ds.data());
  int32_t* s16 = reinterpret_cast<int32_t*>(in.s16.data());
  uint16_t* b = reinterpret_cast<uint16_t*>(in.b.data());
  for (int t = t0; t < t1; ++t) {
    const float* xr = in.x + t * in.ldx;
    if (in.has_q8) {
      const size_t o = size_t(t) * nb + b0;
      quantize_act_row(in.quantize, xr + c0, n, q + size_t(t) * k + c0, d + o, s + o, ds + o,
                       in.has_s16 ? s16 + 2 * o : nullptr);
    }
    if (in.has_bf16) {
      uint16_t* y = b + size_t(t) * in.kp;
      for (int i = c0; i < c1; ++i) y[i] = f32_to_bf16(xr[i]);
      if (c1 == k)
        for (int i = k; i < in.kp; ++i) y[i] = 0;
    }
  }
}

void prepare_input(Pool& pool, LinearInput& in, const float* x, int64_t ldx, int m, int k,
                   const std::vector<const QuantLinear*>& readers) {
  shape_input(in, x, ldx, m, k, readers);
  if (m <= 0) return;
  pool.run((m + kPrepChunk - 1) / kPrepChunk, [&](int task, int) {
    fill_input_rows(in, task * kPrepChunk, std::min(m, (task + 1) * kPrepChunk));
  });
}

void QuantLinear::tile(const LinearInput& in, int rb0, int rb1, int t0, int nt, float* c, int ldc) const {
  rb1 = std::min(rb1, nrb_);  // a caller's range may come from a sibling of another format
  if (rb1 <= rb0) return;
  if (fmt_ == LinFormat::F32) {
    lin_->gemm_f32(reinterpret_cast<const float*>(w_.data()), K_, rb0, rb1, in.x + t0 * in.ldx, size_t(in.ldx), nt, c,
                   ldc);
  } else if (fmt_ == LinFormat::BF16) {
    const uint16_t* at = in.bf16_rows() + size_t(t0) * in.kp;
    if (amx_bf16_)  // every row count (QuantLinear::forward's rule)
      amx_bf16_(bm_, rb0, rb1 - rb0, at, size_t(in.kp), nt, c, ldc);
    else
      bf16k_->gemm_bf16(bm_, rb0, rb1 - rb0, at, size_t(in.kp), nt, c, ldc);
  } else if (amxq_ && nt >= amx_int8_min_rows(fmt_)) {
    amxq_[int(fmt_)](qm_, rb0, rb1, in.act(), t0, nt, c, ldc);
  } else {
    lin_->gemm[int(fmt_)](qm_, rb0, rb1, in.act(), t0, nt, c, ldc);
  }
}

void QuantLinear::tile_groups(const LinearInput& in, int g0, int step, int count, int t0, int nt, float* c,
                              int ldc) const {
  if (!reads_group_streams() || nt > kGroupStreamRows || count > kGroupStreams || g0 + (count - 1) * step >= groups())
    throw ArgError("tile_groups: not a decode tile of whole groups of this operator");
  QMat view = qm_;
  view.data = qm_.at(g0 * kGroupRowblocks);
  view.group_step = step;
  lin_->gemm[int(fmt_)](view, 0, count * kGroupRowblocks, in.act(), t0, nt, c, ldc);
}

void QuantLinear::dequant_row(int n, float* out) const {
  if (n < 0 || n >= N_) throw ArgError("row " + std::to_string(n) + " is outside [0, " + std::to_string(N_) + ")");
  const int rb = n / 16, r = n % 16;
  if (fmt_ == LinFormat::F32) {
    const float* w = reinterpret_cast<const float*>(w_.data()) + size_t(rb) * K_ * 16;
    for (int k = 0; k < K_; ++k) out[k] = w[size_t(k) * 16 + r];
    return;
  }
  if (fmt_ == LinFormat::BF16) {
    const uint16_t* w = reinterpret_cast<const uint16_t*>(w_.data()) + size_t(rb) * Kp_ * 16;
    for (int k = 0; k < K_; ++k) out[k] = bf16_to_f32(w[size_t(k / 2) * 32 + 2 * r + (k & 1)]);
    return;
  }
  const LinLayout& L = kLinLayout[int(fmt_)];
  uint8_t q[32];
  for (int sb = 0; sb < qm_.nsb; ++sb) {
    const uint8_t* base = qm_.at(rb) + size_t(sb) * kGroupRowblocks * qm_.sb_bytes;
    const bool kq = L.sb_blocks > 1;
    const float D = kq ? f16(base + 2 * r) : 0.0f;
    const float Dmin = lin_has_dmin(fmt_) ? f16(base + 32 + 2 * r) : 0.0f;
    for (int j = 0; j < L.sb_blocks; ++j) {
      const uint8_t* bp = base + L.hdr + size_t(j) * L.blk;
      unpack_block(fmt_, bp, r, q);
      float* o = out + (size_t(sb) * L.sb_blocks + j) * 32;
      for (int i = 0; i < 32; ++i) {
        if (lin_one_block(fmt_)) {  // w = d (q - zero point) (+ m)
          o[i] = f16(bp + lin_d_at(fmt_) + 2 * r) * float(int(q[i]) - lin_zero_point(fmt_));
          if (lin_has_m(fmt_)) o[i] += f16(bp + lin_d_at(fmt_) + 32 + 2 * r);
          continue;
        }
        switch (fmt_) {
          case LinFormat::IQ4_XS: o[i] = D * float(int8_t(bp[256 + r])) * float(int(q[i]) - 128); break;
          case LinFormat::Q4_K:
          case LinFormat::Q5_K: {
            const uint8_t* sc = bp + (fmt_ == LinFormat::Q5_K ? 320 : 256);
            o[i] = D * float(sc[r]) * float(q[i]) - Dmin * float(sc[16 + r]);
            break;
          }
          case LinFormat::Q6_K: {
            const int8_t sc = int8_t(bp[(i < 16 ? 384 : 400) + r]);
            o[i] = D * float(sc) * float(int(q[i]) - 32);
            break;
          }
          case LinFormat::Q3_K: {
            const int8_t sc = int8_t(bp[(i < 16 ? 192 : 208) + r]);
            o[i] = D * float(sc) * float(int(q[i]) - 4);
            break;
          }
          case LinFormat::Q2_K: {
            const uint8_t sm = bp[(i < 16 ? 128 : 144) + r];  // sc | mn << 4
            o[i] = D * float(sm & 15) * float(q[i]) - Dmin * float(sm >> 4);
            break;
          }
          default: break;  // the one-block formats (above); bf16 and f32 return earlier
        }
      }
    }
  }
}

void QuantLinear::set_bias(const float* bias) {
  std::lock_guard<std::mutex> lock(m_);
  has_bias_ = bias != nullptr;
  if (!bias) return;
  bias_.resize(size_t(N_) * 4);
  std::memcpy(bias_.data(), bias, size_t(N_) * 4);
}

void plan_linears(LinearPass& pass, const std::vector<LinearCall>& calls, int m, int threads) {
  pass.calls.assign(calls.begin(), calls.end());  // into the room a reused pass already has
  pass.tasks.clear();
  pass.best.clear();
  pass.m = m;
  pass.any_argmax = false;
  pass.after = nullptr;
  const std::vector<LinearCall>& cl = pass.calls;
  if (m <= 0 || cl.empty()) return;
  const auto rows = [m](const LinearCall& c) { return c.rows >= 0 ? c.rows : m; };
  int total_rb = 0;
  for (const LinearCall& c : cl) {
    if (!c.op || !c.in || !c.out) throw ArgError("a linear call needs an operator, an input and an output");
    if (c.rows > m) throw ArgError("a linear call's rows exceed run_linears' m");
    if (c.row0 < 0 || c.in->m < c.row0 + rows(c) || c.in->k != c.op->in_features()) throw ArgError("a linear call's input does not fit its operator");
    if (!c.in->serves(*c.op)) throw ArgError("a linear call's input was not prepared for its operator");
    if (c.ep == Epilogue::SiluMul) {
      if (!c.up || c.up->out_features() != c.op->out_features() || c.up->in_features() != c.op->in_features())
        throw ArgError("SiluMul needs an up projection of the gate's shape");
      if (!c.in->serves(*c.up)) throw ArgError("a linear call's input was not prepared for its up projection");
    }
    if (c.argmax && c.ep != Epilogue::Store) throw ArgError("argmax needs a Store epilogue");
    pass.any_argmax = pass.any_argmax || c.argmax;
    total_rb += c.op->rowblocks() * (c.ep == Epilogue::SiluMul ? 2 : 1);
  }
  // about four tasks per thread over the rowblocks (work stealing evens out a busy core), in whole
  // groups of kGroupRowblocks: a task that starts or ends inside a group reads part of each of the
  // group's runs through the slower partial tiles (the bf16 kernels' rowblock pairs divide it too).
  // Decode passes of kernels that read groups as parallel streams take kGroupStreams groups a task
  // (the most streams), even where that leaves fewer tasks: on a 2-core Zen 3 VM (SmolLM2 Q4_1 decode
  // at 160 tokens, 4 interleaved rounds) q·k·v's pass took ~8% less time, o's and down's ~5%, than
  // with two-group tasks; three-group tasks (4 a thread for o) were slower than both.
  const int p = std::max(1, threads);
  const bool streams = std::all_of(cl.begin(), cl.end(), [&](const LinearCall& c) { return reads_streams(c, rows(c)); });
  const int rpt = streams ? kGroupStreams * kGroupRowblocks
                          : std::min(kMaxTaskRowblocks,
                                     std::max(kGroupRowblocks, int(round_up(size_t((total_rb + 4 * p - 1) / (4 * p)),
                                                                            kGroupRowblocks))));
  std::vector<LinearTask>& tasks = pass.tasks;
  bool any_strided = false;
  for (int ci = 0; ci < int(cl.size()); ++ci) {
    const LinearCall& c = cl[size_t(ci)];
    const int mc = rows(c);
    if (mc <= 0) continue;
    if (strided(c, mc, p)) {
      any_strided = true;
      const int G = c.op->groups(), q = (G + kGroupStreams - 1) / kGroupStreams;
      for (int i = 0; i < q; ++i) {
        LinearTask tk{ci, 0, 0, 0, mc};
        tk.g0 = i, tk.step = q, tk.count = (G - 1 - i) / q + 1;
        tasks.push_back(tk);
      }
      continue;
    }
    const int nrb = c.op->rowblocks();
    for (int t0 = 0; t0 < mc; t0 += kTokChunk)
      for (int rb = 0; rb < nrb; rb += rpt) tasks.push_back({ci, rb, std::min(nrb, rb + rpt), t0, std::min(kTokChunk, mc - t0)});
  }
  pass.ldc = (any_strided ? std::max(rpt, kGroupStreams * kGroupRowblocks) : rpt) * 16;
  pass.tile = size_t(kTokChunk) * pass.ldc;
  // per task, the best column of each of its rows (task i's row t at best[i * kTokChunk + t])
  if (pass.any_argmax) pass.best.assign(tasks.size() * kTokChunk, LinearBest{});
}

void run_linear_task(LinearPass& pass, int i, const LinearInput* in) {
  const LinearTask& tk = pass.tasks[size_t(i)];
  const LinearCall& c = pass.calls[size_t(tk.call)];
  const LinearInput& x = in ? *in : *c.in;
  const bool gated = c.ep == Epilogue::SiluMul;
  const int ldc = pass.ldc;
  if (t_tile.size() < 2 * pass.tile) t_tile.resize(2 * pass.tile);
  float* ct = t_tile.data();
  float* cu = ct + pass.tile;
  const float* bias = c.op->bias();
  const float* bias_up = gated ? c.up->bias() : nullptr;
  // the tile's runs of output columns: [n0, n0 + ncols) from column `at` of the tile
  auto finish = [&](int at, int n0, int ncols) {
    float* o = c.out + tk.t0 * c.ldo + n0;
    epilogue(c.ep, ct + at, cu + at, ldc, tk.nt, ncols, bias ? bias + n0 : nullptr, bias_up ? bias_up + n0 : nullptr,
             o, c.ldo);
    if (c.argmax)
      for (int t = 0; t < tk.nt; ++t) fold_best(o + t * c.ldo, ncols, n0, pass.best[size_t(i) * kTokChunk + size_t(t)]);
    if (pass.after) pass.after(tk.call, n0, ncols, tk.t0, tk.nt);
  };
  if (tk.step > 0) {
    c.op->tile_groups(x, tk.g0, tk.step, tk.count, c.row0 + tk.t0, tk.nt, ct, ldc);
    if (gated) c.up->tile_groups(x, tk.g0, tk.step, tk.count, c.row0 + tk.t0, tk.nt, cu, ldc);
    constexpr int kCols = kGroupRowblocks * 16;
    for (int g = 0; g < tk.count; ++g) {
      const int n0 = (tk.g0 + g * tk.step) * kCols;
      finish(g * kCols, n0, std::min(kCols, c.op->out_features() - n0));
    }
    return;
  }
  c.op->tile(x, tk.rb0, tk.rb1, c.row0 + tk.t0, tk.nt, ct, ldc);
  if (gated) c.up->tile(x, tk.rb0, tk.rb1, c.row0 + tk.t0, tk.nt, cu, ldc);
  const int n0 = tk.rb0 * 16;
  finish(0, n0, std::min(c.op->out_features(), tk.rb1 * 16) - n0);
}

void finish_linears(const LinearPass& pass) {
  if (!pass.any_argmax) return;
  const int m = pass.m;
  const auto rows = [m](const LinearCall& c) { return c.rows >= 0 ? c.rows : m; };
  for (int ci = 0; ci < int(pass.calls.size()); ++ci) {
    const LinearCall& c = pass.calls[size_t(ci)];
    if (!c.argmax) continue;
    std::vector<LinearBest> per_row(static_cast<size_t>(rows(c)));
    for (size_t i = 0; i < pass.tasks.size(); ++i) {
      const LinearTask& tk = pass.tasks[i];
      if (tk.call != ci) continue;
      for (int t = 0; t < tk.nt; ++t) {
        const LinearBest& b = pass.best[i * kTokChunk + size_t(t)];
        LinearBest& r = per_row[size_t(tk.t0 + t)];
        if (b.col >= 0 && beats(b.v, b.col, r)) r = b;
      }
    }
    for (int t = 0; t < rows(c); ++t) c.argmax[t] = per_row[size_t(t)].col;
  }
}

void run_linears(Pool& pool, const std::vector<LinearCall>& calls, int m) {
  if (m <= 0 || calls.empty()) return;
  // reused, its vectors keeping their room (a reference: the workers must see the caller's, not their own)
  thread_local LinearPass reused;
  LinearPass& pass = reused;
  plan_linears(pass, calls, m, pool.size());
  pool.run(int(pass.tasks.size()), [&](int i, int) { run_linear_task(pass, i, nullptr); });
  finish_linears(pass);
}

}  // namespace cpx
