// linear_amx.cpp's AMX int8 kernels over the software tile model of amx_emulation.h
// (kLinAmxEmulatedGemm): the kernel path "amx_emulated", so that the AMX kernels' own code is tested
// on CPUs without AMX.
#define CPX_AMX_EMULATED 1
#include "linear_amx.cpp"
