// pybind11 module cpp_experts._C. Tensors arrive as raw addresses: cpp_experts/__init__.py checks
// dtype, device, contiguity and shapes and keeps the tensors alive; this layer checks what needs a
// pass over the data (expert ids, routing weights, weight scales). The GIL is released for all
// heavy calls.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdlib>

#include "cpu.h"
#include "host_task.h"
#include "moe.h"
#include "quant_linear.h"

namespace py = pybind11;
using cpx::HostTask;
using cpx::MoE;
using cpx::Pool;
using cpx::QuantLinear;

namespace {

template <class T>
const T* ptr(uintptr_t p) {
  return reinterpret_cast<const T*>(p);
}

cpx::Job make_job(uintptr_t hidden, bool hidden_bf16, int tokens, uintptr_t ids, uintptr_t weights,
                  uintptr_t out, bool out_bf16) {
  cpx::Job j;
  j.hidden = reinterpret_cast<const void*>(hidden);
  j.hidden_bf16 = hidden_bf16;
  j.tokens = tokens;
  j.ids = ptr<int32_t>(ids);
  j.weights = ptr<float>(weights);
  j.out = reinterpret_cast<void*>(out);
  j.out_bf16 = out_bf16;
  return j;
}

py::dict info() {
  const cpx::CpuInfo& cpu = cpx::cpu_info();
  py::dict d;
  d["cpu_flags"] = cpu.flags;
  d["amx_hw"] = cpu.amx_hw;
  d["amx_usable"] = cpu.amx_usable;
  std::vector<std::string> kernels;
  if (cpu.amx_usable) kernels.push_back("amx");
  if (cpu.amx_int8) kernels.push_back("amx_int8");
  if (cpu.avx512_bf16) kernels.push_back("avx512_bf16");
  if (cpu.avx512_vnni) kernels.push_back("avx512_vnni");
  if (cpu.avx2) kernels.push_back("avx2");
  kernels.push_back("portable");
  d["kernels"] = kernels;
  d["default_threads"] = cpx::default_threads();
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Routed-expert MoE and quantised dense layers on a worker pool (see cpp_experts/__init__.py)";
  py::register_exception<cpx::ArgError>(m, "ArgError", PyExc_ValueError);
  m.def("info", &info);
  // Worker threads, made and closed by their owner; operators bound to one share it.
  py::class_<Pool, std::shared_ptr<Pool>>(m, "Pool")
      .def(py::init<int, bool>())
      .def_property_readonly("threads", &Pool::size)
      .def_property_readonly("closed", &Pool::closed)
      .def("close", &Pool::close, py::call_guard<py::gil_scoped_release>());
  py::class_<MoE>(m, "MoE")
      .def(py::init<int, int, int, int, const std::string&, const std::string&>())
      .def("bind", &MoE::bind, py::call_guard<py::gil_scoped_release>())
      .def("unbind", &MoE::unbind, py::call_guard<py::gil_scoped_release>())
      .def("load_bf16",
           [](MoE& self, int e, uintptr_t g, uintptr_t u, uintptr_t d) {
             self.load_bf16(e, ptr<uint16_t>(g), ptr<uint16_t>(u), ptr<uint16_t>(d));
           },
           py::call_guard<py::gil_scoped_release>())
      .def("load_quant",
           [](MoE& self, int e, uintptr_t g, size_t gn, uintptr_t u, size_t un, uintptr_t d, size_t dn) {
             self.load_quant(e, ptr<uint8_t>(g), gn, ptr<uint8_t>(u), un, ptr<uint8_t>(d), dn);
           },
           py::call_guard<py::gil_scoped_release>())
      .def("finalize", &MoE::finalize)
      .def_property_readonly("memory_bytes", &MoE::memory_bytes)
      .def_property_readonly("threads", &MoE::threads)
      .def_property_readonly("kernel_bf16", &MoE::kernel_bf16)
      .def_property_readonly("kernel_q", &MoE::kernel_q)
      .def_property_readonly("host_failures", &MoE::host_failures)
      .def("forward",
           [](MoE& self, uintptr_t h, bool hb, int t, uintptr_t ids, uintptr_t w, uintptr_t out, bool ob) {
             self.forward(make_job(h, hb, t, ids, w, out, ob));
           },
           py::call_guard<py::gil_scoped_release>())
      .def("submit",
           [](MoE& self, uintptr_t h, bool hb, int t, uintptr_t ids, uintptr_t w, uintptr_t out, bool ob) {
             self.submit(make_job(h, hb, t, ids, w, out, ob));
           },
           py::call_guard<py::gil_scoped_release>())
      .def("sync", &MoE::sync, py::call_guard<py::gil_scoped_release>());
  // A dense layer on GGUF blocks (quant_linear.h); packs its weights once, in the constructor.
  py::class_<QuantLinear>(m, "QuantLinear")
      .def(py::init([](const std::string& fmt, int n, int k, uintptr_t data, size_t nbytes, uintptr_t bias,
                       const std::string& kernel) {
        py::gil_scoped_release release;
        return new QuantLinear(fmt, n, k, ptr<uint8_t>(data), nbytes, bias ? ptr<float>(bias) : nullptr, kernel);
      }))
      .def("bind", &QuantLinear::bind, py::call_guard<py::gil_scoped_release>())
      .def("unbind", &QuantLinear::unbind, py::call_guard<py::gil_scoped_release>())
      .def("forward",
           [](QuantLinear& self, uintptr_t x, bool bf16, int m, uintptr_t out) {
             self.forward(reinterpret_cast<const void*>(x), bf16, m, reinterpret_cast<void*>(out));
           },
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("kernel", &QuantLinear::kernel)
      .def_property_readonly("memory_bytes", &QuantLinear::memory_bytes)
      .def_property_readonly("threads", &QuantLinear::threads);
  // A call bound to fixed buffers for CUDA host nodes (host_task.h); keeps its MoE alive.
  py::class_<HostTask>(m, "HostTask")
      .def(py::init([](MoE& op, uintptr_t h, bool hb, int t, uintptr_t ids, uintptr_t w, uintptr_t out, bool ob,
                       size_t out_bytes) {
             return new HostTask(&op, make_job(h, hb, t, ids, w, out, ob), out_bytes);
           }),
           py::keep_alive<1, 2>())
      .def_property_readonly("address", [](HostTask& self) { return reinterpret_cast<uintptr_t>(&self); })
      .def_property_readonly("runs",
                             [](HostTask& self) {
                               std::lock_guard<std::mutex> lock(self.m);
                               return self.runs;
                             })
      .def("take_error", &HostTask::take_error);
  m.def("host_functions", [] {
    return py::make_tuple(reinterpret_cast<uintptr_t>(&cpx_host_submit), reinterpret_cast<uintptr_t>(&cpx_host_sync));
  });
}
