/* backend/rope_angle: the RoPE angle, one definition for every backend (the
 * CPU's rope_fn and CUDA's rope_kernel include this; C and CUDA C alike).
 *
 * Token at position pos (an int32, 0 .. 2^31 - 1), pair j with inverse
 * frequency f = inv_freq[j] (a float, as the model computes it: HF's float32
 * values, llama.c): the angle is the exact real number pos * f. It is carried
 * as hi + lo in double:
 *   hi = pos * f rounded to double; lo = fma(pos, f, -hi), its rounding error,
 *   exact (|lo| <= 2^-23 rad for pos < 2^31, f <= 1).
 * pos has at most 31 significant bits and f 24, so below pos = 2^29 the
 * product fits double's 53 bits: lo = 0 and hi is the angle itself. The
 * backend then takes cos and sin of hi in double (glibc's and CUDA's double
 * sin / cos / sincos reduce the argument modulo 2 pi exactly, however large)
 * and st_rope_fix adds lo to first order (the neglected lo^2 / 2 < 1e-14).
 * Nothing rounds the position or the angle to float: cos and sin are right
 * to ~1e-14 before their rounding to float, which is then the only error
 * (<= 2^-24 rad as an angle; ~4e-8 measured) for every int32 position. The
 * double product alone (without lo) is off by up to 2^-23 rad between 2^30
 * and 2^31; a float32 angle (float(pos) * f) by up to 1 rad at 2^24 and by
 * whole turns past 2^26 (tests/test_rope_positions.c measures all three).
 *
 * lo = +0 leaves cos and sin bit for bit as they were, so positions below
 * 2^29 give the same bits as the double product alone (the formula before
 * st_rope_fix existed). */
#pragma once
#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define ST_ROPE_FN static inline __host__ __device__
#else
#define ST_ROPE_FN static inline
#endif

/* The angle pos * inv_freq as hi + lo (above). */
ST_ROPE_FN void st_rope_angle(int32_t pos, float inv_freq, double *hi, double *lo) {
    const double p = (double)pos, f = (double)inv_freq;
    const double h = p * f;
    *hi = h;
    *lo = fma(p, f, -h);
}

/* (c, s) = (cos hi, sin hi) on entry; on exit cos and sin of hi + lo, to
 * first order in lo (explicit fma: the same arithmetic on every backend,
 * whatever a compiler contracts). */
ST_ROPE_FN void st_rope_fix(double lo, double *c, double *s) {
    const double c0 = *c, s0 = *s;
    *c = fma(-lo, s0, c0);
    *s = fma(lo, c0, s0);
}
