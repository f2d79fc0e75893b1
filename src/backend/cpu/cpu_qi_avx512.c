/* The integer matmul's AVX-512 VNNI level, both activation precisions, and its
 * few-token 16-row kernel W16 (cpu_qi.h). */
#include "backend/cpu/cpu_qi.h"

#if ST_CPU_HAVE_AVX2_PATH
ST_TARGET_AVX512 void st_qi_fn_avx512(void *ctx, int64_t begin, int64_t end, int ti) {
    qi_items(ctx, begin, end, ti, (qi_isa){widen_avx2, widen_s8_avx2, gather_avx2, f16_avx512, prow_vnni, tree_avx2, dot_group_vnni});
}
ST_TARGET_AVX512 void st_qi8_fn_avx512(void *ctx, int64_t begin, int64_t end, int ti) {
    qi8_items(ctx, begin, end, ti, (qi8_isa){gather_portable, f16_avx512, prow8_vnni, tree_avx2, dot_group8_vnni, true});
}

ST_TARGET_AVX512 void st_qi8_fn_w16(void *ctx, int64_t begin, int64_t end, int ti) {
    (void)ti;
    const qi_ctx *m = ctx;
    switch (m->dtype) {
    case ST_DTYPE_Q8_0: qi8_w16_t(m, ST_DTYPE_Q8_0, begin, end); return;
    case ST_DTYPE_Q4_0: qi8_w16_t(m, ST_DTYPE_Q4_0, begin, end); return;
    case ST_DTYPE_Q4_1: qi8_w16_t(m, ST_DTYPE_Q4_1, begin, end); return;
    case ST_DTYPE_Q4_K: qi8_w16_t(m, ST_DTYPE_Q4_K, begin, end); return;
    default: break;
    }
    ST_ASSERT(!"not a W16 dtype");
}
#endif
