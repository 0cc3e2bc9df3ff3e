#include "moe.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "cpu.h"

namespace cpx {
namespace {

Format parse_format(const std::string& f) {
  if (f == "bf16") return Format::BF16;
  if (f == "q8_0") return Format::Q8_0;
  if (f == "q4_0") return Format::Q4_0;
  throw ArgError("weight_format must be 'bf16', 'q8_0' or 'q4_0', got '" + f + "'");
}

const char* fmt_name(Format f) { return f == Format::BF16 ? "bf16" : f == Format::Q8_0 ? "q8_0" : "q4_0"; }
}  // namespace

MoE::MoE(int experts, int top_k, int hidden, int inter, const std::string& format, const std::string& kernel)
    : E_(experts), K_(top_k), H_(hidden), I_(inter), fmt_(parse_format(format)) {
  if (E_ <= 0 || K_ <= 0 || H_ <= 0 || I_ <= 0) throw ArgError("sizes must be positive");
  if (K_ > E_) throw ArgError("top_k (" + std::to_string(K_) + ") exceeds num_experts (" + std::to_string(E_) + ")");
  if (H_ > (1 << 20) || I_ > (1 << 20) || E_ > (1 << 16)) throw ArgError("sizes are implausibly large");
  if (fmt_ != Format::BF16 && (H_ % 32 || I_ % 32))
    throw ArgError(std::string(fmt_name(fmt_)) + " needs hidden_size and intermediate_size divisible by 32, got " +
                   std::to_string(H_) + " and " + std::to_string(I_));
  Hp_ = int(round_up(size_t(H_), 32));
  Ip_ = int(round_up(size_t(I_), 32));
  // bf16: AMX (from kAmxMinTokens tokens per expert) + AVX-512 BF16, else AVX-512 BF16, else AVX2, else
  // portable. q8_0 / q4_0: AVX-512 VNNI, else portable int8 gemms (with AVX2's silu_mul where it exists).
  const CpuInfo& cpu = cpu_info();
  const bool q = fmt_ != Format::BF16;
  const bool avx_ok = q ? cpu.avx512_vnni : cpu.avx512_bf16;
  if (kernel == "portable") {
    kern_ = &kPortable;
  } else if (kernel == "avx2") {
    if (!cpu.avx2)
      throw std::runtime_error("kernel 'avx2' forced, but this CPU lacks AVX2 with FMA and F16C (or the OS does not "
                               "save ymm state)");
    kern_ = &kAvx2;
  } else if (kernel == "avx512") {
    if (!avx_ok) throw std::runtime_error(std::string("kernel 'avx512' forced, but this CPU lacks ") +
                                          (q ? "AVX-512 VNNI" : "AVX-512 BF16"));
    kern_ = &kAvx512;
  } else if (kernel == "amx") {
    if (!cpu.amx_usable) throw std::runtime_error("kernel 'amx' forced, but AMX is not usable here (no AMX-BF16 in CPUID, or the OS refused tile data)");
    kern_ = &kAvx512;
    amx_ = !q;
  } else if (kernel.empty() || kernel == "auto") {
    kern_ = avx_ok ? &kAvx512 : cpu.avx2 ? &kAvx2 : &kPortable;
    amx_ = !q && cpu.amx_usable;
  } else {
    throw ArgError("kernel must be 'amx', 'avx512', 'avx2', 'portable' or 'auto', got '" + kernel + "'");
  }
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
  scratch_.resize(size_t(pool_->size()));
}

void MoE::unbind() {
  std::unique_lock<std::mutex> lock(dm_);
  stop_driver(lock);
  pool_.reset();
}

std::string MoE::kernel_bf16() const {
  if (kern_ != &kAvx512) return kern_->name_bf16;  // "portable", "avx2"
  return amx_ ? "amx+avx512_bf16" : "avx512_bf16";
}
std::string MoE::kernel_q() const { return kern_->name_q; }  // "avx512_vnni", "portable" (also on AVX2)

void MoE::load_bf16(int e, const uint16_t* gate, const uint16_t* up, const uint16_t* down) {
  if (fmt_ != Format::BF16) throw ArgError("load_bf16 on a quantized operator");
  if (e < 0 || e >= E_) throw ArgError("expert " + std::to_string(e) + " out of range [0, " + std::to_string(E_) + ")");
  Expert& ex = experts_[size_t(e)];
  const uint16_t* src[3] = {gate, up, down};
  for (int w = 0; w < 3; ++w) {
    const int rows = w < 2 ? I_ : H_, k = w < 2 ? H_ : I_;
    const int rp = w < 2 ? Ip_ : Hp_, kp = w < 2 ? Hp_ : Ip_;
    ex.w[w].p.reset();
    ex.w[w].n = 0;
    ex.w[w].resize(size_t(rp) * kp * 2);
    uint16_t* dst = reinterpret_cast<uint16_t*>(ex.w[w].data());
    for (int rb = 0; rb < rp / 16; ++rb)
      for (int j = 0; j < 16; ++j) {
        const int row = rb * 16 + j;
        if (row >= rows) continue;
        const uint16_t* s = src[w] + size_t(row) * k;
        uint16_t* d = dst + size_t(rb) * kp * 16 + 2 * j;
        for (int kk = 0; kk < k; ++kk) d[size_t(kk / 2) * 32 + (kk & 1)] = s[kk];
      }
  }
  ex.loaded = true;
  finalized_ = false;
}

void MoE::pack_quant(const uint8_t* src, size_t n, int rows, int k, Expert& ex, int which,
                     const char* name, int e) {
  const bool q8 = fmt_ == Format::Q8_0;
  const size_t bs = q8 ? 34 : 18, nb = size_t(k / 32), want = size_t(rows) * nb * bs;
  if (n != want)
    throw ArgError("expert " + std::to_string(e) + " " + name + ": expected " + std::to_string(want) + " bytes (" +
                   std::to_string(rows) + " rows x " + std::to_string(nb) + " " + fmt_name(fmt_) +
                   " blocks), got " + std::to_string(n));
  const int rp = int(round_up(size_t(rows), 32));
  Mat m;
  m.fmt = fmt_;
  m.k = k;
  ex.w[which].p.reset();
  ex.w[which].n = 0;
  ex.w[which].resize(size_t(rp / 16) * m.rb_stride());
  ex.scales[which].p.reset();
  ex.scales[which].n = 0;
  ex.scales[which].resize(size_t(rp) * nb * 2);
  uint8_t* dq = ex.w[which].data();
  uint16_t* ds = reinterpret_cast<uint16_t*>(ex.scales[which].data());
  const int groups = q8 ? 8 : 4;
  for (int row = 0; row < rows; ++row) {
    const int rb = row / 16, j = row % 16;
    for (size_t b = 0; b < nb; ++b) {
      const uint8_t* blk = src + (size_t(row) * nb + b) * bs;
      uint16_t d;
      std::memcpy(&d, blk, 2);
      if (!std::isfinite(f16_to_f32(d)))
        throw ArgError("expert " + std::to_string(e) + " " + name + ": row " + std::to_string(row) + " block " +
                       std::to_string(b) + " has a non-finite scale");
      ds[(size_t(rb) * nb + b) * 16 + j] = d;
      uint8_t* out = dq + size_t(rb) * m.rb_stride() + b * groups * 64 + size_t(j) * 4;
      for (int g = 0; g < groups; ++g)
        for (int c = 0; c < 4; ++c) out[g * 64 + c] = q8 ? uint8_t(blk[2 + 4 * g + c] ^ 0x80) : blk[2 + 4 * g + c];
    }
  }
  // padded rows keep zero scales; their q8 bytes must be the zero point (128) or the sum is off
  if (q8)
    for (int row = rows; row < rp; ++row)
      for (size_t b = 0; b < nb; ++b)
        for (int g = 0; g < groups; ++g)
          std::memset(dq + size_t(row / 16) * m.rb_stride() + b * groups * 64 + g * 64 + (row % 16) * 4, 0x80, 4);
}

void MoE::load_quant(int e, const uint8_t* gate, size_t gate_n, const uint8_t* up, size_t up_n,
                     const uint8_t* down, size_t down_n) {
  if (fmt_ == Format::BF16) throw ArgError("load_quant on a bf16 operator");
  if (e < 0 || e >= E_) throw ArgError("expert " + std::to_string(e) + " out of range [0, " + std::to_string(E_) + ")");
  Expert& ex = experts_[size_t(e)];
  ex.loaded = false;
  pack_quant(gate, gate_n, I_, H_, ex, 0, "gate", e);
  pack_quant(up, up_n, I_, H_, ex, 1, "up", e);
  pack_quant(down, down_n, H_, I_, ex, 2, "down", e);
  ex.loaded = true;
  finalized_ = false;
}

void MoE::finalize() {
  for (int e = 0; e < E_; ++e)
    if (!experts_[size_t(e)].loaded) throw ArgError("expert " + std::to_string(e) + " was never loaded");
  finalized_ = true;
}

size_t MoE::memory_bytes() const {
  size_t n = 0;
  for (const Expert& ex : experts_)
    for (int w = 0; w < 3; ++w) n += ex.w[w].n + ex.scales[w].n;
  return n;
}

Mat MoE::mat(int e, int which) const {
  const Expert& ex = experts_[size_t(e)];
  Mat m;
  m.fmt = fmt_;
  m.rows = which < 2 ? Ip_ : Hp_;
  m.k = which < 2 ? Hp_ : Ip_;
  m.data = ex.w[which].data();
  m.scales = reinterpret_cast<const uint16_t*>(ex.scales[which].data());
  return m;
}

void MoE::validate(const Job& job) const {
  if (!finalized_) throw ArgError("finalize() must be called after loading the experts and before forward");
  if (!pool_) throw std::runtime_error("no worker pool is bound to this operator (bind one first)");
  if (pool_->closed()) throw std::runtime_error("the worker pool bound to this operator was closed");
  const size_t n = size_t(job.tokens) * K_;
  for (size_t i = 0; i < n; ++i) {
    const int32_t id = job.ids[i];
    if (id < 0 || id >= E_)
      throw ArgError("topk_ids[" + std::to_string(i / K_) + ", " + std::to_string(i % K_) + "] = " +
                     std::to_string(id) + " is out of range [0, " + std::to_string(E_) + ")");
    if (!std::isfinite(job.weights[i]))
      throw ArgError("topk_weights[" + std::to_string(i / K_) + ", " + std::to_string(i % K_) + "] is not finite");
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
  if (!driver_.joinable()) driver_ = std::thread([this] { driver(); });
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
