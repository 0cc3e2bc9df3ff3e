// A software model of the AMX tile instructions the kernels use (LDTILECFG, TILERELEASE, TILEZERO,
// TILELOADD, TILESTORED, TDPBSUD, TDPBF16PS), after the pseudocode and fault rules of the Intel SDM.
//
// Why: the AMX kernels (linear_amx.cpp, kernels_amx.cpp) run only on Sapphire Rapids and newer, so on
// any other CPU their tile code would never run in a test. linear_amx_emulated.cpp and
// kernels_amx_emulated.cpp compile those same sources a second time with this header after
// <immintrin.h>: every tile intrinsic becomes a call into a per-thread tile file here, and the rest
// of the kernel (unpacking, scales, accumulation: AVX-512) runs as it does on AMX hardware. The kernel
// path "amx_emulated" selects them; it is for tests and checks, far slower than any real kernel.
//
// Where the hardware faults (#UD / #GP: an unconfigured tile, shapes that do not chain, a bad
// config), the model prints what was wrong and aborts, as the process would die of SIGILL there.
#pragma once
#include <cstddef>
#include <cstdint>

namespace cpx {
namespace amx_emu {

void loadconfig(const void* cfg);  // LDTILECFG: the 64-byte palette-1 config
void release();                    // TILERELEASE
void zero(int t);                  // TILEZERO
void loadd(int t, const void* base, size_t stride);  // TILELOADD
void stored(int t, void* base, size_t stride);       // TILESTORED
void dpbsud(int c, int a, int b);    // TDPBSUD: int32 C += signed bytes of A . unsigned bytes of B
void dpbf16ps(int c, int a, int b);  // TDPBF16PS: fp32 C += bf16 pairs of A . bf16 pairs of B

}  // namespace amx_emu
}  // namespace cpx

// Replace the intrinsics of <immintrin.h> (macros pasting the tile number into the instruction, and
// inline functions) for the rest of the translation unit.
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbsud
#undef _tile_dpbf16ps
#define _tile_loadconfig(cfg) ::cpx::amx_emu::loadconfig(cfg)
#define _tile_release() ::cpx::amx_emu::release()
#define _tile_zero(t) ::cpx::amx_emu::zero(t)
#define _tile_loadd(t, base, stride) ::cpx::amx_emu::loadd((t), (base), size_t(stride))
#define _tile_stored(t, base, stride) ::cpx::amx_emu::stored((t), (base), size_t(stride))
#define _tile_dpbsud(c, a, b) ::cpx::amx_emu::dpbsud((c), (a), (b))
#define _tile_dpbf16ps(c, a, b) ::cpx::amx_emu::dpbf16ps((c), (a), (b))
