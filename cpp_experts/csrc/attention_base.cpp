// The the x86-64 baseline, eight-lane vectors (two SSE registers each) build of paged attention's kernels (attention_kernels.h).
#include "attention_kernels.h"

namespace cpx {
namespace attn {

CPX_ATTN_BUILD(base, , 8)

}  // namespace attn
}  // namespace cpx
