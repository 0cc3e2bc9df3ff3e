// The AVX2 + FMA, eight-lane vectors build of paged attention's kernels (attention_kernels.h).
#include "attention_kernels.h"

namespace cpx {
namespace attn {

CPX_ATTN_BUILD(avx2, CPX_AVX2_FMA, 8)

}  // namespace attn
}  // namespace cpx
