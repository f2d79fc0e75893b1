/* tokenizer-internal Unicode helpers: general-category flags from the generated
 * table (unicode_tables.c, tools/gen_unicode_tables.py) and UTF-8 decoding with
 * maximal-subpart error handling. */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

enum {
    ST_UCAT_L = 1,  /* general category L* */
    ST_UCAT_N = 2,  /* general category N* */
    ST_UCAT_M = 4,  /* general category M* */
    ST_UCAT_WS = 8, /* White_Space property (regex \s) */
};

extern const int32_t st_ucat_n_runs;
extern const uint32_t st_ucat_run_start[];
extern const uint8_t st_ucat_run_flags[];
extern const uint8_t st_ucat_latin1[256];

/* ST_UCAT_* flags of a code point (0 for unassigned or > U+10FFFF). */
uint8_t st_ucat(uint32_t cp);

/* Normalization data (see tools/gen_unicode_tables.py). */
extern const int32_t st_ccc_n_runs;
extern const uint32_t st_ccc_run_start[];
extern const uint8_t st_ccc_run_value[];
extern const int32_t st_nfd_n;
extern const uint32_t st_nfd_map[][3]; /* {cp, a, b (0: none)} sorted by cp */
extern const int32_t st_nfc_n;
extern const uint32_t st_nfc_map[][3]; /* {a, b, composite} sorted by (a, b) */

/* Canonical combining class. */
uint8_t st_ccc(uint32_t cp);

#define ST_UTF8_REPLACEMENT 0xFFFDu

/* Decodes the code point at s[0..len), len >= 1. Returns the number of bytes
 * consumed (>= 1). *cp is the code point, or U+FFFD when the bytes are not valid
 * UTF-8; then the return value is the length of the maximal subpart (the longest
 * prefix that could start a valid sequence, at least 1) and *ok is false. */
size_t st_utf8_decode(const uint8_t *s, size_t len, uint32_t *cp, bool *ok);

/* Writes cp (<= U+10FFFF, not a surrogate) as UTF-8; returns 1..4. */
int st_utf8_encode(uint32_t cp, uint8_t out[4]);

/* For a lead byte: the length of its sequence (2..4), 1 for ASCII, 0 when the
 * byte cannot start a sequence. */
int st_utf8_seq_len(uint8_t lead);
/* Whether byte b may stand at position k (1..3) of a sequence led by `lead`. */
bool st_utf8_cont_ok(uint8_t lead, int k, uint8_t b);

#ifdef __cplusplus
}
#endif
