// The routed-expert operator: one layer's experts, each three QuantLinears (gate, up, down: any of
// their weight formats, GGUF blocks as stored, bf16 or f32, chosen per weight), and the two-job
// forward (gate+up with SiLU·mul, then down with the routing-weighted sum per token) on the worker
// pool it is bound to, run either on the calling thread (forward) or on a per-operator driver thread
// (submit/sync). Experts are set unbound; `bind` gives the operator a pool to compute on, `unbind`
// stops its driver thread and lets the pool go (the pool's owner closes it).
#pragma once
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common.h"
#include "linear_calls.h"
#include "pool.h"
#include "quant_linear.h"

namespace cpx {

// One forward call: raw pointers to tensors the Python side validated and keeps alive.
struct Job {
  const void* hidden = nullptr;
  bool hidden_bf16 = false;
  int tokens = 0;
  int k = 0;                      // experts a token: 1..top_k (0: top_k); an all-to-all sends one a row
  const int32_t* ids = nullptr;  // [T][k]
  const float* weights = nullptr;  // [T][k]
  void* out = nullptr;            // [T][H]
  bool out_bf16 = false;
};

class MoE {
 public:
  MoE(int experts, int top_k, int hidden, int inter);
  ~MoE();
  // expert e's gate and up [inter][hidden] and down [hidden][inter]
  void set_expert(int e, std::shared_ptr<QuantLinear> gate, std::shared_ptr<QuantLinear> up,
                  std::shared_ptr<QuantLinear> down);
  void finalize();
  size_t memory_bytes() const;
  void forward(const Job& job);  // validates, then computes on this thread + the pool
  void submit(const Job& job);   // validates, then hands the job to the driver thread
  void sync();                   // waits for the submitted job
  std::string kernel() const;    // expert 0's gate path
  std::string formats() const;   // the weight formats in use, e.g. "q4_k/q6_k"
  // after the pending submit (if any) completes; unbind also joins the driver thread
  void bind(std::shared_ptr<Pool> pool);
  void unbind();
  int threads() const { return pool_ ? pool_->size() : 0; }
  // failures recorded by this operator's host tasks (host_task.h): one cheap read per graph replay
  void note_host_failure() { host_failures_.fetch_add(1, std::memory_order_relaxed); }
  uint64_t host_failures() const { return host_failures_.load(std::memory_order_relaxed); }

 private:
  using Expert = std::array<std::shared_ptr<QuantLinear>, 3>;  // gate, up, down
  void validate(const Job& job) const;  // also that a pool is bound and open
  void compute(const Job& job);
  void driver();
  void stop_driver(std::unique_lock<std::mutex>& lock);

  int E_, K_, H_, I_;
  bool finalized_ = false;
  std::vector<Expert> experts_;
  std::vector<const QuantLinear*> gate_up_, down_;  // every expert's readers of each input (finalize)
  std::shared_ptr<Pool> pool_;

  // scratch, reused across calls
  std::vector<int> count_, offset_, slot_tok_;
  std::vector<int> tok_slots_;  // [T][K]: each token's slots, in expert order
  std::vector<float> slot_w_, xs_, inter_, acc_;  // xs_: the slots' inputs, then their down outputs
  LinearInput in_x_, in_h_;

  // async driver
  std::thread driver_;
  std::mutex dm_;
  std::condition_variable dcv_;
  Job job_;
  bool has_job_ = false, busy_ = false, stop_ = false;
  std::atomic<uint64_t> host_failures_{0};
};

}  // namespace cpx
