/* tokenizer: text <-> token ids for Llama-family models.
 *
 * Two kinds of vocabularies:
 *  - byte-level BPE (GPT-2, Llama-3, SmolLM, Qwen2): text bytes are mapped to
 *    printable characters (GPT-2's byte-to-unicode table), cut into pieces by a
 *    pre-tokenizer (the model's regex, implemented here as hand-written matchers
 *    over Unicode categories), and each piece is merged pair by pair in merge-rank
 *    order. Kinds "bpe/gpt2", "bpe/llama3", "bpe/smollm", "bpe/qwen2".
 *  - SentencePiece BPE (Llama-2, TinyLlama; GGUF tokenizer.ggml.model "llama"):
 *    spaces become U+2581 "▁", a leading "▁" is added, characters are merged by the
 *    score of the merged piece (highest first), and characters missing from the
 *    vocabulary fall back to <0xXX> byte tokens. Kind "spm".
 *
 * Sources: a HF directory (tokenizer.json + optional tokenizer_config.json) or a
 * GGUF file's tokenizer.* metadata.
 *
 * Encoding first replaces invalid UTF-8 with U+FFFD, one per maximal subpart
 * (the Unicode recommendation; what Python's bytes.decode("utf-8", "replace")
 * does), then cuts out added/special token strings (leftmost, longest first),
 * then tokenizes the text between them.
 *
 * A loaded st_tokenizer is immutable: encode/decode may run concurrently from
 * several threads; an st_detok belongs to one thread at a time.
 */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "core/core.h"
#include "loader/loader.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef struct st_tokenizer st_tokenizer;

/* From an opened model: a HF directory -> <dir>/tokenizer.json (required) and
 * <dir>/tokenizer_config.json (optional: bos/eos, add_bos_token, chat_template;
 * <dir>/chat_template.jinja when the config has no template);
 * a GGUF -> its tokenizer.ggml.* / tokenizer.chat_template keys. The caller owns
 * *out (st_tokenizer_free) and keeps owning m (the tokenizer copies what it
 * needs; m may be closed afterwards). On error *out is NULL and st_last_error()
 * names the file and the key. */
strata_status st_tokenizer_load(const st_model_files *m, st_tokenizer **out);

/* Loads a standalone tokenizer.json, plus tokenizer_config.json when
 * tokenizer_config_json is not NULL. Ownership and errors as above. */
strata_status st_tokenizer_load_json(const char *tokenizer_json, const char *tokenizer_config_json,
                                     st_tokenizer **out);

void st_tokenizer_free(st_tokenizer *t); /* NULL: no-op */

/* Encodes `len` bytes of UTF-8 text (may contain invalid UTF-8 and NUL bytes).
 * add_special: prepend BOS / append EOS as the tokenizer says (add_bos_token,
 * add_eos_token, or the tokenizer.json post-processor template).
 * parse_special: special (control) token strings in the text, e.g.
 * "<|im_start|>", become their single ids; when false they are encoded as plain
 * text. Non-special added tokens (user-defined) are always recognised.
 * On success *ids is malloc'd (caller frees; NULL when *n is 0) and *n is the
 * count; on error *ids is NULL and *n is 0. */
strata_status st_tokenizer_encode(const st_tokenizer *t, const char *text, size_t len,
                                  bool add_special, bool parse_special, int32_t **ids, int64_t *n);

/* As st_tokenizer_encode with parse_special, but a special (control) token
 * string becomes its id only where it lies wholly inside one of the spans:
 * n_spans sorted, disjoint [spans[2k], spans[2k+1]) byte ranges of text (the
 * parts a chat template wrote; the rest, e.g. message contents, is plain
 * text even when it spells "<|im_end|>"). The text between the recognised
 * control tokens is encoded as one piece, so a text without forged tokens
 * gets exactly the ids of st_tokenizer_encode. Invalid UTF-8 becomes U+FFFD
 * inside each piece (in a span or between spans) on its own. INVALID_ARG for
 * spans out of order or beyond len. */
strata_status st_tokenizer_encode_spans(const st_tokenizer *t, const char *text, size_t len, bool add_special,
                                        const size_t *spans, int64_t n_spans, int32_t **ids, int64_t *n);

int64_t st_tokenizer_vocab_size(const st_tokenizer *t);
int32_t st_tokenizer_bos(const st_tokenizer *t); /* -1 if none */
int32_t st_tokenizer_eos(const st_tokenizer *t); /* -1 if none */
int32_t st_tokenizer_unk(const st_tokenizer *t); /* -1 if none */
/* Whether encode(add_special=true) prepends BOS / appends EOS. */
bool st_tokenizer_adds_bos(const st_tokenizer *t);
bool st_tokenizer_adds_eos(const st_tokenizer *t);
/* Every id that ends generation (eos, and end-of-turn tokens such as
 * <|im_end|>, <|eot_id|>, <|end_of_text|>, <|endoftext|>, </s> when they are
 * special tokens): returns the count, *ids points into t. */
int st_tokenizer_stop_ids(const st_tokenizer *t, const int32_t **ids);
/* Exact token string (as stored in the vocabulary, e.g. "Ġthe" or "▁the") ->
 * id; -1 when absent. */
int32_t st_tokenizer_find(const st_tokenizer *t, const char *token_text);
/* The vocabulary string of `id` (not NUL-terminated; *len its length), NULL
 * when out of range. Points into t. */
const char *st_tokenizer_token(const st_tokenizer *t, int32_t id, size_t *len);
/* Special (control / unknown) tokens: skipped by decode when skip_special. */
bool st_tokenizer_is_special(const st_tokenizer *t, int32_t id);
const char *st_tokenizer_chat_template(const st_tokenizer *t); /* NULL if none */
/* "bpe/gpt2", "bpe/llama3", "bpe/smollm", "bpe/qwen2" or "spm". */
const char *st_tokenizer_kind(const st_tokenizer *t);

/* ---- decoding ----------------------------------------------------------------
 * Streaming-safe: ids are fed one at a time and only complete UTF-8 comes out
 * (never half a character); a byte sequence that cannot become valid UTF-8 is
 * emitted as U+FFFD (one per maximal subpart) as soon as it is known bad.
 * skip_special drops special tokens; otherwise their text is emitted.
 * SentencePiece: "▁" -> " ", <0xXX> -> the byte, and the space the encoder put
 * in front of the text (at the start, and after each control token such as BOS)
 * is dropped. */
typedef struct st_detok st_detok;
/* *out is owned by the caller (st_detok_free); t must outlive it. */
strata_status st_detok_init(const st_tokenizer *t, bool skip_special, st_detok **out);
void st_detok_free(st_detok *d); /* NULL: no-op */
/* Sets *out / *out_len to the text that became complete with `id` (possibly
 * empty); the buffer is owned by d and valid until the next call on d.
 * INVALID_ARG for an id out of range (nothing is consumed). */
strata_status st_detok_push(st_detok *d, int32_t id, const char **out, size_t *out_len);
/* Emits what is pending at the end (an incomplete sequence -> U+FFFD) and
 * resets d to its initial state. Buffer as for st_detok_push. */
strata_status st_detok_flush(st_detok *d, const char **out, size_t *out_len);
/* Whole-sequence decode: *out is a malloc'd NUL-terminated string (the caller
 * frees it; decoded text never contains NUL unless a token decodes to a 0 byte).
 * On error *out is NULL. */
strata_status st_tokenizer_decode(const st_tokenizer *t, const int32_t *ids, int64_t n,
                                  bool skip_special, char **out);
/* The same, with the length (the text may hold NUL bytes). */
strata_status st_tokenizer_decode_len(const st_tokenizer *t, const int32_t *ids, int64_t n,
                                      bool skip_special, char **out, size_t *out_len);

/* ---- building blocks, exposed for tests and tools ------------------------------*/
typedef enum {
    ST_PRETOK_GPT2 = 0, /* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
    ST_PRETOK_LLAMA3,   /* (?i:'s|...|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+ */
    ST_PRETOK_QWEN2,    /* as LLAMA3 with \p{N} instead of \p{N}{1,3} */
    ST_PRETOK_SMOLLM,   /* every \p{N} alone (HF Digits, individual), then GPT2 on each run */
} st_pretok;

/* "gpt2", "llama3", "qwen2", "smollm" -> the enum; false when unknown. */
bool st_pretok_from_name(const char *name, st_pretok *out);
const char *st_pretok_name(st_pretok p);

/* Cuts valid UTF-8 `text` into pre-tokenizer pieces. On success *lens is a
 * malloc'd array of the pieces' byte lengths (summing to len; caller frees) and
 * *n their count. INVALID_ARG when text is not valid UTF-8. */
strata_status st_pretok_split(st_pretok pre, const char *text, size_t len, size_t **lens,
                              int64_t *n);

/* Unicode NFC (canonical decomposition, canonical ordering, canonical
 * composition) of valid UTF-8 s[0..len). *out is malloc'd and NUL-terminated
 * (caller frees), *out_len excludes the NUL. INVALID_ARG on invalid UTF-8. */
strata_status st_utf8_nfc(const char *s, size_t len, char **out, size_t *out_len);

/* True when s[0..len) is valid UTF-8 (no surrogates, no overlongs, <= U+10FFFF). */
bool st_utf8_valid(const char *s, size_t len);
/* Copies s[0..len) replacing each maximal invalid subpart by U+FFFD. *out is
 * malloc'd and NUL-terminated (caller frees), *out_len excludes the NUL. */
strata_status st_utf8_sanitize(const char *s, size_t len, char **out, size_t *out_len);

#ifdef __cplusplus
}
#endif
