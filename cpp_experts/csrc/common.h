// Shared types and helpers of the native operators: the packed bf16 weight layout and the bf16 gemm
// table each code path (portable, AVX2, AVX-512, AMX) fills in; the bf16 / fp16 conversions, aligned
// buffers, argument errors and the Q8_0 activation quantisation that QuantLinear (quant_linear.h,
// which holds every weight format) builds on.
//
// Packed bf16 layout (dims padded to multiples of 32; padding is zero):
//  W[N][K] -> [N/16][K/2][16][2] bf16: one 64-byte line holds one k-pair of 16 output rows, which is
//  both the vdpbf16ps operand (16 rows in a zmm) and an AMX B tile row.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <thread>
#if __has_include(<sys/mman.h>)
#include <sys/mman.h>
#endif
#if defined(__linux__)
#include <pthread.h>  // name_thread
#endif

namespace cpx {

// Invalid arguments: surfaced to Python as ValueError.
struct ArgError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

inline size_t round_up(size_t v, size_t m) { return (v + m - 1) / m * m; }

// Names a thread just started (at most 15 characters on Linux), from the thread that started it, so that
// the name is there as soon as the thread is: `top -H`, `ps -L` and debuggers then show which of the
// process's threads are the extension's. Elsewhere nothing.
inline void name_thread(std::thread& t, const char* name) {
#if defined(__linux__)
  pthread_setname_np(t.native_handle(), name);
#else
  (void)t, (void)name;
#endif
}

constexpr size_t kHugePage = size_t(2) << 20;

// 64-byte aligned, zero-filled bytes (activation and output scratch, biases; weights: WeightBuffer).
struct Buffer {
  std::unique_ptr<uint8_t, FreeDeleter> p;
  size_t n = 0;
  void resize(size_t bytes) {  // reallocates (and zeroes) only when growing
    if (bytes <= n && p) return;
    // Large buffers on 2 MiB boundaries and asked for huge pages before they are touched: with 4 KiB
    // pages a pass over them costs a TLB miss a page (the kernel's THP mode is often `madvise`, so
    // it only helps where asked).
    const bool huge = bytes >= kHugePage;
    const size_t sz = round_up(bytes ? bytes : 64, huge ? kHugePage : 64);
    void* q = std::aligned_alloc(huge ? kHugePage : 64, sz);
    if (!q) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
    if (huge) madvise(q, sz, MADV_HUGEPAGE);  // advice only: a refusal changes nothing
#endif
    std::memset(q, 0, sz);
    p.reset(static_cast<uint8_t*>(q));
    n = round_up(bytes ? bytes : 64, 64);  // the bytes asked for (memory_bytes), not the huge-page padding
  }
  uint8_t* data() const { return p.get(); }
};

// Packed weights: zero-filled bytes carved, 64-byte aligned and back to back, out of shared 2 MiB-aligned
// chunks that are asked for huge pages (weight_arena.cpp); a chunk is unmapped when its last weight
// goes. One Buffer a weight would round each matrix up to whole huge pages: a DeepSeek-V2-Lite
// expert's 3.1 MB Q8_0 matrix took 4 MB, +30% of the experts' memory, and a matrix under 2 MiB got no
// huge pages at all. Back to back, one layer's experts are also one run of memory.
class WeightBuffer {
 public:
  void resize(size_t bytes);  // once per buffer: a second call throws
  uint8_t* data() const { return p_; }
  size_t n = 0;  // the bytes asked for

 private:
  std::shared_ptr<void> chunk_;  // keeps the chunk mapped
  uint8_t* p_ = nullptr;
};

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, like torch
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { ++e; man <<= 1; } while (!(man & 0x400u));
      u = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 112u) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A packed bf16 weight matrix: `rows` output rows (padded to 32) of `k` inputs (padded to 32).
struct Mat {
  int rows = 0, k = 0;
  const uint8_t* data = nullptr;  // bf16 pairs
  size_t rb_stride() const { return size_t(k) * 32; }  // bytes of one rowblock (16 rows)
};

// C[i * ldc + j] = sum_k W[16 rb0 + j][k] * A[i][k] for j < 16 * nrb (nrb even), i < ntok.
using GemmBF16 = void (*)(const Mat& w, int rb0, int nrb, const uint16_t* a, size_t lda, int ntok,
                          float* c, int ldc);

struct Kernels {
  const char* name;
  GemmBF16 gemm_bf16;
};

extern const Kernels kPortable;
extern const Kernels kAvx512;  // AVX-512 BF16
extern const Kernels kAvx2;    // AVX2 + FMA (kernels_avx2.cpp; call only where cpu_info().avx2 holds)
void amx_gemm_bf16(const Mat& w, int rb0, int nrb, const uint16_t* a, size_t lda, int ntok, float* c,
                   int ldc);  // AMX tiles (the operator calls it only where AMX is usable); ntok > 0
// the same kernel over the software tile model of amx_emulation.h (needs AVX-512 F only; for tests)
void amx_emulated_gemm_bf16(const Mat& w, int rb0, int nrb, const uint16_t* a, size_t lda, int ntok, float* c,
                            int ldc);

// Q8_0-quantise one row of k floats (k multiple of 32), as ggml's quantize_row_q8_0 (d kept in fp32):
// d = amax / 127, q = round-half-away(x / d). The AVX-512 and AVX2 versions give bit-identical
// results; call them only where cpu_info().avx512 (F, BW, VL, DQ) / cpu_info().avx2 holds.
void quantize_row_q8(const float* x, int k, int8_t* q, float* d, int32_t* sum);
void quantize_row_q8_avx512(const float* x, int k, int8_t* q, float* d, int32_t* sum);
void quantize_row_q8_avx2(const float* x, int k, int8_t* q, float* d, int32_t* sum);

}  // namespace cpx
