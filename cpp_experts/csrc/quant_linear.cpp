// QuantLinear: kernel choice, the one-time repack of GGUF blocks (layout in quant_linear.h), and the
// forward pass: activations quantised (or rounded to bf16, or widened to fp32) once, then tasks of
// (up to 16 rowblocks x up to 64 rows of x) on the bound pool, each computing an fp32 tile and
// storing it with the bias.
#include "quant_linear.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "cpu.h"

namespace cpx {
namespace {

constexpr int kTokChunk = 64;       // rows of x per task (bounds the per-thread output tile)
constexpr int kMaxTaskRowblocks = 16;
constexpr int kActChunk = 8;        // rows of x per activation-conversion task

LinFormat parse_format(const std::string& f) {
  for (int i = 0; i < kLinFormats; ++i)
    if (f == kLinLayout[i].name) return LinFormat(i);
  std::string names;
  for (int i = 0; i < kLinFormats; ++i) names += std::string(i ? ", " : "") + "'" + kLinLayout[i].name + "'";
  throw ArgError("weight_format must be one of " + names + ", got '" + f + "'");
}

uint16_t rd16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// One GGUF row's superblock decoded to the integers the kernels use (q unsigned: q8_0 stores q + 128)
// and its raw scales.
struct SbRow {
  uint8_t q[256];
  uint16_t d = 0, m = 0;  // fp16: d and m (q4_1) / dmin (K-quants)
  uint8_t sc[16] = {}, mn[16] = {};
};

// 6-bit scale and min of sub-block j of a Q4_K/Q5_K block (ggml's get_scale_min_k4).
void scale_min_k4(const uint8_t* s, int j, uint8_t& sc, uint8_t& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = uint8_t((s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4));
    mn = uint8_t((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

void decode(LinFormat f, const uint8_t* b, SbRow& o) {
  switch (f) {
    case LinFormat::Q8_0:
      o.d = rd16(b);
      for (int i = 0; i < 32; ++i) o.q[i] = uint8_t(b[2 + i] ^ 0x80);
      break;
    case LinFormat::Q4_0:
    case LinFormat::Q4_1:
    case LinFormat::IQ4_NL: {  // iq4_nl: the nibbles are level indices, laid out as q4_0's
      const uint8_t* qs = b + (f == LinFormat::Q4_1 ? 4 : 2);
      o.d = rd16(b);
      if (f == LinFormat::Q4_1) o.m = rd16(b + 2);
      for (int i = 0; i < 16; ++i) {
        o.q[i] = qs[i] & 15;
        o.q[16 + i] = qs[i] >> 4;
      }
      break;
    }
    case LinFormat::Q4_K:
    case LinFormat::Q5_K: {
      const bool q5 = f == LinFormat::Q5_K;
      const uint8_t* qs = b + (q5 ? 48 : 16);
      o.d = rd16(b);
      o.m = rd16(b + 2);
      for (int j = 0; j < 8; ++j) scale_min_k4(b + 4, j, o.sc[j], o.mn[j]);
      for (int e = 0; e < 256; ++e) {
        const int s = e / 32, i = e % 32;
        const uint8_t byte = qs[32 * (s / 2) + i];
        o.q[e] = uint8_t(s % 2 ? byte >> 4 : byte & 15);
        if (q5) o.q[e] |= uint8_t(((b[16 + i] >> s) & 1) << 4);
      }
      break;
    }
    case LinFormat::Q6_K:
      o.d = rd16(b + 208);
      std::memcpy(o.sc, b + 192, 16);
      for (int e = 0; e < 256; ++e) {
        const int half = e / 128, l = e % 128;
        const uint8_t lo = b[64 * half + l % 64], hi = b[128 + 32 * half + l % 32];
        o.q[e] = uint8_t((l < 64 ? lo & 15 : lo >> 4) | (((hi >> (2 * (l / 32))) & 3) << 4));
      }
      break;
    case LinFormat::Q5_0:  // d, qh (a uint32: bit i is the 5th bit of element i), qs[16] as q4_0's
    case LinFormat::Q5_1: {  // d, m, qh, qs
      const int at = f == LinFormat::Q5_1 ? 4 : 2;
      o.d = rd16(b);
      if (f == LinFormat::Q5_1) o.m = rd16(b + 2);
      uint32_t qh;
      std::memcpy(&qh, b + at, 4);
      for (int i = 0; i < 16; ++i) {
        o.q[i] = uint8_t((b[at + 4 + i] & 15) | ((qh >> i) & 1) << 4);
        o.q[16 + i] = uint8_t((b[at + 4 + i] >> 4) | ((qh >> (16 + i)) & 1) << 4);
      }
      break;
    }
    case LinFormat::Q3_K:  // hmask[32], qs[64], scales[12], d; q = low 2 bits + 4 x high bit (0..7)
    case LinFormat::Q2_K: {  // scales[16] (sc | mn << 4), qs[64], d, dmin; q = 2 bits
      const bool q3 = f == LinFormat::Q3_K;
      const uint8_t* qs = b + (q3 ? 32 : 16);
      o.d = rd16(b + (q3 ? 108 : 80));
      if (!q3) o.m = rd16(b + 82);
      for (int i = 0; i < 16; ++i) {
        if (q3) {
          const uint8_t* s = b + 96;
          const int lo = i < 8 ? s[i] & 15 : s[i - 8] >> 4, hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
          o.sc[i] = uint8_t(int8_t((lo | hi << 4) - 32));
        } else {
          o.sc[i] = b[i] & 15;
          o.mn[i] = b[i] >> 4;
        }
      }
      for (int e = 0; e < 256; ++e) {
        const int h = e / 128, k = (e % 128) / 32, j = e % 32;
        o.q[e] = uint8_t((qs[32 * h + j] >> (2 * k)) & 3);
        if (q3) o.q[e] |= uint8_t(((b[j] >> (e / 32)) & 1) << 2);
      }
      break;
    }
    case LinFormat::IQ4_XS: {
      o.d = rd16(b);
      const uint16_t sh = rd16(b + 2);
      for (int j = 0; j < 8; ++j) {
        const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4);
        o.sc[j] = uint8_t(int8_t(ls - 32));
        const uint8_t* qs = b + 8 + 16 * j;
        for (int i = 0; i < 16; ++i) {
          o.q[32 * j + i] = qs[i] & 15;
          o.q[32 * j + 16 + i] = qs[i] >> 4;
        }
      }
      break;
    }
    case LinFormat::BF16:
    case LinFormat::F32:
      break;
  }
}

}  // namespace

void quantize_act_row(QuantRow quantize, const float* x, int k, int8_t* q, float* d, int32_t* s, float* ds,
                      int32_t* s16) {
  const int nb = k / 32;
  quantize(x, k, q, d, s);
  for (int b = 0; b < nb; ++b) ds[b] = d[b] * float(s[b]);
  if (!s16) return;
  for (int h = 0; h < 2 * nb; ++h) {
    int32_t v = 0;
    for (int i = 0; i < 16; ++i) v += q[16 * h + i];
    s16[h] = v;
  }
}

QuantLinear::QuantLinear(const std::string& format, int out_features, int in_features, const uint8_t* data,
                         size_t nbytes, const float* bias, const std::string& kernel)
    : fmt_(parse_format(format)), N_(out_features), K_(in_features) {
  const LinLayout& L = kLinLayout[int(fmt_)];
  if (N_ <= 0 || K_ <= 0) throw ArgError("out_features and in_features must be positive");
  if (N_ > (1 << 24) || K_ > (1 << 24)) throw ArgError("out_features / in_features are implausibly large");
  if (K_ % L.gguf_values)
    throw ArgError(std::string(L.name) + " needs in_features divisible by its block size " +
                   std::to_string(L.gguf_values) + ", got " + std::to_string(K_));
  const size_t want = size_t(N_) * size_t(K_ / L.gguf_values) * size_t(L.gguf_bytes);
  if (nbytes != want)
    throw ArgError(std::string(L.name) + " weight of " + std::to_string(N_) + " x " + std::to_string(K_) +
                   " needs " + std::to_string(want) + " bytes, got " + std::to_string(nbytes));

  // Kernel choice. Quantised: AMX-INT8 (from kAmxInt8MinRows rows of x) + AVX-512 VNNI, else VNNI,
  // else AVX2, else portable. bf16: AMX-BF16 (every row count) + AVX-512 BF16, else AVX-512
  // BF16, else AVX2, else portable. f32: AVX2 (AVX-512 CPUs included), else portable. Forcing
  // 'avx512' / 'amx' keeps f32 on AVX2 once the forced feature is found.
  const CpuInfo& cpu = cpu_info();
  const bool f32 = fmt_ == LinFormat::F32, q = lin_quantised(fmt_);
  const bool avx_ok = f32 ? cpu.avx512 : q ? cpu.avx512_vnni : cpu.avx512_bf16;
#if CPX_X86
  const LinKernels* simd = cpu.avx2 ? &kLinAvx2 : &kLinPortable;
  lin_ = f32 ? simd : cpu.avx512_vnni ? &kLinAvx512 : simd;
  bf16k_ = cpu.avx512_bf16 ? &kAvx512 : cpu.avx2 ? &kAvx2 : &kPortable;
#else  // cpu_info() finds no x86 feature, so every forced x86 path below throws before it is taken
  lin_ = &kLinPortable;
#if defined(__aarch64__)
  if (q && cpu.arm_dotprod) lin_ = &kLinNeonDot;
#endif
  bf16k_ = &kPortable;
#endif
  if (kernel == "portable") {
    lin_ = &kLinPortable;
    bf16k_ = &kPortable;
  } else if (kernel == "avx2") {
    if (!cpu.avx2)
      throw std::runtime_error("kernel 'avx2' forced, but this CPU lacks AVX2 with FMA and F16C (or the OS does not "
                               "save ymm state)");
#if CPX_X86
    lin_ = &kLinAvx2;
    bf16k_ = &kAvx2;
#endif
  } else if (kernel == "avx512") {
    if (!avx_ok)
      throw std::runtime_error(std::string("kernel 'avx512' forced, but this CPU lacks ") +
                               (f32 ? "AVX-512" : q ? "AVX-512 VNNI" : "AVX-512 BF16"));
  } else if (kernel == "amx" || kernel.empty() || kernel == "auto") {
    if (kernel == "amx" && !cpu.amx_usable)
      throw std::runtime_error("kernel 'amx' forced, but AMX is not usable here (no AMX-BF16 in CPUID, or the OS "
                               "refused tile data)");
#if CPX_X86
    if (fmt_ == LinFormat::BF16 && cpu.amx_usable) amx_bf16_ = amx_gemm_bf16;
    if (q && cpu.amx_int8) amxq_ = kLinAmxGemm;  // without AMX-INT8 the quantised formats stay on AVX-512 VNNI
#endif
  } else if (kernel == "amx_emulated") {
    if (!cpu.avx512_vnni || !cpu.avx512_bf16)
      throw std::runtime_error("kernel 'amx_emulated' forced, but this CPU lacks AVX-512 VNNI and BF16, which the "
                               "emulated AMX kernels run their non-tile code on");
#if CPX_X86
    if (fmt_ == LinFormat::BF16) amx_bf16_ = amx_emulated_gemm_bf16;
    if (q) amxq_ = kLinAmxEmulatedGemm;
#endif
  } else if (kernel == "neon_dotprod") {
    if (!cpu.arm_dotprod)
      throw std::runtime_error("kernel 'neon_dotprod' forced, but this CPU lacks the Arm dot-product instructions "
                               "(SDOT, HWCAP_ASIMDDP)");
  } else {
    throw ArgError("kernel must be 'amx', 'avx512', 'avx2', 'neon_dotprod', 'portable', 'amx_emulated' or 'auto', "
                   "got '" + kernel + "'");
  }

  if (q) {
    Kp_ = K_;
    nrb_ = (N_ + 15) / 16;
    pack_quant(data);
  } else if (f32) {
    Kp_ = K_;
    nrb_ = (N_ + 15) / 16;
    pack_f32(reinterpret_cast<const float*>(data));
  } else {
    Kp_ = int(round_up(size_t(K_), 32));
    nrb_ = int(round_up(size_t(N_), 32)) / 16;
    pack_bf16(reinterpret_cast<const uint16_t*>(data));
  }
  if (bias) {
    bias_.resize(size_t(N_) * 4);
    std::memcpy(bias_.data(), bias, size_t(N_) * 4);
    has_bias_ = true;
  }
}

void QuantLinear::pack_quant(const uint8_t* src) {
  const LinLayout& L = kLinLayout[int(fmt_)];
  const int nsb = K_ / (32 * L.sb_blocks);
  const size_t sbb = lin_sb_bytes(fmt_);
  const size_t rows_padded = round_up(size_t(N_), 16 * kGroupRowblocks);
  w_.resize(rows_padded / 16 * nsb * sbb);
  qm_ = QMat{fmt_, nsb, sbb, w_.data()};
  const bool q8 = fmt_ == LinFormat::Q8_0, q5 = lin_fifth_bit(fmt_), q6 = fmt_ == LinFormat::Q6_K;
  const bool kq = L.sb_blocks > 1;
  SbRow row;
  for (int n = 0; n < N_; ++n) {
    const int r = n % 16;
    for (int sb = 0; sb < nsb; ++sb) {
      const uint8_t* blk = src + (size_t(n) * nsb + sb) * L.gguf_bytes;
      decode(fmt_, blk, row);
      const bool has_m = lin_has_m(fmt_) || lin_has_dmin(fmt_);
      if (!std::isfinite(f16_to_f32(row.d)) || (has_m && !std::isfinite(f16_to_f32(row.m))))
        throw ArgError(std::string(L.name) + " weight: row " + std::to_string(n) + " block " +
                       std::to_string(sb) + " has a non-finite scale");
      uint8_t* base = const_cast<uint8_t*>(qm_.at(n / 16)) + size_t(sb) * kGroupRowblocks * sbb;
      if (kq) {
        std::memcpy(base + 2 * r, &row.d, 2);
        if (lin_has_dmin(fmt_)) std::memcpy(base + 32 + 2 * r, &row.m, 2);
      }
      for (int j = 0; j < L.sb_blocks; ++j) {
        uint8_t* bp = base + L.hdr + size_t(j) * L.blk;
        const uint8_t* qv = row.q + 32 * j;
        for (int c = 0; c < 4; ++c) {
          if (q8) {
            for (int g = 0; g < 8; ++g) bp[g * 64 + r * 4 + c] = qv[4 * g + c];
          } else if (lin_two_bit(fmt_)) {
            for (int p = 0; p < 2; ++p) {
              uint8_t bits = 0;
              for (int g = 2 * p; g < 2 * p + 2; ++g)
                for (int h = 0; h < 2; ++h) bits |= uint8_t((qv[16 * h + 4 * g + c] & 3) << (4 * (g % 2) + 2 * h));
              bp[64 * p + r * 4 + c] = bits;
            }
            if (fmt_ == LinFormat::Q3_K) {
              uint8_t bits = 0;
              for (int g = 0; g < 4; ++g)
                for (int h = 0; h < 2; ++h) bits |= uint8_t(((qv[16 * h + 4 * g + c] >> 2) & 1) << (2 * g + h));
              bp[128 + r * 4 + c] = bits;
            }
          } else {
            for (int g = 0; g < 4; ++g)
              bp[g * 64 + r * 4 + c] = uint8_t((qv[4 * g + c] & 15) | (qv[16 + 4 * g + c] & 15) << 4);
          }
          if (q5) {
            uint8_t bits = 0;
            for (int g = 0; g < 4; ++g)
              for (int h = 0; h < 2; ++h) bits |= uint8_t(((qv[16 * h + 4 * g + c] >> 4) & 1) << (2 * g + h));
            bp[256 + r * 4 + c] = bits;
          }
          if (q6) {
            for (int p = 0; p < 2; ++p) {
              uint8_t bits = 0;
              for (int g = 2 * p; g < 2 * p + 2; ++g)
                for (int h = 0; h < 2; ++h)
                  bits |= uint8_t(((qv[16 * h + 4 * g + c] >> 4) & 3) << (4 * (g % 2) + 2 * h));
              bp[256 + 64 * p + r * 4 + c] = bits;
            }
          }
        }
        if (lin_one_block(fmt_)) {
          std::memcpy(bp + lin_d_at(fmt_) + 2 * r, &row.d, 2);
          if (lin_has_m(fmt_)) std::memcpy(bp + lin_d_at(fmt_) + 32 + 2 * r, &row.m, 2);
        }
        switch (fmt_) {
          case LinFormat::IQ4_XS:
            bp[256 + r] = row.sc[j];
            break;
          case LinFormat::Q3_K:
            bp[192 + r] = row.sc[2 * j];
            bp[208 + r] = row.sc[2 * j + 1];
            break;
          case LinFormat::Q2_K:  // GGUF's own scale bytes
            bp[128 + r] = uint8_t(row.sc[2 * j] | row.mn[2 * j] << 4);
            bp[144 + r] = uint8_t(row.sc[2 * j + 1] | row.mn[2 * j + 1] << 4);
            break;
          case LinFormat::Q4_K:
          case LinFormat::Q5_K: {
            const int at = q5 ? 320 : 256;
            bp[at + r] = row.sc[j];
            bp[at + 16 + r] = row.mn[j];
            break;
          }
          case LinFormat::Q6_K:
            bp[384 + r] = row.sc[2 * j];
            bp[400 + r] = row.sc[2 * j + 1];
            break;
          default:  // the one-block formats' scales (above)
            break;
        }
      }
    }
  }
}

void QuantLinear::pack_bf16(const uint16_t* src) {
  const int rows = nrb_ * 16;
  w_.resize(size_t(rows) * Kp_ * 2);
  bm_.rows = rows;
  bm_.k = Kp_;
  bm_.data = w_.data();
  uint16_t* dst = reinterpret_cast<uint16_t*>(w_.data());
  for (int n = 0; n < N_; ++n) {
    const uint16_t* s = src + size_t(n) * K_;
    uint16_t* d = dst + size_t(n / 16) * Kp_ * 16 + 2 * (n % 16);
    for (int k = 0; k < K_; ++k) d[size_t(k / 2) * 32 + (k & 1)] = s[k];
  }
}

void QuantLinear::pack_f32(const float* src) {
  w_.resize(size_t(nrb_) * 16 * K_ * 4);
  float* dst = reinterpret_cast<float*>(w_.data());
  for (int n = 0; n < N_; ++n) {
    const float* s = src + size_t(n) * K_;
    float* d = dst + size_t(n / 16) * K_ * 16 + n % 16;
    for (int k = 0; k < K_; ++k) d[size_t(k) * 16] = s[k];
  }
}

void QuantLinear::bind(std::shared_ptr<Pool> pool) {
  if (!pool) throw ArgError("bind needs a pool");
  std::lock_guard<std::mutex> lock(m_);
  pool_ = std::move(pool);
  scratch_.resize(size_t(pool_->size()));
  for (Scratch& s : scratch_) {
    s.c.resize(size_t(kTokChunk) * kMaxTaskRowblocks * 16 * 4);
    s.row.resize(size_t(Kp_) * 4);
  }
}

void QuantLinear::unbind() {
  std::lock_guard<std::mutex> lock(m_);
  pool_.reset();
}

int QuantLinear::threads() const {
  std::lock_guard<std::mutex> lock(m_);
  return pool_ ? pool_->size() : 0;
}

std::string QuantLinear::kernel() const {
#if !CPX_X86
  return fmt_ == LinFormat::BF16 ? bf16k_->name : lin_->name;  // "portable"
#else
  const bool emulated = amxq_ == kLinAmxEmulatedGemm || amx_bf16_ == amx_emulated_gemm_bf16;
  if (fmt_ != LinFormat::BF16)
    return amxq_ ? std::string(emulated ? "amx_int8_emulated+" : "amx_int8+") + lin_->name : std::string(lin_->name);
  if (bf16k_ != &kAvx512) return bf16k_->name;  // "portable", "avx2"
  return amx_bf16_ ? (emulated ? "amx_emulated+avx512_bf16" : "amx+avx512_bf16") : "avx512_bf16";
#endif
}

// About four tasks per thread, so that work stealing evens out a busy core; whole rowblock pairs
// (the bf16 kernel takes rowblocks in pairs, and pairs keep the quantised tiles inside a group).
int QuantLinear::rowblocks_per_task() const {
  const int p = pool_->size();
  const int r = int(round_up(size_t((nrb_ + 4 * p - 1) / (4 * p)), 2));
  return std::min(std::max(r, 2), kMaxTaskRowblocks);
}

void QuantLinear::prepare(const void* x, bool bf16, int m) {
  const int ntask = (m + kActChunk - 1) / kActChunk;
  if (fmt_ == LinFormat::F32) {
    if (!bf16) return;  // the kernels read x itself
    act_f_.resize(size_t(m) * K_ * 4);
    float* dst = reinterpret_cast<float*>(act_f_.data());
    pool_->run(ntask, [&](int task, int) {
      const size_t t0 = size_t(task) * kActChunk, t1 = std::min(size_t(m), t0 + kActChunk);
      const uint16_t* xb = static_cast<const uint16_t*>(x);
      for (size_t i = t0 * K_; i < t1 * K_; ++i) dst[i] = bf16_to_f32(xb[i]);
    });
    return;
  }
  if (fmt_ == LinFormat::BF16) {
    if (bf16 && K_ == Kp_) return;  // the kernels read x itself
    act_b_.resize(size_t(m) * Kp_ * 2);
    uint16_t* dst = reinterpret_cast<uint16_t*>(act_b_.data());
    pool_->run(ntask, [&](int task, int) {
      for (int t = task * kActChunk; t < std::min(m, (task + 1) * kActChunk); ++t) {
        uint16_t* d = dst + size_t(t) * Kp_;
        if (bf16)
          std::memcpy(d, static_cast<const uint16_t*>(x) + size_t(t) * K_, size_t(K_) * 2);
        else
          lin_->to_bf16(static_cast<const float*>(x) + size_t(t) * K_, d, K_);
        std::fill(d + K_, d + Kp_, uint16_t(0));
      }
    });
    return;
  }
  const int nb = K_ / 32;
  const bool per16 = reads_s16();
  act_q_.resize(size_t(m) * K_);
  act_d_.resize(size_t(m) * nb * 4);
  act_s_.resize(size_t(m) * nb * 4);
  act_ds_.resize(size_t(m) * nb * 4);
  if (per16) act_s16_.resize(size_t(m) * nb * 8);
  int8_t* q = reinterpret_cast<int8_t*>(act_q_.data());
  float* d = reinterpret_cast<float*>(act_d_.data());
  int32_t* s = reinterpret_cast<int32_t*>(act_s_.data());
  float* ds = reinterpret_cast<float*>(act_ds_.data());
  int32_t* s16 = reinterpret_cast<int32_t*>(act_s16_.data());
  pool_->run(ntask, [&](int task, int tid) {
    float* row = reinterpret_cast<float*>(scratch_[size_t(tid)].row.data());
    for (int t = task * kActChunk; t < std::min(m, (task + 1) * kActChunk); ++t) {
      const float* xr = row;  // bf16 x widened here first
      if (bf16) {
        const uint16_t* xb = static_cast<const uint16_t*>(x) + size_t(t) * K_;
        for (int i = 0; i < K_; ++i) row[i] = bf16_to_f32(xb[i]);
      } else {
        xr = static_cast<const float*>(x) + size_t(t) * K_;
      }
      const size_t o = size_t(t) * nb;
      quantize_act_row(lin_->quantize, xr, K_, q + size_t(t) * K_, d + o, s + o, ds + o, per16 ? s16 + 2 * o : nullptr);
    }
  });
}

void QuantLinear::forward(const void* x, bool bf16, int m, void* out) {
  std::lock_guard<std::mutex> lock(m_);
  if (!pool_) throw std::runtime_error("no worker pool is bound to this QuantLinear (bind one first)");
  if (pool_->closed()) throw std::runtime_error("the worker pool bound to this QuantLinear was closed");
  if (m <= 0) return;
  prepare(x, bf16, m);
  const int rpt = rowblocks_per_task();
  const int ntr = (nrb_ + rpt - 1) / rpt, ntc = (m + kTokChunk - 1) / kTokChunk;
  const ActQ a{reinterpret_cast<const int8_t*>(act_q_.data()), reinterpret_cast<const float*>(act_d_.data()),
               reinterpret_cast<const int32_t*>(act_s_.data()), reinterpret_cast<const float*>(act_ds_.data()),
               reinterpret_cast<const int32_t*>(act_s16_.data()), K_};
  const bool own_b = !(bf16 && K_ == Kp_);
  const uint16_t* ab = own_b ? reinterpret_cast<const uint16_t*>(act_b_.data()) : static_cast<const uint16_t*>(x);
  const float* af = bf16 ? reinterpret_cast<const float*>(act_f_.data()) : static_cast<const float*>(x);
  const float* bias = has_bias_ ? reinterpret_cast<const float*>(bias_.data()) : nullptr;
  const size_t esz = bf16 ? 2 : 4;
  pool_->run(ntr * ntc, [&](int task, int tid) {
    const int rb0 = (task % ntr) * rpt, rb1 = std::min(nrb_, rb0 + rpt);
    const int t0 = (task / ntr) * kTokChunk, nt = std::min(kTokChunk, m - t0);
    float* c = reinterpret_cast<float*>(scratch_[size_t(tid)].c.data());
    const int ldc = rpt * 16;
    if (fmt_ == LinFormat::BF16) {
      const uint16_t* at = ab + size_t(t0) * Kp_;
      if (amx_bf16_)
        amx_bf16_(bm_, rb0, rb1 - rb0, at, size_t(Kp_), nt, c, ldc);
      else
        bf16k_->gemm_bf16(bm_, rb0, rb1 - rb0, at, size_t(Kp_), nt, c, ldc);
    } else if (fmt_ == LinFormat::F32) {
      lin_->gemm_f32(reinterpret_cast<const float*>(w_.data()), K_, rb0, rb1, af + size_t(t0) * K_, size_t(K_), nt,
                     c, ldc);
    } else if (amxq_ && nt >= amx_int8_min_rows(fmt_)) {
      amxq_[int(fmt_)](qm_, rb0, rb1, a, t0, nt, c, ldc);
    } else {
      lin_->gemm[int(fmt_)](qm_, rb0, rb1, a, t0, nt, c, ldc);
    }
    const int n0 = rb0 * 16, ncols = std::min(N_, rb1 * 16) - n0;
    void* o = static_cast<uint8_t*>(out) + (size_t(t0) * N_ + n0) * esz;
    lin_->store(c, ldc, nt, ncols, bias ? bias + n0 : nullptr, o, bf16, size_t(N_));
  });
}

}  // namespace cpx
