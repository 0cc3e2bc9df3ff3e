// The AVX-512VL, sixteen-lane vectors build of paged attention's kernels (attention_kernels.h).
#include "attention_kernels.h"

namespace cpx {
namespace attn {

CPX_ATTN_BUILD(avx512, CPX_AVX512VL, 16)

}  // namespace attn
}  // namespace cpx
