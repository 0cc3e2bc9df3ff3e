// Run-time CPU feature detection (CPUID + XCR0 + the Linux AMX tile-data permission).
// Every SIMD path is compiled with per-function target attributes and called only where these hold.
#pragma once
// CPX_X86: an x86 build, where the SIMD paths (AVX2, AVX-512, AMX and the AMX model) are compiled and
// chosen at run time. Elsewhere (aarch64: Graviton, Ampere, Docker on Apple silicon) the extension
// builds with the portable kernels and the vector-extension code of vec.h in its plain build; the
// x86-only sources compile to nothing. -DCPX_X86=0 builds that configuration on x86 too, which is how
// the suite runs it (tests/cpp_experts/test_non_x86_build.py).
#ifndef CPX_X86
#if defined(__x86_64__) || defined(__i386__)
#define CPX_X86 1
#else
#define CPX_X86 0
#endif
#endif
#include <cstddef>
#include <string>
#include <vector>

namespace cpx {

struct CpuInfo {
  bool avx2 = false;         // AVX2 + FMA + F16C, with the OS saving ymm state (XCR0 bits 1, 2)
  bool avx512 = false;       // F + BW + VL + DQ, with the OS saving zmm state
  bool avx512_bf16 = false;  // and AVX512_BF16
  bool avx512_vnni = false;  // and AVX512_VNNI
  bool amx_hw = false;       // AMX-TILE + AMX-BF16 in CPUID and XCR0
  bool amx_usable = false;   // and the kernel granted XTILEDATA to this process
  bool amx_int8 = false;     // amx_usable and AMX-INT8
  bool arm_dotprod = false;  // aarch64 with the dot-product instructions (SDOT: HWCAP_ASIMDDP, Armv8.2+)
  bool amd = false;          // vendor AuthenticAMD
  int family = 0;            // display family (base + extended): 0x19 Zen 3 / Zen 4, 0x1a Zen 5
  std::vector<std::string> flags;
};

const CpuInfo& cpu_info();  // detected once

// Whether a decode pass (at most 3 rows of x: each weight read once) prefetches its weights
// non-temporally, kNtaPrefetchBytes ahead: the AVX-512 int8 kernels (linear_avx512.cpp, where the
// measurements are) and the bf16 kernel (kernels_avx512.cpp). Zen 5 (AMD family 1Ah) only: on a 2-core
// Intel Xeon VM (AVX-512, AMX) a build with it on decoded SmolLM2 at 0.23x (1 request) and 0.29x (2) the
// speed of this one (6 interleaved rounds, batch_decode_cpu_intel_xeon_amx_nta_decode_prefetch.json).
constexpr size_t kNtaPrefetchBytes = 8192;
inline bool nta_decode_prefetch() {
  const CpuInfo& cpu = cpu_info();
  return cpu.amd && cpu.family == 0x1a;
}

// Whether a decode token's attention also asks for the rows of the key tile kFarTiles on into L2
// (attention_kernels.h, run_task), beside the next tile's into L1. Measured to pay on a Zen 4 (AMD
// family 19h, its AVX-512 and AVX2 builds alike) and on a Zen 3 (19h too, AVX2 only: 16 requests at
// ~200 keys, attention ~14% shorter with it, batch_decode_cpu_zen3_avx2_far_lead.json), and to cost on
// a Zen 5 (family 1Ah): there each burst of prefetcht1 stalled the core (~19% of the attention's
// samples on the instructions after them, 16 requests at ~200 keys), and without it the attention
// phase was 2-14% shorter in every run (bench/batch_decode_cpu.py,
// batch_decode_cpu_zen5_avx512_no_far_lead*.json). On a 2-core Intel Xeon VM (AVX-512, AMX) it cost too:
// without it SmolLM2 decoded 1.02-1.03x faster at 4-16 requests of ~200 keys and 1.04-1.06x at ~1.5K keys
// (6 interleaved rounds each, batch_decode_cpu_intel_xeon_amx_no_far_lead*.json). So it is on where it
// measured to pay, AMD family 19h, and off elsewhere (unmeasured CPUs take the plain next-tile prefetch).
// Read once per attention call, into its Layout.
inline bool attention_far_lead() {
  const CpuInfo& cpu = cpu_info();
  return cpu.amd && cpu.family == 0x19;
}

}  // namespace cpx
