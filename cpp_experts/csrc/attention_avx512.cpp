// The AVX-512VL, sixteen-lane vectors build of paged attention's kernels (attention_kernels.h).
#include <cstdlib>

#include "attention_kernels.h"

namespace cpx {
namespace attn {

#if CPX_X86
CPX_ATTN_BUILD(avx512, CPX_AVX512VL, 16)
#else  // no x86: never called (CPX_DISPATCH_CALL takes the base build), so not built (its templates took
       // most of a build's time there)
void task_entry_avx512 CPX_ATTN_TASK_PARAMS { std::abort(); }
#endif

}  // namespace attn
}  // namespace cpx
