/* The integer matmul's AMX-INT8 level, int8 activations (cpu_qi.h): the token
 * groups' sums on tiles. */
#include "backend/cpu/cpu_qi.h"

#if ST_CPU_HAVE_AVX2_PATH
/* The tile configuration (palette 1): tiles 0-5 of 8 rows x 32 bytes. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

ST_TARGET_AMX static void amx_begin(void) {
    amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 6; i++) cfg.colsb[i] = 32, cfg.rows[i] = QI_ROWS;
    __asm__ volatile("" ::"r"(&cfg) : "memory"); /* ldtilecfg's operand names only its first bytes */
    _tile_loadconfig(&cfg);
}

ST_TARGET_AMX static void amx_end(void) { _tile_release(); }

ST_TARGET_AMX void st_qi8_fn_amx(void *ctx, int64_t begin, int64_t end, int ti) {
    amx_begin();
    qi8_items(ctx, begin, end, ti, (qi8_isa){gather_portable, f16_avx512, prow8_vnni, tree_avx2, dot_group8_amxreal, true});
    amx_end();
}
#endif
