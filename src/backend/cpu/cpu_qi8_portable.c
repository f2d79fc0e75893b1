/* The integer matmul's portable level, int8 activations (cpu_qi.h). */
#include "backend/cpu/cpu_qi.h"

void st_qi8_fn_portable(void *ctx, int64_t begin, int64_t end, int ti) {
    qi8_items(ctx, begin, end, ti, (qi8_isa){gather_portable, f16_portable, prow8_portable, tree_portable, NULL, true});
}
void st_qa8_fn_portable(void *ctx, int64_t begin, int64_t end, int ti) {
    (void)ti;
    quant_rows8(ctx, begin, end);
}
