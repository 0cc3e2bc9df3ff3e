// kernels_amx.cpp's AMX bf16 kernel over the software tile model of amx_emulation.h
// (amx_emulated_gemm_bf16): the kernel path "amx_emulated", so that the AMX kernel's own code is
// tested on CPUs without AMX.
#define CPX_AMX_EMULATED 1
#include "kernels_amx.cpp"
