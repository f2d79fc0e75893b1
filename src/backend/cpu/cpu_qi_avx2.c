/* The integer matmul's AVX2 and AVX-VNNI levels, both activation precisions (cpu_qi.h). */
#include "backend/cpu/cpu_qi.h"

#if ST_CPU_HAVE_AVX2_PATH
ST_TARGET_AVX2_F16C void st_qi_fn_avx2(void *ctx, int64_t begin, int64_t end, int ti) {
    qi_items(ctx, begin, end, ti, (qi_isa){widen_avx2, widen_s8_avx2, gather_avx2, f16_avx2, prow_avx2, tree_avx2, NULL});
}
ST_TARGET_AVX2_F16C void st_qa_fn_avx2(void *ctx, int64_t begin, int64_t end, int ti) {
    (void)ti;
    quant_rows(ctx, begin, end);
}
ST_TARGET_AVX2_F16C void st_qi8_fn_avx2(void *ctx, int64_t begin, int64_t end, int ti) {
    qi8_items(ctx, begin, end, ti, (qi8_isa){gather_portable, f16_avx2, prow8_avx2, tree_avx2, NULL, false});
}
ST_TARGET_AVXVNNI void st_qi8_fn_avxvnni(void *ctx, int64_t begin, int64_t end, int ti) {
    qi8_items(ctx, begin, end, ti, (qi8_isa){gather_portable, f16_avxvnni, prow8_avxvnni, tree_avxvnni, NULL, true});
}
ST_TARGET_AVX2_F16C void st_qa8_fn_avx2(void *ctx, int64_t begin, int64_t end, int ti) {
    (void)ti;
    quant_rows8(ctx, begin, end);
}
#endif
