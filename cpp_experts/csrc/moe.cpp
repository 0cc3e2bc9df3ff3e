#include "moe.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <set>

namespace cpx {

MoE::MoE(int experts, int top_k, int hidden, int inter) : E_(experts), K_(top_k), H_(hidden), I_(inter) {
  if (E_ <= 0 || K_ <= 0 || H_ <= 0 || I_ <= 0) throw ArgError("sizes must be positive");
  if (K_ > E_) throw ArgError("top_k (" + std::to_string(K_) + ") exceeds num_experts (" + std::to_string(E_) + ")");
  if (H_ > (1 << 20) || I_ > (1 << 20) || E_ > (1 << 16)) throw ArgError("sizes are implausibly large");
  experts_.resize(size_t(E_));
}

MoE::~MoE() {
  std::unique_lock<std::mutex> lock(dm_);
  stop_driver(lock);
}

// Waits for the pending job, then ends the driver thread (a later submit starts a new one).
void MoE::stop_driver(std::unique_lock<std::mutex>& lock) {
  dcv_.wait(lock, [&] { return !busy_; });
  if (!driver_.joinable()) return;
  stop_ = true;
  dcv_.notify_all();
  std::thread t = std::move(driver_);
  lock.unlock();
  t.join();
  lock.lock();
  stop_ = false;
}

void MoE::bind(std::shared_ptr<Pool> pool) {
  if (!pool) throw ArgError("bind needs a pool");
  std::unique_lock<std::mutex> lock(dm_);
  dcv_.wait(lock, [&] { return !busy_; });
  pool_ = std::move(pool);
}

void MoE::unbind() {
  std::unique_lock<std::mutex> lock(dm_);
  stop_driver(lock);
  pool_.reset();
}

void MoE::set_expert(int e, std::shared_ptr<QuantLinear> gate, std::shared_ptr<QuantLinear> up,
                     std::shared_ptr<QuantLinear> down) {
  if (e < 0 || e >= E_) throw ArgError("expert " + std::to_string(e) + " out of range [0, " + std::to_string(E_) + ")");
  const std::string which = "expert " + std::to_string(e) + " ";
  for (const auto* w : {&gate, &up}) {
    if (!*w || (*w)->out_features() != I_ || (*w)->in_features() != H_)
      throw ArgError(which + "gate/up must be [" + std::to_string(I_) + ", " + std::to_string(H_) + "]");
  }
  if (!down || down->out_features() != H_ || down->in_features() != I_)
    throw ArgError(which + "down must be [" + std::to_string(H_) + ", " + std::to_string(I_) + "]");
  std::unique_lock<std::mutex> lock(dm_);
  dcv_.wait(lock, [&] { return !busy_; });
  experts_[size_t(e)] = {std::move(gate), std::move(up), std::move(down)};
  finalized_ = false;
}

void MoE::finalize() {
  std::unique_lock<std::mutex> lock(dm_);
  dcv_.wait(lock, [&] { return !busy_; });
  gate_up_.clear();
  down_.clear();
  for (int e = 0; e < E_; ++e) {
    const Expert& ex = experts_[size_t(e)];
    if (!ex[0]) throw ArgError("expert " + std::to_string(e) + " was never loaded");
    gate_up_.push_back(ex[0].get());
    gate_up_.push_back(ex[1].get());
    down_.push_back(ex[2].get());
  }
  finalized_ = true;
}

size_t MoE::memory_bytes() const {
  size_t n = 0;
  for (const Expert& ex : experts_)
    for (const auto& w : ex)
      if (w) n += w->memory_bytes();
  return n;
}

std::string MoE::kernel() const { return experts_[0][0] ? experts_[0][0]->kernel() : std::string("unloaded"); }

std::string MoE::formats() const {
  std::set<std::string> names;
  for (const Expert& ex : experts_)
    for (const auto& w : ex)
      if (w) names.insert(w->format());
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : "/") + n;
  return out;
}

void MoE::validate(const Job& job) const {
  if (!finalized_) throw ArgError("finalize() must be called after loading the experts and before forward");
  if (!pool_) throw std::runtime_error("no worker pool is bound to this operator (bind one first)");
  if (pool_->closed()) throw std::runtime_error("the worker pool bound to this operator was closed");
  if (job.k < 0 || job.k > K_)
    throw ArgError("k (" + std::to_string(job.k) + ") must be from 1 to top_k (" + std::to_string(K_) + ")");
  const int K = job.k ? job.k : K_;
  const size_t n = size_t(job.tokens) * K;
  for (size_t i = 0; i < n; ++i) {
    const int32_t id = job.ids[i];
    if (id < 0 || id >= E_)
      throw ArgError("topk_ids[" + std::to_string(i / K) + ", " + std::to_string(i % K) + "] = " +
                     std::to_string(id) + " is out of range [0, " + std::to_string(E_) + ")");
    if (!std::isfinite(job.weights[i]))
      throw ArgError("topk_weights[" + std::to_string(i / K) + ", " + std::to_string(i % K) + "] is not finite");
  }
}

void MoE::forward(const Job& job) {
  validate(job);
  {
    std::lock_guard<std::mutex> lock(dm_);
    if (busy_) throw std::runtime_error("forward() called while a submit() is pending; call sync() first");
  }
  compute(job);
}

void MoE::submit(const Job& job) {
  validate(job);
  std::lock_guard<std::mutex> lock(dm_);
  if (busy_) throw std::runtime_error("submit() called while a previous submit() is pending; call sync() first");
  if (!driver_.joinable()) {
    driver_ = std::thread([this] { driver(); });
    name_thread(driver_, "cpx-moe-driver");
  }
  job_ = job;
  has_job_ = busy_ = true;
  dcv_.notify_all();
}

void MoE::sync() {
  std::unique_lock<std::mutex> lock(dm_);
  dcv_.wait(lock, [&] { return !busy_; });
}

void MoE::driver() {
  std::unique_lock<std::mutex> lock(dm_);
  for (;;) {
    dcv_.wait(lock, [&] { return has_job_ || stop_; });
    if (has_job_) {
      has_job_ = false;
      const Job job = job_;
      lock.unlock();
      compute(job);
      lock.lock();
      busy_ = false;
      dcv_.notify_all();
      continue;
    }
    if (stop_) return;
  }
}

}  // namespace cpx
