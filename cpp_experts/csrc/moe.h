// The routed-expert operator: packed expert weights plus the two-job forward (gate+up fused with
// SiLU·mul, then down with the routing-weighted sum per token) on the worker pool it is bound to, run
// either on the calling thread (forward) or on a per-operator driver thread (submit/sync). Weights
// are loaded unbound; `bind` gives the operator a pool to compute on, `unbind` stops its driver
// thread and lets the pool go (the pool's owner closes it).
#pragma once
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
#include "pool.h"

namespace cpx {

// One forward call: raw pointers to tensors the Python side validated and keeps alive.
struct Job {
  const void* hidden = nullptr;
  bool hidden_bf16 = false;
  int tokens = 0;
  const int32_t* ids = nullptr;  // [T][K]
  const float* weights = nullptr;  // [T][K]
  void* out = nullptr;            // [T][H]
  bool out_bf16 = false;
};

class MoE {
 public:
  MoE(int experts, int top_k, int hidden, int inter, const std::string& format, const std::string& kernel);
  ~MoE();
  void load_bf16(int e, const uint16_t* gate, const uint16_t* up, const uint16_t* down);
  void load_quant(int e, const uint8_t* gate, size_t gate_n, const uint8_t* up, size_t up_n,
                  const uint8_t* down, size_t down_n);
  void finalize();
  size_t memory_bytes() const;
  void forward(const Job& job);  // validates, then computes on this thread + the pool
  void submit(const Job& job);   // validates, then hands the job to the driver thread
  void sync();                   // waits for the submitted job
  std::string kernel_bf16() const;
  std::string kernel_q() const;
  // after the pending submit (if any) completes; unbind also joins the driver thread
  void bind(std::shared_ptr<Pool> pool);
  void unbind();
  int threads() const { return pool_ ? pool_->size() : 0; }
  // failures recorded by this operator's host tasks (host_task.h): one cheap read per graph replay
  void note_host_failure() { host_failures_.fetch_add(1, std::memory_order_relaxed); }
  uint64_t host_failures() const { return host_failures_.load(std::memory_order_relaxed); }

 private:
  struct Expert {
    Buffer w[3];       // gate, up, down
    Buffer scales[3];  // quant formats
    bool loaded = false;
  };
  Mat mat(int e, int which) const;
  void validate(const Job& job) const;  // also that a pool is bound and open
  void compute(const Job& job);
  void driver();
  void stop_driver(std::unique_lock<std::mutex>& lock);
  void pack_quant(const uint8_t* src, size_t n, int rows, int k, Expert& ex, int which,
                  const char* name, int e);

  int E_, K_, H_, I_, Hp_, Ip_;
  Format fmt_;
  const Kernels* kern_;
  bool amx_ = false;
  bool finalized_ = false;
  std::vector<Expert> experts_;
  std::shared_ptr<Pool> pool_;

  // scratch, reused across calls
  std::vector<int> count_, offset_, slot_tok_;
  std::vector<float> slot_w_;
  Buffer act_, act_d_, act_s_, inter_, inter_d_, inter_s_, acc_;
  std::vector<std::vector<float>> scratch_;

  // async driver
  std::thread driver_;
  std::mutex dm_;
  std::condition_variable dcv_;
  Job job_;
  bool has_job_ = false, busy_ = false, stop_ = false;
  std::atomic<uint64_t> host_failures_{0};
};

}  // namespace cpx
