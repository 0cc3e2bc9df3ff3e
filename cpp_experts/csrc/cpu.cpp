#include "cpu.h"

#if CPX_X86
#include <cpuid.h>
#endif

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

namespace cpx {
namespace {

#if CPX_X86
unsigned long long xgetbv0() {
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}

bool request_amx_permission() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr int kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  unsigned long bitmask = 0;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &bitmask) != 0) return false;
  return (bitmask & (1ul << kXfeatureXtiledata)) != 0;
#else
  return false;
#endif
}

CpuInfo detect() {
  CpuInfo info;
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return info;
  info.amd = b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;  // "Auth" "enti" "cAMD"
  if (!__get_cpuid(1, &a, &b, &c, &d)) return info;
  const int base_family = int((a >> 8) & 0xf);
  info.family = base_family == 0xf ? base_family + int((a >> 20) & 0xff) : base_family;
  const bool osxsave = (c >> 27) & 1;
  const bool avx = (c >> 28) & 1;
  if (avx) info.flags.push_back("avx");
  const bool fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
  if (fma) info.flags.push_back("fma");
  if (f16c) info.flags.push_back("f16c");
  const unsigned long long xcr0 = osxsave ? xgetbv0() : 0;
  const bool os_ymm = (xcr0 & 0x6) == 0x6;                  // SSE, AVX state
  const bool os_zmm = (xcr0 & 0xe6) == 0xe6;               // SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM
  const bool os_amx = (xcr0 & (3ull << 17)) == (3ull << 17);  // XTILECFG, XTILEDATA
  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < 7) return info;
  __cpuid_count(7, 0, a, b, c, d);
  const bool f = (b >> 16) & 1, dq = (b >> 17) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1;
  const bool vnni = (c >> 11) & 1, amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1,
             amx_int8 = (d >> 25) & 1;
  const bool avx2 = (b >> 5) & 1;
  if (avx2) info.flags.push_back("avx2");
  if (f) info.flags.push_back("avx512f");
  if (dq) info.flags.push_back("avx512dq");
  if (bw) info.flags.push_back("avx512bw");
  if (vl) info.flags.push_back("avx512vl");
  if (vnni) info.flags.push_back("avx512_vnni");
  unsigned a1 = 0, b1, c1, d1;
  __cpuid_count(7, 1, a1, b1, c1, d1);
  const bool bf16 = (a1 >> 5) & 1;
  if (bf16) info.flags.push_back("avx512_bf16");
  if (amx_tile) info.flags.push_back("amx_tile");
  if (amx_bf16) info.flags.push_back("amx_bf16");
  if (amx_int8) info.flags.push_back("amx_int8");
  info.avx2 = avx && avx2 && fma && f16c && os_ymm;
  info.avx512 = f && dq && bw && vl && os_zmm;
  info.avx512_bf16 = info.avx512 && bf16;
  info.avx512_vnni = info.avx512 && vnni;
  info.amx_hw = info.avx512_bf16 && amx_tile && amx_bf16 && os_amx;
  info.amx_usable = info.amx_hw && request_amx_permission();
  info.amx_int8 = info.amx_usable && amx_int8;
  return info;
}
#else
CpuInfo detect() {  // no x86 feature: the portable kernels, and on aarch64 the NEON dot-product ones
  CpuInfo info;
#if defined(__aarch64__) && defined(__linux__)
  constexpr unsigned long kHwcapAsimddp = 1ul << 20;  // HWCAP_ASIMDDP (asm/hwcap.h)
  info.arm_dotprod = (getauxval(AT_HWCAP) & kHwcapAsimddp) != 0;
  if (info.arm_dotprod) info.flags.push_back("asimddp");
#endif
  return info;
}
#endif

}  // namespace

const CpuInfo& cpu_info() {
  static const CpuInfo info = detect();
  return info;
}

}  // namespace cpx
