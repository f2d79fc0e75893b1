/* The integer matmul's portable level, precise activations (cpu_qi.h). */
#include "backend/cpu/cpu_qi.h"

void st_qi_fn_portable(void *ctx, int64_t begin, int64_t end, int ti) {
    qi_items(ctx, begin, end, ti,
             (qi_isa){widen_portable, widen_s8_portable, gather_portable, f16_portable, prow_portable, tree_portable, NULL});
}
void st_qa_fn_portable(void *ctx, int64_t begin, int64_t end, int ti) {
    (void)ti;
    quant_rows(ctx, begin, end);
}
