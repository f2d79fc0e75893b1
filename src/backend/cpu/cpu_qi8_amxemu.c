/* The integer matmul's AMX level emulated in portable C, int8 activations: the
 * tile sums of cpu_qi8_amx.c on any machine, for the tests (cpu_qi.h). */
#include "backend/cpu/cpu_qi.h"

void st_qi8_fn_amxemu(void *ctx, int64_t begin, int64_t end, int ti) {
    qi8_items(ctx, begin, end, ti, (qi8_isa){gather_portable, f16_portable, prow8_portable, tree_portable, dot_group8_amxemu, true});
}
