// Fixed worker pool with per-thread task ranges and work stealing.
//
// run(n, fn) splits tasks [0, n) into one contiguous range per participant; each participant
// (the calling thread is participant 0) takes tasks from its own range with an atomic fetch_add
// and, when it runs dry, from the others' ranges the same way: no lock on the hot path. Idle
// workers spin briefly on a generation counter, then sleep on a condition variable.
//
// On a machine shared with other busy processes a worker can be preempted in the middle of a task,
// and the caller must wait for it: a spinning wait would hold the core the worker needs, and a run
// per matrix-vector product would make every run that slow. So the caller spins briefly, then yields
// its core while it waits; and when runs keep finding a worker late by much more than the caller's
// own share of the work (`kLate`), or when over a window of runs the caller spent a large share of its
// time waiting for workers (each woken late by a scheduler that has another busy process to serve),
// the pool runs alone on the calling thread for a while (`solo` runs), then probes its workers for a
// window: contention still there doubles the next solo period, a window without it ends it. MLASERVE_CPP_EXPERTS_WAIT=spin
// turns both off (the caller spins until every worker is done, as a pool on a dedicated machine
// would): benchmarks compare the two.
//
// A pool is an object its owner makes and closes (the Python side's `cpp_experts.WorkerPool`, made by
// the executor): operators hold it while bound to it, and there is no process-wide pool.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "cpu.h"  // CPX_X86
#if CPX_X86
#include <immintrin.h>
#endif

namespace cpx {

class Pool {
 public:
  static constexpr int kWaitPauses = 1024;  // a waiting caller's pauses before it yields
  Pool(int threads, bool pin);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  int size() const { return n_; }
  // Runs done alone because of contention since the pool was made (for benchmarks and tests).
  uint64_t solo_runs() const { return solo_total_.load(std::memory_order_relaxed); }
  // With timing on (a profiler: model.h's CpuProfile), the parallel runs since the pool was made and
  // the time their callers waited for workers after their own share (a run's imbalance).
  void set_timing(bool on) { timing_.store(on, std::memory_order_relaxed); }
  uint64_t timed_runs() const { return timed_runs_.load(std::memory_order_relaxed); }
  uint64_t timed_wait_ns() const { return timed_wait_ns_.load(std::memory_order_relaxed); }
  // Runs fn(task, participant) for every task; returns when all are done. fn must not throw.
  // Calls from different threads are serialised. On a closed pool the caller runs every task.
  void run(int ntasks, const std::function<void(int, int)>& fn);
  // Whether the next run would be done alone (a solo period after contention, a closed pool, or one
  // thread): a caller that would run its own participants' program (model.h) runs its passes as
  // separate runs instead, so that a solo period counts runs as before.
  bool solo_next() const;
  // From inside a run's task on the calling thread: `ns` of its time were spent waiting for the
  // workers (a participants' program waiting at its barriers), which the run then counts as waiting,
  // not as the caller's own work, when it judges contention.
  void add_inner_wait(int64_t ns) { inner_wait_ns_ += ns; }
  // Waits until done() holds, as the caller waits for its workers: a short spin, then (unless
  // MLASERVE_CPP_EXPERTS_WAIT=spin) yielding the core each try, as a preempted participant may need it
  // to finish its task. For code that waits for the workers itself (the model's decode program).
  template <class Done>
  void wait_until(const Done& done) const {
    for (int pauses = 0; !done();) {
      if (pauses < kWaitPauses || !adaptive_) {
        ++pauses;
        pause();
      } else {
        std::this_thread::yield();
      }
    }
  }
  // Joins the workers (after the run under way, if any); idempotent, also done by the destructor.
  void close();
  bool closed() const;

 private:
  static void pause() {
#if CPX_X86
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("isb" ::: "memory");  // a short stall, as Rust's spin_loop takes on aarch64
#else
    std::this_thread::yield();
#endif
  }
  struct alignas(64) Range {
    std::atomic<int> next{0};
    int end = 0;
  };
  void worker(int id);
  void work(int id);

  int n_;
  std::unique_ptr<Range[]> ranges_;
  const std::function<void(int, int)>* fn_ = nullptr;
  alignas(64) std::atomic<uint64_t> gen_{0};
  alignas(64) std::atomic<int> pending_{0};
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  mutable std::mutex job_mutex_;
  bool closed_ = false;  // guarded by job_mutex_
  bool adaptive_ = true;  // yield while waiting, solo runs under contention (MLASERVE_CPP_EXPERTS_WAIT)
  // contention state, guarded by job_mutex_
  int late_ = 0;         // recent runs that waited long for a worker
  int solo_left_ = 0;    // runs still to do alone
  int solo_period_ = 0;  // length of the last solo period (0: no contention seen lately)
  bool probing_ = false;  // back from a solo period: the next window decides whether contention lasts
  int win_runs_ = 0;      // parallel runs in the current window
  int64_t win_wait_ = 0, win_work_ = 0;  // the caller's waiting for workers and own work in it (ns)
  std::atomic<uint64_t> solo_total_{0};
  int64_t inner_wait_ns_ = 0;  // add_inner_wait during the run under way (the calling thread's)
  std::atomic<bool> timing_{false};
  std::atomic<uint64_t> timed_runs_{0}, timed_wait_ns_{0};
  std::atomic<int> sleepers_{0};
  std::vector<std::thread> threads_;
};

int default_threads();  // MLASERVE_CPP_EXPERTS_THREADS, else the CPUs in this process's affinity mask

}  // namespace cpx
