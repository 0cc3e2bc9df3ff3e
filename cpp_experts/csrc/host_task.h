// A routed-expert call bound once to fixed buffers, run from CUDA host nodes so that a captured
// decode graph can contain the CPU experts: the graph copies the activations into pinned memory,
// a host node runs `cpx_host_submit` (hands the job to the operator's driver thread and returns), the
// GPU runs the shared experts, a second host node runs `cpx_host_sync` (waits for the pool), and the
// graph copies the result back. The entry points are plain C functions with CUDA's host-function
// signature (`void fn(void*)`), so the extension needs no CUDA headers or libraries: Python hands
// their addresses to `cuLaunchHostFunc`.
//
// Host functions run on a CUDA driver thread, must not call CUDA and must not throw: a failure (an
// expert id out of range, a non-finite routing weight) is recorded in the task, the sync node zeroes
// the output instead of waiting, and Python reads the message once the stream has been synchronized.
#pragma once
#include <cstdint>
#include <mutex>
#include <string>

#include "moe.h"

namespace cpx {

struct HostTask {
  HostTask(MoE* op, const Job& job, size_t out_bytes) : op(op), job(job), out_bytes(out_bytes) {}
  MoE* op;
  Job job;
  size_t out_bytes;
  std::mutex m;           // guards the fields below (the driver thread writes, Python reads)
  bool submitted = false;  // the submit node handed the job over; the sync node must wait for it
  std::string error;       // first failure since Python last took it
  uint64_t runs = 0;       // completed submit+sync pairs, failed ones included
  std::string take_error();
};

}  // namespace cpx

extern "C" {
void cpx_host_submit(void* task);
void cpx_host_sync(void* task);
}
