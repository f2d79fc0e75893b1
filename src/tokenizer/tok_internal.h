/* tokenizer internals shared by the loaders, the encoders and the decoder. */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "core/core.h"
#include "tokenizer/tokenizer.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef enum { ST_TOK_BPE = 0, ST_TOK_SPM } st_tok_type;

/* Per-token attributes (bit flags). */
enum {
    ST_TA_CONTROL = 1, /* special: parsed only with parse_special, skipped by skip_special */
    ST_TA_USER = 2,    /* added / user-defined: always cut out of the text first */
    ST_TA_BYTE = 4,    /* SPM <0xXX> byte token */
    ST_TA_UNKNOWN = 8, /* the unknown token */
    ST_TA_UNUSED = 16, /* SPM unused piece, or an id with no token (gap) */
};

/* Open-addressing map from a token's text to its id; keys live in the
 * tokenizer's text pool. */
typedef struct {
    int32_t *slots;   /* [cap] id or -1 */
    uint32_t *hashes; /* [cap] */
    size_t cap;       /* power of two */
} st_strmap;

/* (left id, right id) -> merge rank and merged id. */
typedef struct {
    uint64_t *keys;  /* [cap] (left << 32 | right) + 1; 0 = empty */
    int32_t *rank;   /* [cap] */
    int32_t *merged; /* [cap] */
    size_t cap;
} st_pairmap;

struct st_tokenizer {
    st_tok_type type;
    st_pretok pre; /* BPE only */
    char kind[24];
    int64_t n_vocab;
    char *pool;        /* token texts, back to back */
    size_t *text_off;  /* [n_vocab] */
    uint32_t *text_len;/* [n_vocab] */
    uint8_t *attr;     /* [n_vocab] ST_TA_* */
    float *scores;     /* [n_vocab] SPM only */
    char *dec_pool;    /* decoded bytes of every token */
    size_t *dec_off;   /* [n_vocab] */
    uint32_t *dec_len; /* [n_vocab] */
    st_strmap vocab;
    st_pairmap merges; /* BPE */
    int32_t byte_id[256]; /* BPE: token of the mapped byte; SPM: <0xXX>; -1 */
    bool ignore_merges;   /* BPE: a piece that is a whole token is not merged */
    bool nfc;             /* BPE from tokenizer.json: NFC normalizer */
    bool add_space_prefix;/* SPM */
    bool add_bos, add_eos;
    int32_t bos, eos, unk;
    int32_t *stop;
    int n_stop;
    char *chat_template;
    /* tokens cut out of the text before tokenizing (CONTROL | USER), by first
     * byte, each bucket sorted by length, longest first */
    int32_t *split_ids;
    int32_t split_start[257];
};

/* ---- building (tokenizer.c) ---- */
/* Allocates an empty tokenizer with n_vocab ids and a text pool of pool_bytes. */
strata_status st_tok_alloc(st_tokenizer **out, st_tok_type type, int64_t n_vocab,
                           size_t pool_bytes, const char *what);
/* Stores the text of `id` (called once per id, in increasing pool order). */
void st_tok_set_text(st_tokenizer *t, int32_t id, const char *s, size_t len, size_t *pool_pos);
/* Builds the vocab map, byte tables, decoded texts, split lists, stop ids and
 * the kind string. `what` names the source in messages. */
strata_status st_tok_finish(st_tokenizer *t, const char *what);
int32_t st_tok_lookup(const st_tokenizer *t, const char *s, size_t len);
/* Records BPE merge `rank`: the tokens a and b and their concatenation, looked
 * up in the vocabulary (t->merges must be initialised). *missing (NULL on
 * success): which of the three is not in the vocabulary, as words for the
 * caller's message ("its first part", "its second part", "the merged token"),
 * with STRATA_ERR_FORMAT and no message set; STRATA_ERR_NOMEM (message set). */
strata_status st_tok_add_merge(st_tokenizer *t, const char *a, size_t al, const char *b, size_t bl, int32_t rank,
                               const char **missing);
/* Stop ids: eos plus the known end-of-turn special tokens present; loaders call
 * it last. st_tok_add_stop adds one more (ignores out-of-range ids). */
strata_status st_tok_build_stops(st_tokenizer *t);
strata_status st_tok_add_stop(st_tokenizer *t, int32_t id);

strata_status st_pairmap_init(st_pairmap *m, size_t n);
void st_pairmap_put(st_pairmap *m, int32_t l, int32_t r, int32_t rank, int32_t merged);
bool st_pairmap_get(const st_pairmap *m, int32_t l, int32_t r, int32_t *rank, int32_t *merged);
void st_pairmap_free(st_pairmap *m);

/* GPT-2 byte <-> unicode map. */
uint32_t st_bytelevel_char(uint8_t b);
int st_bytelevel_byte(uint32_t cp); /* -1 when cp is not a mapped char */

/* ---- loaders ---- */
strata_status st_tok_load_json_file(const char *json_path, const char *config_path,
                                    st_tokenizer **out);
strata_status st_tok_load_gguf(const st_model_files *m, st_tokenizer **out);

/* ---- encoding ---- */
typedef struct {
    int32_t *v;
    int64_t n, cap;
} st_idvec;
strata_status st_idvec_push(st_idvec *v, int32_t id);

/* Scratch buffers reused across pieces of one encode call. */
typedef struct {
    void *sym;
    size_t sym_cap;
    void *heap;
    size_t heap_cap;
    char *buf;
    size_t buf_cap;
    uint32_t *cps;
    uint8_t *flags;
    size_t *offs;
    size_t cp_cap;
    int64_t *bounds;
    size_t bounds_cap;
} st_enc_scratch;
void st_enc_scratch_free(st_enc_scratch *s);
strata_status st_scratch_reserve(void **p, size_t *cap, size_t n, size_t elem);

/* Pre-tokenizes valid UTF-8 text[0..len) into pieces; *bounds gets n+1 byte
 * offsets (in s->bounds). */
strata_status st_pretok_run(st_pretok pre, const char *text, size_t len, st_enc_scratch *s,
                            int64_t *n_pieces);

/* Byte-level BPE of one pre-token piece; appends ids. */
strata_status st_bpe_encode_piece(const st_tokenizer *t, const char *p, size_t len,
                                  st_enc_scratch *s, st_idvec *out);
/* SentencePiece BPE of one text fragment (between control tokens); appends ids. */
strata_status st_spm_encode_fragment(const st_tokenizer *t, const char *p, size_t len,
                                     st_enc_scratch *s, st_idvec *out);

#ifdef __cplusplus
}
#endif
