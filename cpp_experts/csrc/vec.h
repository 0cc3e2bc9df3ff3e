// Eight-lane float vectors for the native model's element-wise and attention code, written once with
// GCC's vector extensions and compiled twice: CPX_DISPATCH defines a function whose body (an
// always-inlined `<name>_impl`) is built once with AVX2 + FMA (eight lanes a register, fused
// multiply-adds) and once for the x86-64 baseline (each v8f two SSE registers), and calls the first
// where the CPU has AVX2 and FMA. (GCC's target_clones cannot express that: its `arch=` clones are
// chosen by CPU model, so an AMD CPU with AVX2 would get the baseline.)
//
// exp8 is a polynomial expf (Cephes' coefficients, as most vector math libraries use): relative
// error below 2 ulp over the range softmax and SiLU need; results saturate to 0 below -87.3 and to
// +inf above 88.7, and a NaN stays NaN.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cpu.h"

#define CPX_INLINE inline __attribute__((always_inline))
#if CPX_X86
#define CPX_AVX2_FMA __attribute__((target("avx2,fma,f16c")))
#else  // the "avx2" and "avx512" builds are plain ones, never called (has_avx2_fma() is false)
#define CPX_AVX2_FMA
#endif
// The same eight-lane code with AVX-512VL: 32 vector registers instead of 16 (no spilled register
// tiles) and masked moves for the selects. Lane arithmetic is the AVX2 build's (the vectors stay 8
// wide, and GCC contracts the same multiply-adds), so both builds give the same bits; code templated
// on its width (attention_kernels.h) runs sixteen-lane vectors in this build instead.
#if CPX_X86
#define CPX_AVX512VL __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512dq,avx512bw,prefer-vector-width=256")))
#else
#define CPX_AVX512VL
#endif

// ret name(params): the AVX-512VL or AVX2 + FMA build of name##_impl(args) where the CPU allows, else
// the baseline one.
#define CPX_DISPATCH(ret, name, params, args) CPX_DISPATCH_BUILDS(ret, name, params, args, name##_impl, name##_impl)
// The three builds, `wide` (AVX-512VL) and `narrow` (AVX2 + FMA, baseline) the bodies they call.
#define CPX_DISPATCH_BUILDS(ret, name, params, args, wide, narrow)                        \
  CPX_AVX512VL ret name##_avx512 params { return wide args; }                           \
  CPX_AVX2_FMA ret name##_avx2 params { return narrow args; }                           \
  ret name##_base params { return narrow args; }                                        \
  ret name params { return CPX_DISPATCH_CALL(name, args); }
// The call of the build this CPU runs, of functions name##_avx512, name##_avx2 and name##_base (defined by
// CPX_DISPATCH_BUILDS, or in files of their own: attention_kernels.h, whose code is templated on its vector
// width W and runs sixteen lanes in the AVX-512VL build, eight in the others; vec::lanes() says which).
#define CPX_DISPATCH_CALL(name, args)                                                     \
  (::cpx::vec::has_avx512vl() ? name##_avx512 args                                      \
   : ::cpx::vec::has_avx2_fma() ? name##_avx2 args : name##_base args)

namespace cpx {
namespace vec {

inline bool has_avx2_fma() {
#if CPX_X86
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
#else
  return false;
#endif
}
// MLASERVE_CPP_EXPERTS_KERNEL=avx2 (read once, at a process's first dispatch) takes the AVX2 build here
// too, as it does for the linear kernels: a test runs both builds, one per process.
inline bool has_avx512vl() {
  static const bool yes = [] {
#if CPX_X86
    const char* forced = std::getenv("MLASERVE_CPP_EXPERTS_KERNEL");
    return has_avx2_fma() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
           !(forced && std::strcmp(forced, "avx2") == 0);
#else
    return false;
#endif
  }();
  return yes;
}
// the vector width the attention kernels (attention_kernels.h) run on this CPU
inline int lanes() { return has_avx512vl() ? 16 : 8; }

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

CPX_INLINE v8f load(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
CPX_INLINE v8f load(const uint16_t* p) {  // 8 bf16 values widened to fp32 (exact)
  v8h h;
  std::memcpy(&h, p, sizeof h);
  const v8u u = __builtin_convertvector(h, v8u) << 16;
  return (v8f)u;  // a bit cast between vectors of one size
}
// Half the lanes of 16 bf16 values p[0..15], widened to fp32 (exact): p[2i] (odd false) or p[2i + 1]
// (odd true) into lane i. One AND or shift per 8 values, where `load` widens with two (its order kept).
CPX_INLINE v8f load_bf16_lanes(const uint16_t* p, bool odd) {
  v8u u;
  std::memcpy(&u, p, sizeof u);
  return (v8f)(odd ? (u & 0xFFFF0000u) : (u << 16));
}
CPX_INLINE void store(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }
typedef float v4f __attribute__((vector_size(16)));
// A shuffle, not v8f{x, ..., x}: GCC 12 builds the initializer list from eight vinsertps inside a
// target("avx2") function (a broadcast in the shuffle's place), which made pv_block's splat of each
// probability cost eight instructions.
CPX_INLINE v8f splat(float x) {
  const v4f s = {x, 0.0f, 0.0f, 0.0f};
  return __builtin_shufflevector(s, s, 0, 0, 0, 0, 0, 0, 0, 0);
}
CPX_INLINE float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}
// {hsum(a), hsum(b), hsum(c), hsum(d)} into out[0..3], each with hsum's exact association (the same
// bits), in a few shuffles for all four instead of a reduction each.
CPX_INLINE void hsum4(v8f a, v8f b, v8f c, v8f d, float* out) {
  const v8f ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);  // x_i + x_{i+4}
  const v8f cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
  const v8f u = __builtin_shufflevector(ab, cd, 0, 2, 4, 6, 8, 10, 12, 14) +
                __builtin_shufflevector(ab, cd, 1, 3, 5, 7, 9, 11, 13, 15);  // (x0+x4)+(x1+x5), (x2+x6)+(x3+x7)
  const v8f w = u + __builtin_shufflevector(u, u, 1, 0, 3, 2, 5, 4, 7, 6);
  out[0] = w[0];
  out[1] = w[2];
  out[2] = w[4];
  out[3] = w[6];
}
CPX_INLINE float hmax(v8f v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// Sixteen-lane vectors, for the AVX-512 build of width-templated code only (attention_kernels.h).
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
CPX_INLINE v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
CPX_INLINE void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }
// load_bf16_lanes on 32 bf16 values p[0..31]: p[2i] (odd false) or p[2i + 1] (odd true) into lane i.
CPX_INLINE v16f load_bf16_lanes16(const uint16_t* p, bool odd) {
  v16u u;
  std::memcpy(&u, p, sizeof u);
  return (v16f)(odd ? (u & 0xFFFF0000u) : (u << 16));
}
// From splat's eight lanes: GCC 12 builds a sixteen-lane shuffle of a four-lane vector through the
// stack (a narrow store, then a wide load that cannot be forwarded: the attention's hottest
// instructions), this one as two broadcasts.
CPX_INLINE v16f splat16(float x) {
  const v8f s = splat(x);
  return __builtin_shufflevector(s, s, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
}
// lanes i + 8 onto lanes i: a sixteen-lane sum's first step, then hsum / hsum4 finish it
CPX_INLINE v8f fold(v16f v) {
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
}
// {hsum(fold(a[0])), ..., hsum(fold(a[7]))} as eight lanes: each sum with fold's and hsum's exact
// association (the same bits as hsum4 of the folds, four at a time), the two halves of every step
// doing two keys' work: a fold of two vectors in one add, and hsum4's steps on eight sums at once.
CPX_INLINE v8f hsum8(const v16f* a) {
  v16f x[4];
  for (int k = 0; k < 4; ++k)  // fold(a[k]) in the low half, fold(a[k + 4]) in the high one
    x[k] = __builtin_shufflevector(a[k], a[k + 4], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[k], a[k + 4], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // then hsum4 in each half: the low one for keys 0..3, the high one for 4..7
  const v16f ab = __builtin_shufflevector(x[0], x[1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
                  __builtin_shufflevector(x[0], x[1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  const v16f cd = __builtin_shufflevector(x[2], x[3], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
                  __builtin_shufflevector(x[2], x[3], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  const v16f u = __builtin_shufflevector(ab, cd, 0, 2, 4, 6, 16, 18, 20, 22, 8, 10, 12, 14, 24, 26, 28, 30) +
                 __builtin_shufflevector(ab, cd, 1, 3, 5, 7, 17, 19, 21, 23, 9, 11, 13, 15, 25, 27, 29, 31);
  return __builtin_shufflevector(u, u, 0, 2, 4, 6, 8, 10, 12, 14) + __builtin_shufflevector(u, u, 1, 3, 5, 7, 9, 11, 13, 15);
}

// expf lane by lane, on 8 (V = v8f, I = v8i) or 16 lanes (the same bits in every lane).
template <class V>
CPX_INLINE V splat_as(float x);
template <>
CPX_INLINE v8f splat_as<v8f>(float x) { return splat(x); }
template <>
CPX_INLINE v16f splat_as<v16f>(float x) { return splat16(x); }
template <class V, class I>
CPX_INLINE V expv(V x) {
  const V hi = splat_as<V>(88.72283905206835f), lo = splat_as<V>(-87.33654475055310f);
  const I over = x > hi, under = x < lo;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  const V fx = x * splat_as<V>(1.44269504088896341f);
  V n = __builtin_convertvector(__builtin_convertvector(fx + (fx >= 0 ? splat_as<V>(0.5f) : splat_as<V>(-0.5f)), I), V);
  const V r = x - n * splat_as<V>(0.693359375f) - n * splat_as<V>(-2.12194440e-4f);
  V p = splat_as<V>(1.9875691500e-4f);
  p = p * r + splat_as<V>(1.3981999507e-3f);
  p = p * r + splat_as<V>(8.3334519073e-3f);
  p = p * r + splat_as<V>(4.1665795894e-2f);
  p = p * r + splat_as<V>(1.6666665459e-1f);
  p = p * r + splat_as<V>(5.0000001201e-1f);
  p = p * r * r + r + splat_as<V>(1.0f);
  const I e = (__builtin_convertvector(n, I) + 127) << 23;
  V y = p * (V)e;
  y = over ? splat_as<V>(INFINITY) : y;
  return under ? splat_as<V>(0.0f) : y;
}
CPX_INLINE v8f exp8(v8f x) { return expv<v8f, v8i>(x); }
CPX_INLINE v16f exp16(v16f x) { return expv<v16f, v16i>(x); }

// the largest lane (max is exact: any order of comparisons gives it)
CPX_INLINE float hmax16(v16f v) {
  const v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const v8f b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  return hmax(a > b ? a : b);
}

// x / (1 + exp(-x)) on 8 lanes.
CPX_INLINE v8f silu8(v8f x) { return x / (splat(1.0f) + exp8(-x)); }

// Scalar versions computed through the same lanes, for tails (identical results per element).
CPX_INLINE float exp1(float x) { return exp8(splat(x))[0]; }

CPX_INLINE float scalar(float x) { return x; }
CPX_INLINE float scalar(uint16_t x) {
  uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// sum_i a[i] * b[i]; b fp32 or bf16.
template <class B>
CPX_INLINE float dot(const float* a, const B* b, int n) {
  v8f s0 = splat(0.0f), s1 = splat(0.0f);
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 += load(a + i) * load(b + i);
    s1 += load(a + i + 8) * load(b + i + 8);
  }
  if (i + 8 <= n) {
    s0 += load(a + i) * load(b + i);
    i += 8;
  }
  float s = hsum(s0 + s1);
  for (; i < n; ++i) s += a[i] * scalar(b[i]);
  return s;
}

// y[i] += w * x[i]; x fp32 or bf16.
template <class X>
CPX_INLINE void axpy(float* y, float w, const X* x, int n) {
  const v8f vw = splat(w);
  int i = 0;
  for (; i + 8 <= n; i += 8) store(y + i, load(y + i) + vw * load(x + i));
  for (; i < n; ++i) y[i] += w * scalar(x[i]);
}

CPX_INLINE void scale(float* y, float w, int n) {
  const v8f vw = splat(w);
  int i = 0;
  for (; i + 8 <= n; i += 8) store(y + i, load(y + i) * vw);
  for (; i < n; ++i) y[i] *= w;
}

}  // namespace vec
}  // namespace cpx
