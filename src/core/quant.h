/* Reference (scalar, portable) conversion of rows between fp32 and every
 * st_dtype, following the block layouts documented in core/dtype.h.
 * Backends have their own fast kernels and are tested against these. */
#pragma once
#include <stdint.h>
#include "core/dtype.h"
#ifdef __cplusplus
extern "C" {
#endif

/* y[0..n) = dequant(x), x holding st_dtype_row_bytes(t, n) bytes.
 * n must be a multiple of the block size (asserted). */
void st_dequantize_row(st_dtype t, const void *x, float *y, int64_t n);

/* y (st_dtype_row_bytes(t, n) bytes) = quant(x[0..n)). Supported for F32, F16,
 * BF16, Q8_0, Q4_0, Q4_1 (the formats our converter writes); returns false
 * for the others. Rounding follows ggml's reference quantizers. */
bool st_quantize_row(st_dtype t, const float *x, void *y, int64_t n);

#ifdef __cplusplus
}
#endif
