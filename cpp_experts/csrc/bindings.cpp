// pybind11 module cpp_experts._C. Tensors arrive as raw addresses: cpp_experts/__init__.py checks
// dtype, device, contiguity and shapes and keeps the tensors alive; this layer checks what needs a
// pass over the data (expert ids, routing weights, weight scales). The GIL is released for all
// heavy calls.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdlib>
#include <stdexcept>

#include "attention.h"
#include "vec.h"
#include "cpu.h"
#include "model.h"
#include "host_task.h"
#include "omnikv.h"
#include "moe.h"
#include "quant_linear.h"
#include "sample.h"

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
                  uintptr_t out, bool out_bf16, int k = 0) {
  cpx::Job j;
  j.k = k;
  j.hidden = reinterpret_cast<const void*>(hidden);
  j.hidden_bf16 = hidden_bf16;
  j.tokens = tokens;
  j.ids = ptr<int32_t>(ids);
  j.weights = ptr<float>(weights);
  j.out = reinterpret_cast<void*>(out);
  j.out_bf16 = out_bf16;
  return j;
}

// Paged attention with its own scratch, on a pool (attention.h). Addresses of tensors the Python side checked.
struct PagedAttention {
  std::shared_ptr<Pool> pool;
  cpx::AttnScratch scratch;
  std::mutex m;  // one call at a time (the scratch)
};

cpx::PagedKv make_kv(uintptr_t k, uintptr_t v, bool bf16, int64_t k_stride, int64_t v_stride, int64_t num_slots,
                     uintptr_t table, int64_t table_rows, int64_t table_stride) {
  cpx::PagedKv kv;
  kv.k = reinterpret_cast<const void*>(k);
  kv.v = reinterpret_cast<const void*>(v);
  kv.type = bf16 ? cpx::KvType::BF16 : cpx::KvType::F32;
  kv.k_stride = k_stride;
  kv.v_stride = v_stride;
  kv.num_slots = num_slots;
  kv.table = ptr<int32_t>(table);
  kv.table_rows = table_rows;
  kv.table_stride = table_stride;
  return kv;
}

// Per-token slot lists (AttnTokens::sel) from addresses: empty = none, a null address = that token
// reads its row; every slot is checked against the pool.
struct SlotLists {
  std::vector<const int32_t*> ptr;
  std::vector<int64_t> n;
  void attach(cpx::AttnTokens& tok, const cpx::PagedKv& kv) {
    if (ptr.empty()) return;
    if (int(ptr.size()) != tok.T || int(n.size()) != tok.T) throw cpx::ArgError("one slot list per token");
    for (int t = 0; t < tok.T; ++t)
      for (int64_t j = 0; ptr[size_t(t)] && j < n[size_t(t)]; ++j)
        if (ptr[size_t(t)][j] < 0 || ptr[size_t(t)][j] >= kv.num_slots)
          throw cpx::ArgError("token " + std::to_string(t) + ": KV slot " + std::to_string(ptr[size_t(t)][j]) +
                              " is outside the pool");
    tok.sel = ptr.data();
    tok.sel_n = n.data();
  }
};

SlotLists make_slot_lists(const std::vector<uintptr_t>& sel, const std::vector<int64_t>& sel_n) {
  SlotLists s;
  for (uintptr_t p : sel) s.ptr.push_back(ptr<int32_t>(p));
  s.n = sel_n;
  return s;
}

cpx::Norm make_norm(uintptr_t w, int n, float eps) {
  cpx::Norm norm;
  norm.w.assign(ptr<float>(w), ptr<float>(w) + n);
  norm.eps = eps;
  return norm;
}

cpx::Rope make_rope(uintptr_t table, int64_t max_pos, int dim, bool interleaved) {
  cpx::Rope r;
  r.cos_sin = ptr<float>(table);
  r.max_pos = max_pos;
  r.dim = dim;
  r.interleaved = interleaved;
  return r;
}

py::dict info() {
  const cpx::CpuInfo& cpu = cpx::cpu_info();
  py::dict d;
  d["x86_paths"] = bool(CPX_X86);  // built with the AVX2 / AVX-512 / AMX paths (cpu.h); else portable only
  d["cpu_flags"] = cpu.flags;
  d["cpu_vendor_amd"] = cpu.amd;
  d["cpu_family"] = cpu.family;
  d["amx_hw"] = cpu.amx_hw;
  d["amx_usable"] = cpu.amx_usable;
  std::vector<std::string> kernels;
  if (cpu.amx_usable) kernels.push_back("amx");
  if (cpu.amx_int8) kernels.push_back("amx_int8");
  if (cpu.avx512_bf16) kernels.push_back("avx512_bf16");
  if (cpu.avx512_vnni) kernels.push_back("avx512_vnni");
  if (cpu.avx2) kernels.push_back("avx2");
  if (cpu.arm_dotprod) kernels.push_back("neon_dotprod");
  kernels.push_back("portable");
  if (cpu.avx512_vnni && cpu.avx512_bf16) kernels.push_back("amx_emulated");  // for tests: AMX code, tiles modelled
  d["kernels"] = kernels;
  d["default_threads"] = cpx::default_threads();
  d["attention_bf16_dot"] = cpx::attention_bf16_dot();  // attention over a bf16 cache on vdpbf16ps (attention.h)
  d["attention_lanes"] = cpx::vec::lanes();  // the attention kernels' vector width (16: the AVX-512 build)
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
      .def_property_readonly("solo_runs", &Pool::solo_runs)
      .def_property_readonly("closed", &Pool::closed)
      .def("close", &Pool::close, py::call_guard<py::gil_scoped_release>());
  py::class_<MoE>(m, "MoE")
      .def(py::init<int, int, int, int>())
      .def("bind", &MoE::bind, py::call_guard<py::gil_scoped_release>())
      .def("unbind", &MoE::unbind, py::call_guard<py::gil_scoped_release>())
      .def("set_expert", &MoE::set_expert, py::call_guard<py::gil_scoped_release>())
      .def("finalize", &MoE::finalize, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("memory_bytes", &MoE::memory_bytes)
      .def_property_readonly("threads", &MoE::threads)
      .def_property_readonly("kernel", &MoE::kernel)
      .def_property_readonly("formats", &MoE::formats)
      .def_property_readonly("host_failures", &MoE::host_failures)
      .def("forward",
           [](MoE& self, uintptr_t h, bool hb, int t, uintptr_t ids, uintptr_t w, uintptr_t out, bool ob, int k) {
             self.forward(make_job(h, hb, t, ids, w, out, ob, k));
           },
           py::arg("hidden"), py::arg("hidden_bf16"), py::arg("tokens"), py::arg("ids"), py::arg("weights"),
           py::arg("out"), py::arg("out_bf16"), py::arg("k") = 0, py::call_guard<py::gil_scoped_release>())
      .def("submit",
           [](MoE& self, uintptr_t h, bool hb, int t, uintptr_t ids, uintptr_t w, uintptr_t out, bool ob, int k) {
             self.submit(make_job(h, hb, t, ids, w, out, ob, k));
           },
           py::arg("hidden"), py::arg("hidden_bf16"), py::arg("tokens"), py::arg("ids"), py::arg("weights"),
           py::arg("out"), py::arg("out_bf16"), py::arg("k") = 0, py::call_guard<py::gil_scoped_release>())
      .def("sync", &MoE::sync, py::call_guard<py::gil_scoped_release>());
  // A dense layer on GGUF blocks (quant_linear.h); packs its weights once, in the constructor.
  py::class_<QuantLinear, std::shared_ptr<QuantLinear>>(m, "QuantLinear")
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
      .def("dequant_rows",
           [](const QuantLinear& self, uintptr_t ids, int n, uintptr_t out) {
             const int64_t* id = ptr<int64_t>(ids);
             float* o = reinterpret_cast<float*>(out);
             for (int i = 0; i < n; ++i) self.dequant_row(int(id[i]), o + size_t(i) * self.in_features());
           },
           py::call_guard<py::gil_scoped_release>())
      .def("set_bias", [](QuantLinear& self, uintptr_t bias) { self.set_bias(bias ? ptr<float>(bias) : nullptr); })
      .def_property_readonly("in_features", &QuantLinear::in_features)
      .def_property_readonly("format", &QuantLinear::format)
      .def_property_readonly("out_features", &QuantLinear::out_features)
      .def_property_readonly("kernel", &QuantLinear::kernel)
      .def_property_readonly("memory_bytes", &QuantLinear::memory_bytes)
      .def_property_readonly("threads", &QuantLinear::threads);
  py::class_<PagedAttention>(m, "PagedAttention")
      .def(py::init([](std::shared_ptr<Pool> pool) {
        if (!pool) throw cpx::ArgError("PagedAttention needs a pool");
        auto* a = new PagedAttention();
        a->pool = std::move(pool);
        return a;
      }))
      .def("gqa",
           [](PagedAttention& self, uintptr_t q, int T, int H, int Hkv, int D, int Dv, float scale, uintptr_t k,
              uintptr_t v, bool bf16, int64_t num_slots, uintptr_t table, int64_t table_rows, int64_t table_stride,
              uintptr_t rows, uintptr_t pos, uintptr_t out, std::vector<uintptr_t> sel, std::vector<int64_t> sel_n) {
             std::lock_guard<std::mutex> lock(self.m);
             const cpx::PagedKv kv = make_kv(k, v, bf16, int64_t(Hkv) * D, int64_t(Hkv) * Dv, num_slots, table,
                                             table_rows, table_stride);
             cpx::AttnTokens tok{T, ptr<int64_t>(rows), ptr<int64_t>(pos)};
             cpx::check_attention_tokens(kv, tok);
             SlotLists lists = make_slot_lists(sel, sel_n);
             lists.attach(tok, kv);
             cpx::attention_gqa(*self.pool, self.scratch, kv, tok, ptr<float>(q), H, Hkv, D, Dv, scale,
                                reinterpret_cast<float*>(out));
           },
           py::call_guard<py::gil_scoped_release>())
      .def("mla",
           [](PagedAttention& self, uintptr_t q, int T, int H, int r, int P, float scale, uintptr_t latent, bool bf16,
              int64_t num_slots, uintptr_t table, int64_t table_rows, int64_t table_stride, uintptr_t rows,
              uintptr_t pos, uintptr_t out, std::vector<uintptr_t> sel, std::vector<int64_t> sel_n) {
             std::lock_guard<std::mutex> lock(self.m);
             const cpx::PagedKv kv = make_kv(latent, 0, bf16, r + P, 0, num_slots, table, table_rows, table_stride);
             cpx::AttnTokens tok{T, ptr<int64_t>(rows), ptr<int64_t>(pos)};
             cpx::check_attention_tokens(kv, tok);
             SlotLists lists = make_slot_lists(sel, sel_n);
             lists.attach(tok, kv);
             cpx::attention_mla(*self.pool, self.scratch, kv, tok, ptr<float>(q), H, r, P, scale,
                                reinterpret_cast<float*>(out));
           },
           py::call_guard<py::gil_scoped_release>());
  // A whole decoder on the CPU (model.h); the Python wrapper keeps every object it is given alive.
  using cpx::CpuModel;
  py::class_<CpuModel>(m, "CpuModel")
      .def(py::init([](std::shared_ptr<Pool> pool, int hidden, const QuantLinear& embed, const QuantLinear& lm_head,
                       uintptr_t norm, float eps) {
        return new CpuModel(std::move(pool), hidden, &embed, &lm_head, make_norm(norm, hidden, eps));
      }))
      .def("set_profiling", &CpuModel::set_profiling, py::call_guard<py::gil_scoped_release>())
      .def("set_decode_program", &CpuModel::set_decode_program, py::call_guard<py::gil_scoped_release>())
      .def("decode_program", &CpuModel::decode_program, py::call_guard<py::gil_scoped_release>())
      .def("set_kv_ahead", &CpuModel::set_kv_ahead, py::call_guard<py::gil_scoped_release>())
      .def("kv_ahead", &CpuModel::kv_ahead, py::call_guard<py::gil_scoped_release>())
      .def("reset_profile", &CpuModel::reset_profile, py::call_guard<py::gil_scoped_release>())
      .def("profile",
           [](CpuModel& self) {
             cpx::CpuProfile p;
             {
               py::gil_scoped_release release;
               p = self.profile();
             }
             py::dict phases;
             for (int i = 0; i < int(cpx::Phase::kCount); ++i) {
               const cpx::PhaseStat& st = p.phase[i];
               if (!st.calls) continue;
               py::dict d;
               d["calls"] = st.calls;
               d["ns"] = st.ns;
               d["pool_runs"] = st.pool_runs;
               d["wait_ns"] = st.wait_ns;
               phases[cpx::phase_name(cpx::Phase(i))] = d;
             }
             py::dict out;
             out["forwards"] = p.forwards;
             out["forward_ns"] = p.forward_ns;
             out["program_forwards"] = p.program_forwards;
             out["phases"] = phases;
             return out;
           })
      .def("set_table",
           [](CpuModel& self, uintptr_t table, int64_t rows, int64_t stride, int64_t slots) {
             self.set_table(ptr<int32_t>(table), rows, stride, slots);
           })
      .def("add_gqa",
           [](CpuModel& self, uintptr_t norm, int hidden, float eps, const QuantLinear& q, const QuantLinear& k,
              const QuantLinear& v, const QuantLinear& o, int H, int Hkv, int D, float scale, uintptr_t rope,
              int64_t max_pos, int rope_dim, bool interleaved, uintptr_t k_cache, uintptr_t v_cache, bool bf16,
              uintptr_t q_norm, uintptr_t k_norm, float qk_eps) {
             cpx::GqaSpec s;
             s.norm = make_norm(norm, hidden, eps);
             if (q_norm) s.q_norm = make_norm(q_norm, D, qk_eps);
             if (k_norm) s.k_norm = make_norm(k_norm, D, qk_eps);
             s.q = &q;
             s.k = &k;
             s.v = &v;
             s.o = &o;
             s.H = H;
             s.Hkv = Hkv;
             s.D = D;
             s.scale = scale;
             s.rope = make_rope(rope, max_pos, rope_dim, interleaved);
             s.k_cache = reinterpret_cast<void*>(k_cache);
             s.v_cache = reinterpret_cast<void*>(v_cache);
             s.kv_type = bf16 ? cpx::KvType::BF16 : cpx::KvType::F32;
             self.add_gqa(std::move(s));
           })
      .def("add_mla",
           [](CpuModel& self, uintptr_t norm, int hidden, float eps, const QuantLinear* q, const QuantLinear* q_a,
              uintptr_t q_a_norm, float q_a_eps, const QuantLinear* q_b, const QuantLinear& kv_a, uintptr_t kv_norm,
              float kv_eps, std::vector<const QuantLinear*> w_kc, std::vector<const QuantLinear*> w_vc,
              const QuantLinear& o, int H, int N, int P, int V, int r, float scale, uintptr_t rope, int64_t max_pos,
              bool interleaved, uintptr_t latent, bool bf16) {
             cpx::MlaSpec s;
             s.norm = make_norm(norm, hidden, eps);
             s.q = q;
             s.q_a = q_a;
             if (q_a) s.q_a_norm = make_norm(q_a_norm, q_a->out_features(), q_a_eps);
             s.q_b = q_b;
             s.kv_a = &kv_a;
             s.kv_norm = make_norm(kv_norm, r, kv_eps);
             s.w_kc = std::move(w_kc);
             s.w_vc = std::move(w_vc);
             s.o = &o;
             s.H = H;
             s.N = N;
             s.P = P;
             s.V = V;
             s.r = r;
             s.scale = scale;
             s.rope = make_rope(rope, max_pos, P, interleaved);
             s.latent = reinterpret_cast<void*>(latent);
             s.kv_type = bf16 ? cpx::KvType::BF16 : cpx::KvType::F32;
             self.add_mla(std::move(s));
           })
      .def("add_dense_mlp",
           [](CpuModel& self, uintptr_t norm, int hidden, float eps, const QuantLinear& gate, const QuantLinear& up,
              const QuantLinear& down) {
             self.add_dense_mlp(cpx::DenseMlpSpec{make_norm(norm, hidden, eps), &gate, &up, &down});
           })
      .def("add_moe",
           [](CpuModel& self, uintptr_t norm, int hidden, float eps, uintptr_t router, uintptr_t bias, int E, int K,
              bool sigmoid, int method, int n_group, int topk_group, bool norm_topk, float scaling, MoE& experts,
              const QuantLinear* sg, const QuantLinear* su, const QuantLinear* sd, uintptr_t shared_scale) {
             cpx::MoeSpec s;
             s.norm = make_norm(norm, hidden, eps);
             s.router.assign(ptr<float>(router), ptr<float>(router) + size_t(E) * size_t(hidden));
             if (bias) s.bias.assign(ptr<float>(bias), ptr<float>(bias) + E);
             s.E = E;
             s.K = K;
             s.sigmoid = sigmoid;
             if (method < 0 || method > 2) throw cpx::ArgError("unknown top-k method");
             s.method = cpx::TopkMethod(method);
             s.n_group = n_group;
             s.topk_group = topk_group;
             s.norm_topk = norm_topk;
             s.scaling = scaling;
             s.experts = &experts;
             s.shared_gate = sg;
             s.shared_up = su;
             s.shared_down = sd;
             if (shared_scale)
               s.shared_scale.assign(ptr<float>(shared_scale), ptr<float>(shared_scale) + size_t(hidden));
             self.add_moe(std::move(s));
           })
      .def("set_omnikv",
           [](CpuModel& self, std::vector<int> roles, std::vector<int> source, int64_t sink, int64_t recent, int alpha,
              uintptr_t hist_q, uintptr_t hist_pos, int64_t hist_rows, int hist_filters, int window, int H, int D) {
             cpx::OmniSpec s;
             s.roles = std::move(roles);
             s.source = std::move(source);
             s.sink = sink;
             s.recent = recent;
             if (alpha < 0 || alpha > 2) throw cpx::ArgError("unknown OmniKV alpha mode");
             s.alpha = cpx::Alpha(alpha);
             s.hist_q = reinterpret_cast<float*>(hist_q);
             s.hist_pos = reinterpret_cast<int64_t*>(hist_pos);
             if (hist_q) {
               int filters = 0;
               for (int r : s.roles) filters += r == cpx::kRoleFilter;
               if (hist_filters != filters)
                 throw cpx::ArgError("the query history holds " + std::to_string(hist_filters) +
                                     " filter layers, the plan has " + std::to_string(filters));
             }
             s.hist_rows = hist_rows;
             s.window = window;
             s.H = H;
             s.D = D;
             self.set_omnikv(std::move(s));
           })
      .def("forward",
           [](CpuModel& self, int T, uintptr_t ids, uintptr_t pos, uintptr_t rows, uintptr_t loc, int N,
              uintptr_t logit_rows, uintptr_t logits, uintptr_t omni_k, bool want_argmax) {
             int64_t counts[2] = {0, 0};
             std::vector<int64_t> argmax(want_argmax ? size_t(std::max(N, 0)) : 0);
             {
               py::gil_scoped_release release;
               self.forward(T, ptr<int64_t>(ids), ptr<int64_t>(pos), ptr<int64_t>(rows), ptr<int64_t>(loc), N,
                            ptr<int64_t>(logit_rows), reinterpret_cast<float*>(logits), ptr<int64_t>(omni_k), counts,
                            want_argmax ? argmax.data() : nullptr);
             }
             // (omni counts, argmax list or None): the list is made with the GIL held
             py::object best = want_argmax ? py::object(py::cast(argmax)) : py::object(py::none());
             return py::make_tuple(std::make_pair(counts[0], counts[1]), best);
           })
      .def("omnikv_selection", &CpuModel::omnikv_selection, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_layers", &CpuModel::num_layers);
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
  // executor/sampler.py's draw (sample.h); the wrapper in cpp_experts/__init__.py checks the tensor and
  // the settings, these the lengths
  m.def("sample_rows", [](uintptr_t x, int64_t stride, int64_t vocab, const std::vector<int64_t>& rows,
                          const std::vector<float>& temperature, const std::vector<int64_t>& top_k,
                          const std::vector<float>& top_p, const std::vector<float>& log_min_p,
                          const std::vector<uint64_t>& keys) {
    const size_t n = rows.size();
    if (temperature.size() != n || top_k.size() != n || top_p.size() != n || log_min_p.size() != n || keys.size() != n)
      throw std::invalid_argument("sample_rows: every setting needs one entry per row");
    std::vector<cpx::SampleSpec> specs(n);
    for (size_t i = 0; i < n; ++i) specs[i] = {rows[i], temperature[i], top_k[i], top_p[i], log_min_p[i], keys[i]};
    std::vector<int64_t> out(n);
    {
      py::gil_scoped_release release;
      cpx::sample_rows(ptr<float>(x), stride, vocab, specs, out.data());
    }
    return out;
  });
  m.def("row_logprobs", [](uintptr_t x, int64_t stride, int64_t vocab, const std::vector<int64_t>& rows,
                           const std::vector<int64_t>& targets, int k) {
    const size_t n = rows.size();
    if (targets.size() != n || k < 0) throw std::invalid_argument("row_logprobs: one target per row, k >= 0");
    std::vector<float> logprob(n), values(n * size_t(k));
    std::vector<int64_t> ids(n * size_t(k));
    std::vector<int32_t> count(n);
    std::vector<uint8_t> ok(n);
    {
      py::gil_scoped_release release;
      cpx::row_logprobs(ptr<float>(x), stride, vocab, rows, targets, k, logprob.data(), ids.data(), values.data(),
                        count.data(), ok.data());
    }
    // per row: (logprob, [(id, value), ...]) or None where the caller must compute it
    py::list out;
    for (size_t i = 0; i < n; ++i) {
      if (!ok[i]) {
        out.append(py::none());
        continue;
      }
      py::list top;
      for (int32_t j = 0; j < count[i]; ++j) top.append(py::make_tuple(ids[i * k + j], values[i * k + j]));
      out.append(py::make_tuple(logprob[i], top));
    }
    return out;
  });
  m.def("noise_uniforms", [](const std::vector<uint64_t>& keys, uintptr_t ids, int64_t width, uintptr_t out) {
    py::gil_scoped_release release;
    cpx::noise_uniforms(keys.data(), int64_t(keys.size()), ids ? ptr<int64_t>(ids) : nullptr, width,
                        reinterpret_cast<double*>(out));
  });
  m.def("host_functions", [] {
    return py::make_tuple(reinterpret_cast<uintptr_t>(&cpx_host_submit), reinterpret_cast<uintptr_t>(&cpx_host_sync));
  });
}
