#include "host_task.h"

#include <cstring>
#include <exception>

namespace cpx {

std::string HostTask::take_error() {
  std::lock_guard<std::mutex> lock(m);
  std::string e;
  e.swap(error);
  return e;
}

}  // namespace cpx

namespace {

void record(cpx::HostTask* t, const char* what) {
  {
    std::lock_guard<std::mutex> lock(t->m);
    if (t->error.empty()) t->error = what;
  }
  t->op->note_host_failure();
}

}  // namespace

extern "C" void cpx_host_submit(void* p) {
  auto* t = static_cast<cpx::HostTask*>(p);
  try {
    t->op->submit(t->job);
    std::lock_guard<std::mutex> lock(t->m);
    t->submitted = true;
  } catch (const std::exception& e) {
    record(t, e.what());
  } catch (...) {
    record(t, "unknown error in the routed-expert submit");
  }
}

extern "C" void cpx_host_sync(void* p) {
  auto* t = static_cast<cpx::HostTask*>(p);
  bool submitted;
  {
    std::lock_guard<std::mutex> lock(t->m);
    submitted = t->submitted;
    t->submitted = false;
  }
  if (submitted) {
    try {
      t->op->sync();
    } catch (const std::exception& e) {
      record(t, e.what());
    } catch (...) {
      record(t, "unknown error in the routed-expert sync");
    }
  } else {
    // the submit failed: the graph copies this buffer back, so leave zeros rather than stale data
    std::memset(t->job.out, 0, t->out_bytes);
  }
  std::lock_guard<std::mutex> lock(t->m);
  ++t->runs;
}
