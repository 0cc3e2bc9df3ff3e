#include "pool.h"

#include "common.h"

#include <sched.h>

#include <chrono>
#include <cstdlib>
#include <string>

namespace cpx {
namespace {
constexpr auto kSpin = std::chrono::microseconds(100);  // an idle worker spins this long, then sleeps
// Contention: two runs in a row late (the caller waited for workers longer than kLate and than its
// own share of work: a worker that is merely finishing a task makes it wait less than one task), or a
// window of kWindowRuns runs in which the caller waited more than kWaitShare x its own work (on a
// quiet machine the workers finish within a task of it: measured well under that). It sends the pool
// solo for kSoloFirst runs; after a solo period the next window probes: contention again sends it
// solo for twice the last period (up to kSoloMax: a quarter of a second of decode or so), a window
// without it ends it. The first period is short because a burst of other work looks the same at first:
// the server's and its clients' work for the tokens a step just made (a few ms of a ~30 ms step at 16
// streams) sent a pool that started at 256 runs solo for about a step each time, at half its speed. At
// 32, 16 streams served 564 against 462 tok/s (interleaved, medians of 8), and a busy neighbour slowed a
// request as much as before (bench/cpu_contention.py, 3 rounds: 0.44-0.49 s against 0.49-0.51 s).
constexpr auto kLate = std::chrono::microseconds(400);
constexpr int kLateRuns = 2;
constexpr int kWindowRuns = 32;
constexpr int64_t kWaitShare = 1;
constexpr int kSoloFirst = 32, kSoloMax = 4096;

std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int i = 0; i < CPU_SETSIZE; ++i)
      if (CPU_ISSET(i, &set)) cpus.push_back(i);
  }
  return cpus;
}
}  // namespace

Pool::Pool(int threads, bool pin) : n_(threads < 1 ? 1 : threads), ranges_(new Range[n_]) {
  if (const char* wait = std::getenv("MLASERVE_CPP_EXPERTS_WAIT")) adaptive_ = std::string(wait) != "spin";
  const std::vector<int> cpus = pin ? allowed_cpus() : std::vector<int>{};
  for (int i = 1; i < n_; ++i) {
    threads_.emplace_back([this, i] { worker(i); });
    name_thread(threads_.back(), ("cpx-pool-" + std::to_string(i)).c_str());
    if (!cpus.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpus[size_t(i) % cpus.size()], &set);
      pthread_setaffinity_np(threads_.back().native_handle(), sizeof(set), &set);
    }
  }
}

Pool::~Pool() { close(); }

void Pool::close() {
  std::lock_guard<std::mutex> job(job_mutex_);
  if (closed_) return;
  closed_ = true;
  {
    std::lock_guard<std::mutex> lock(sleep_mutex_);
    stop_ = true;
    gen_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
}

bool Pool::solo_next() const {
  std::lock_guard<std::mutex> job(job_mutex_);
  return closed_ || n_ == 1 || solo_left_ > 0;
}

bool Pool::closed() const {
  std::lock_guard<std::mutex> job(job_mutex_);
  return closed_;
}

void Pool::work(int id) {
  const std::function<void(int, int)>& fn = *fn_;
  for (int k = 0; k < n_; ++k) {
    Range& r = ranges_[(id + k) % n_];
    for (int i; (i = r.next.fetch_add(1, std::memory_order_relaxed)) < r.end;) fn(i, id);
  }
}

void Pool::worker(int id) {
  uint64_t seen = 0;
  for (;;) {
    const auto start = std::chrono::steady_clock::now();
    int spins = 0;
    while (gen_.load(std::memory_order_acquire) == seen) {
      pause();
      if (++spins % 256 == 0 && std::chrono::steady_clock::now() - start > kSpin) {
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        sleepers_.fetch_add(1, std::memory_order_relaxed);
        wake_.wait(lock, [&] { return gen_.load(std::memory_order_acquire) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
        break;
      }
    }
    seen = gen_.load(std::memory_order_acquire);
    if (stop_) return;
    work(id);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void Pool::run(int ntasks, const std::function<void(int, int)>& fn) {
  if (ntasks <= 0) return;
  std::lock_guard<std::mutex> job(job_mutex_);
  if (closed_ || n_ == 1 || ntasks == 1 || solo_left_ > 0) {
    if (solo_left_ > 0 && ntasks > 1) {
      if (--solo_left_ == 0) {
        probing_ = true;
        win_runs_ = 0, win_wait_ = win_work_ = 0;
      }
      solo_total_.fetch_add(1, std::memory_order_relaxed);
    }
    for (int i = 0; i < ntasks; ++i) fn(i, 0);
    return;
  }
  for (int p = 0; p < n_; ++p) {
    ranges_[p].next.store(int(int64_t(ntasks) * p / n_), std::memory_order_relaxed);
    ranges_[p].end = int(int64_t(ntasks) * (p + 1) / n_);
  }
  fn_ = &fn;
  pending_.store(n_ - 1, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(sleep_mutex_);
    gen_.fetch_add(1, std::memory_order_release);
  }
  if (sleepers_.load(std::memory_order_relaxed) > 0) wake_.notify_all();
  inner_wait_ns_ = 0;
  const auto t0 = std::chrono::steady_clock::now();
  work(0);
  const auto t1 = std::chrono::steady_clock::now();
  wait_until([this] { return pending_.load(std::memory_order_acquire) == 0; });
  const bool timing = timing_.load(std::memory_order_relaxed);
  if (!adaptive_ && !timing) return;
  const int64_t waited = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::steady_clock::now() - t1).count() + inner_wait_ns_,
                own = std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count() - inner_wait_ns_;
  if (timing) {
    timed_runs_.fetch_add(1, std::memory_order_relaxed);
    timed_wait_ns_.fetch_add(uint64_t(waited), std::memory_order_relaxed);
  }
  if (!adaptive_) return;
  const bool late = waited > kLate.count() * 1000 && waited > own;
  late_ = late ? late_ + 1 : 0;
  bool contended = late_ >= kLateRuns;
  win_wait_ += waited;
  win_work_ += own;
  const bool window_end = ++win_runs_ >= kWindowRuns;
  if (window_end) contended = contended || win_wait_ > kWaitShare * win_work_;
  if (contended) {
    solo_period_ = probing_ ? std::min(2 * solo_period_, kSoloMax) : kSoloFirst;
    solo_left_ = solo_period_;
    probing_ = false;
    late_ = 0;
  } else if (window_end && probing_) {
    probing_ = false;  // a whole window on time: the contention has passed
    solo_period_ = 0;
  }
  if (contended || window_end) win_runs_ = 0, win_wait_ = win_work_ = 0;
}

int default_threads() {
  if (const char* env = std::getenv("MLASERVE_CPP_EXPERTS_THREADS")) {
    const int v = std::atoi(env);
    if (v > 0) return v;
  }
  const size_t n = allowed_cpus().size();
  return n > 0 ? int(n) : 1;
}

}  // namespace cpx
