/* strata public C API: status codes, logging, and opaque handles for a model
 * with its tokenizer, chat template and serving engine.
 *
 * Everything here uses only this header's own types; the implementation
 * (src/api/strata_api.c, library strata_api) sits over the internal modules.
 *
 * Conventions, for every function below:
 *   - a function that can fail returns a strata_status; on failure it records
 *     a message (naming the bad argument / file / field) that
 *     strata_last_error() returns on the same thread;
 *   - every pointer argument is checked: NULL where one is required gives
 *     STRATA_ERR_INVALID_ARG (never a crash); out parameters are set (to NULL
 *     / 0) on failure too, where the function says so;
 *   - "buffer too small": functions that write into a caller's buffer of
 *     `cap` elements set the needed count (even when the buffer is too small,
 *     and for a NULL buffer with cap 0, the way to ask for the size) and
 *     return STRATA_ERR_NOMEM when it does not fit;
 *   - the library never prints: messages go to the log callback.
 *
 * Minimal use:
 *     strata_model *m;
 *     strata_model_params mp = {.device = "cpu"};
 *     if (strata_model_load(path, &mp, &m) != STRATA_OK) fail(strata_last_error());
 *     strata_request_params rq = {.prompt_text = "Once upon a time", .max_tokens = 32};
 *     strata_callbacks cb = {.on_text = print_text, .on_finish = done, .user = &state};
 *     uint64_t id;
 *     strata_submit(m, &rq, &cb, &id);
 *     bool worked = true;
 *     while (!state.done && worked) strata_step(m, &worked);
 *     strata_model_free(m);
 */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    STRATA_OK = 0,
    STRATA_ERR_INVALID_ARG,   /* a parameter is out of range or NULL */
    STRATA_ERR_IO,            /* open/read/mmap failed, or file too short */
    STRATA_ERR_FORMAT,        /* a file's content is malformed */
    STRATA_ERR_UNSUPPORTED,   /* valid but not handled (dtype, architecture, ...) */
    STRATA_ERR_NOMEM,         /* an allocation or a budget failed */
    STRATA_ERR_NOT_FOUND,     /* a tensor / key / file is missing */
    STRATA_ERR_MISMATCH,      /* two sources of truth disagree (config vs shapes) */
    STRATA_ERR_BACKEND,       /* a device call failed */
    STRATA_ERR_INTERNAL,
    STRATA_ERR_BUSY,          /* a bounded queue is full: try later, or do without */
} strata_status;

typedef enum {
    STRATA_LOG_DEBUG = 0,
    STRATA_LOG_INFO,
    STRATA_LOG_WARN,
    STRATA_LOG_ERROR,
} strata_log_level;

/* The library never prints. Messages go to this callback (NULL: dropped). */
typedef void (*strata_log_fn)(strata_log_level level, const char *msg, void *user);

const char *strata_status_str(strata_status st);

/* ==== errors and logging ===================================================== */

/* The message of the last failure on the calling thread ("" when none). The
 * string belongs to the library and stays valid until the next failing call
 * on this thread. Thread-safe (per-thread storage). */
const char *strata_last_error(void);

/* Sends the library's log messages of `level` and above to fn(level, msg,
 * user) (fn NULL: dropped, the default). Process-wide; call it before loading
 * models (not synchronised with log calls on other threads). fn may be called
 * from any thread the library runs on (the engine thread included). */
void strata_set_log(strata_log_level level, strata_log_fn fn, void *user);

/* ==== model ===================================================================== */

typedef struct strata_model strata_model;

/* Element type of the paged KV cache. Zero is the default (bf16). */
typedef enum {
    STRATA_KV_BF16 = 0,
    STRATA_KV_FP8,  /* e4m3 with a scale per token and kv head */
    STRATA_KV_F32,  /* reference checks */
} strata_kv_dtype;

/* Precision of prefill matmuls and attention on CUDA (no effect on the CPU,
 * which computes in fp32). */
typedef enum {
    STRATA_PREFILL_AUTO = 0, /* fast for models stored in bf16, f16 or a quantized type; precise for f32 */
    STRATA_PREFILL_PRECISE,  /* hi+lo split bf16 operands: ~1e-5 of fp32 math */
    STRATA_PREFILL_FAST,     /* bf16 operands, fp32 accumulation: ~1e-2 relative error on logits */
} strata_prefill;

/* Speculative decoding: where the drafts a decode step verifies come from. */
typedef enum {
    STRATA_SPEC_OFF = 0,
    STRATA_SPEC_LOOKUP, /* prompt lookup: what followed the latest earlier occurrence of the output's
                           last n-gram (no second model) */
    STRATA_SPEC_DRAFT,  /* a smaller model of the same vocabulary (draft_model) */
} strata_spec;

/* CPU backend: the precision of the activations in matmuls over quantized
 * weights (integer dot products per 32-block). */
typedef enum {
    STRATA_CPU_ACT_PRECISE = 0, /* 22-bit integers: ~1e-6 of the f32 dequantized product (default) */
    STRATA_CPU_ACT_INT8,        /* int8 (q8-style, as llama.cpp): ~1.5e-2; vpdpbusd, faster */
} strata_cpu_act;

/* How to load a model. Zero-initialise it: every zero field is its default
 * (a NULL params pointer means all defaults). */
typedef struct {
    const char *device;        /* "cpu", "cuda" or "auto" (NULL: auto = CUDA when built and a GPU is present) */
    int threads;               /* CPU worker threads (0: all cores) */
    strata_cpu_act cpu_act;    /* CPU: quantized matmuls' activation precision (default PRECISE) */
    size_t device_mem;         /* device budget in bytes: weights, KV cache, activations, scratch
                                  (0: unlimited, every weight resident); weights that do not fit stream */
    size_t host_mem;           /* pinned host bytes for streamed weights (0: 80% of available memory) */
    strata_kv_dtype kv_dtype;  /* KV cache element type (default bf16) */
    const char *kv_dtype_name; /* the same as a string, "bf16", "fp8" or "f32"; overrides kv_dtype when
                                  not NULL */
    int64_t max_batch;         /* sequences running at once (0: 32; at most 4096) */
    int64_t max_seq_len;       /* tokens per sequence, prompt + output (0: the model's context length,
                                  at most 4096) */
    int64_t prefill_chunk;     /* prompts run in chunks of this many tokens (0: 256) */
    int64_t max_waiting;       /* requests waiting for a slot before strata_submit refuses (0: 4096) */
    bool disable_prefix_cache; /* false (default): prompt prefixes already computed are reused */
    strata_prefill prefill;    /* CUDA prefill precision (default AUTO) */
    int ring_slots;            /* device slots streamed weights pass through (0: 2) */
    double h2d_gbps, ssd_gbps; /* bandwidths (GB/s) the weight plan uses instead of measuring (0: measure) */
    int cpu_layers;            /* hybrid execution (CUDA, weights streamed): FFN groups of this many layers
                                  computed on the CPU from host memory in decode steps (0: auto, the
                                  split with the least predicted step, from the CPU's matmul rate measured
                                  at load with `threads` threads; -1: none) */
    double cpu_split;          /* hybrid: of each such FFN group, the share of its intermediate rows the GPU
                                  computes from a streamed copy while the CPU computes the rest, both at once
                                  (0: auto, the share with the least predicted step; < 0: none, the CPU
                                  computes whole groups; (0, 1): that share, rounded to 256 rows on large layers) */
    int64_t cpu_max_tokens;    /* forward passes of at most this many tokens compute those groups on the CPU;
                                  larger ones (prefill) stream them to the device (0: 8) */
    int64_t cpu_pass_tokens;   /* hybrid: the decode pass the split balances, in tokens (0: 1, a decode step;
                                  with speculative decoding of k drafts, k + 1); at most cpu_max_tokens */
    /* serving knobs (zero: defaults) */
    int64_t max_seq_len_cap;   /* when max_seq_len is 0: the model's context length capped at this many
                                  tokens (0: 4096; e.g. 2048 for `strata serve`) */
    int64_t step_tokens;       /* token budget of an engine step, decodes + prompt chunks (0:
                                  prefill_chunk + max_batch); at least prefill_chunk */
    int64_t kv_blocks;         /* paged KV cache size in blocks (0: from kv_mem) */
    size_t kv_mem;             /* paged KV cache bytes when kv_blocks is 0 (0: room for max_batch
                                  sequences of max_seq_len tokens, at most 1 GiB; never less than one
                                  sequence) */
    bool host_sample;          /* sample on the host even on CUDA (checks; default: on the device) */
    /* KV tiers below the device's paged cache (they need the prefix cache) */
    int64_t kv_host_mem;       /* host tier bytes (pinned on CUDA, allocated as it fills): 0: 1/8 of the
                                  memory available at startup, at most 32 GiB; -1: no host tier (and so
                                  no SSD tier); more than the machine has available: refused */
    bool kv_offload_lazy;      /* blocks go to the host tier only when the device evicts them (default:
                                  as they fill) */
    const char *kv_ssd_dir;    /* SSD tier directory (NULL: none): blocks persist there across restarts
                                  of the same model; another model's files there are ignored */
    uint64_t kv_ssd_size;      /* SSD tier bytes (0: 64 GiB, fewer when the disk has less room) */
    int64_t kv_ssd_fail_write_nth; /* tests: the Nth SSD write fails as on a full disk (0: never) */
    size_t kv_landing_mem;     /* prefill/decode disaggregation, a decode node: device bytes where blocks
                                  from a prefill node land (consecutive block slots, layer-major), to be
                                  copied into the KV pool as they are adopted (0: they land in the host
                                  tier) */
    bool kv_stream;            /* a request too long for the device KV pool runs with its KV in host
                                  memory, streamed through the device layer by layer (one such request
                                  at a time): max_seq_len may exceed the pool; with kv_ssd_dir, the part
                                  past kv_stream_mem goes to a private file there (unlinked) */
    size_t kv_stream_mem;      /* host bytes that request's KV takes at most, in whole segments (0: 3/4
                                  of the memory available at its first pass); past them its segments go
                                  to the file in kv_ssd_dir, or without one the request fails naming
                                  --kv-stream-mem. Needs kv_stream; more than the machine has
                                  available: refused */
    int64_t kv_segment;        /* tokens per host / SSD segment of that request's KV (0: 65536; a power
                                  of two from 4096) */
    double kv_cpu_attn;        /* that request's decode attends this share of its earlier keys, the
                                  oldest, on the CPU from host memory (0: none; up to 1; -1: planned
                                  from rates measured at its first pass; on the CPU backend 0 and -1
                                  mean 1) */
    /* speculative decoding: drafts verified in one pass with the step's token; greedy output is the
     * same token for token, sampling keeps the distribution (engine/spec.h) */
    strata_spec spec;          /* default off; STRATA_SPEC_DRAFT needs draft_model */
    int spec_k;                /* most drafts per step (0: 7; 1 to 32); fewer as acceptance falls */
    double spec_cost;          /* one draft's cost in one-token steps, fixed (0: measured as it runs) */
    const char *draft_model;   /* the draft model's path (GGUF or HF directory; same vocabulary),
                                  run on the same device beside the model */
    /* tests: faults injected into weight streaming and allocations (0: none) */
    int64_t weight_read_fail_nth;  /* the Nth weight read from the file fails with EIO */
    int64_t weight_read_short_nth; /* the Nth weight read comes back short, as if the file ended */
    int weight_read_delay_ms;      /* every weight read lands this many milliseconds late (its buffer
                                      holds poison until then) */
    int64_t device_alloc_fail_nth; /* the Nth device allocation of the backend fails */
    int64_t host_alloc_fail_nth;   /* the Nth pinned host allocation of the backend fails */
} strata_model_params;

/* Opens a model (a Hugging Face directory with tokenizer.json, or a .gguf
 * file): maps its files, creates the backend and the tokenizer, recognises
 * the chat template; no engine yet. Tokenizer, chat and info functions work
 * on the result; generation needs strata_model_create_engine. params is
 * copied (NULL: defaults). The caller owns *out (strata_model_free); on error
 * *out is NULL and strata_last_error() says why (the file, the key, the bad
 * parameter). Thread-safe (separate models are independent). */
strata_status strata_model_open(const char *path, const strata_model_params *params, strata_model **out);

/* Checks the memory budgets of params against what this machine has now
 * (MemAvailable of /proc/meminfo): host_mem (pinned host memory, on any
 * backend), kv_stream_mem (a streamed request's KV, in host memory on any
 * backend) and, on the CPU backend (device "cpu", or "auto" without a GPU),
 * kv_mem when kv_blocks is 0 (the KV cache lives in host memory there; the
 * weights' file mapping is not counted). STRATA_ERR_INVALID_ARG when one is
 * larger, with a message naming its option (--host-mem, --kv-stream-mem,
 * --kv-mem), the size asked and what the machine has; STRATA_OK otherwise,
 * or when MemAvailable is unknown. strata_model_open calls it first. NULL:
 * defaults (OK). */
strata_status strata_check_memory(const strata_model_params *params);

/* Builds the engine of an opened model with the params given to
 * strata_model_open: the model weights on the device, the paged KV cache,
 * the scheduler (not started: step it with strata_step or run its thread
 * with strata_start). STRATA_OK without doing anything when it exists.
 * Errors: MISMATCH when the tokenizer has more tokens than the model's
 * vocabulary, NOMEM when a budget is too small, INVALID_ARG for a bad
 * parameter...; the model stays open (without engine). Not thread-safe: call
 * it before sharing the model. */
strata_status strata_model_create_engine(strata_model *m);

/* strata_model_open + strata_model_create_engine. Ownership and errors as
 * for strata_model_open (on error nothing is left open). */
strata_status strata_model_load(const char *path, const strata_model_params *params, strata_model **out);

/* Stops the engine thread if it runs, finishes every pending request with
 * STRATA_FINISH_ABORT (on_finish runs on the calling thread, before this
 * returns), then frees everything. NULL: no-op. No other call on m may run
 * concurrently or follow. */
void strata_model_free(strata_model *m);

/* Reads every page of the model's mapped files once, so that the first
 * prompt is not timed with the page faults of reading the weights (useful on
 * the CPU backend, which computes from the mapping). progress (may be NULL)
 * is called on the calling thread every 4 MiB with the bytes read so far and
 * the total. Errors: INVALID_ARG for a NULL model. Thread-safe. */
strata_status strata_model_page_in(const strata_model *m, void (*progress)(void *user, uint64_t done, uint64_t total),
                                   void *user);

/* Architecture basics and what this model was opened with. */
typedef struct {
    int64_t vocab_size;           /* the model's vocabulary (embedding rows) */
    int64_t tokenizer_vocab_size; /* the tokenizer's (<= vocab_size for a usable model) */
    int64_t n_layers;
    int64_t hidden_size;
    int64_t intermediate_size;
    int64_t n_heads;
    int64_t n_kv_heads;
    int64_t head_dim;
    int64_t context_length;       /* positions the model was trained for (0: not given) */
    int64_t context_limit;        /* the longest context its RoPE allows: context_length, times the
                                     factor of a linear RoPE scaling (rope_linear_factor) */
    double rope_linear_factor;    /* that factor (1: no linear scaling) */
    int32_t bos_id, eos_id;       /* the tokenizer's (-1: none) */
    const char *backend;          /* "cpu" or "cuda" */
    const char *kv_dtype;         /* "bf16", "fp8" or "f32" */
    /* the engine's, once created (0 before strata_model_create_engine) */
    int64_t max_batch;
    int64_t max_seq_len;          /* prompt + output tokens of one request */
    /* the chat format strata_chat_apply uses: "chatml", "llama3", "llama2", or "none" (no template,
       or one that is not recognised: strata_chat_template says which) */
    const char *chat_template;
    bool chat_wants_date;         /* the template names today's date (Llama-3.1+): see strata_chat_set_date */
} strata_model_info;

/* The sampling settings the model recommends (a HF directory's
 * generation_config.json, a GGUF file's general.sampling.* keys): only what
 * is present is set (has_*); source names the file ("" when nothing was
 * found). */
typedef struct {
    bool has_temperature, has_top_p, has_top_k, has_min_p, has_repetition_penalty;
    double temperature;           /* >= 0 (0: greedy) */
    double top_p;                 /* (0, 1] */
    int64_t top_k;                /* >= 0 (0: off) */
    double min_p;                 /* [0, 1] */
    double repetition_penalty;    /* > 0 */
    char source[1100];
} strata_sampling_defaults;

/* Reads them into *out (zeroed first). No recommendation is no error; a file
 * that cannot be parsed or a value out of range: STRATA_ERR_FORMAT naming the
 * file and the key (*out then zeroed). INVALID_ARG for NULLs. Thread-safe. */
strata_status strata_model_sampling_defaults(const strata_model *m, strata_sampling_defaults *out);

/* Fills *out. Strings point into m (valid until strata_model_free, or for
 * chat_template until strata_chat_set_template). Errors: INVALID_ARG for
 * NULL arguments. Thread-safe against everything but
 * strata_model_create_engine / strata_chat_set_*. */
strata_status strata_model_info_get(const strata_model *m, strata_model_info *out);

/* The engine's parameters in force (defaults filled in, as it was built) and
 * what one of its steps costs, for rooflines: a forward pass of n tokens over
 * sequences holding c keys in all reads about weight_bytes + c *
 * kv_bytes_per_token bytes and computes n * flops_per_token + (query, key)
 * pairs * attn_flops_per_pair FLOPs. */
typedef struct {
    int64_t max_batch;            /* sequences running at once */
    int64_t max_seq_len;          /* prompt + output tokens of one request */
    int64_t prefill_chunk;        /* prompts run in chunks of this many tokens */
    int64_t step_tokens;          /* token budget of a step (decodes + prompt chunks) */
    int64_t max_waiting;          /* requests waiting for a slot before strata_submit refuses */
    int64_t kv_block_size;        /* tokens per block of the paged KV cache */
    int64_t kv_blocks;            /* blocks in the paged KV cache */
    const char *kv_dtype;         /* "bf16", "fp8" or "f32" (a static string) */
    bool prefix_cache;            /* prompt prefixes already computed are reused */
    /* KV tiers: blocks of kv_block_bytes each in the host tier and SSD tier (0: the tier is off) */
    int64_t kv_host_blocks, kv_ssd_blocks, kv_ssd_found; /* found: blocks of earlier runs on the SSD tier */
    double kv_block_bytes;
    const char *kv_offload;       /* "eager" or "lazy" (a static string) */
    bool host_sample;             /* sampling on the host even on CUDA */
    /* step costs (fixed when the engine is built) */
    double weight_bytes;          /* weight bytes one forward pass reads (every layer matrix and norm,
                                     the final norm and lm_head; embedding rows not counted unless
                                     the table is lm_head) */
    double kv_bytes_per_token;    /* K and V of every layer, as the cache stores them (kv_dtype) */
    double flops_per_token;       /* 2 x the elements of every matrix a token goes through (lm_head
                                     included) */
    double attn_flops_per_pair;   /* 4 x heads x head_dim x layers: scores and the weighted sum */
    /* the KV layout P-D transfers carry (strata_kv_piece): layers, bytes of one layer of one block,
     * and an identity of the model files, config shape and KV layout (equal on two nodes: their
     * blocks are interchangeable) */
    int64_t kv_layers;
    size_t kv_layer_bytes;
    uint64_t kv_identity;
    int64_t kv_landing_blocks;    /* block slots of the landing memory (kv_landing_mem; 0: none) */
    strata_spec spec;             /* speculative decoding (off, lookup, draft) */
    int spec_k;                   /* its most drafts per step */
} strata_engine_info;

/* Fills *out (zeroed on failure). Errors: INVALID_ARG for NULL arguments or a
 * model without engine. Thread-safe (the values are fixed once the engine is
 * built). */
strata_status strata_engine_info_get(const strata_model *m, strata_engine_info *out);

/* ==== tokenizer ================================================================== */

/* Encodes NUL-terminated UTF-8 text (invalid UTF-8 becomes U+FFFD).
 * add_special: BOS / EOS added as the tokenizer says. parse_special: control
 * token strings in the text (e.g. "<|im_start|>") become their ids; false:
 * they are encoded as plain text. Writes up to cap ids to ids (may be NULL
 * when cap is 0); *n is always the full count: NOMEM when it exceeds cap
 * (nothing useful in ids then). Errors: INVALID_ARG (NULL m, text or n, NULL
 * ids with cap > 0), NOMEM. Thread-safe. */
strata_status strata_tokenize(const strata_model *m, const char *text, bool add_special, bool parse_special,
                              int32_t *ids, size_t cap, size_t *n);

/* As strata_tokenize, into an array it allocates: *ids (malloc'd: the caller
 * frees it with free(); NULL when *n is 0) of *n ids. Errors: INVALID_ARG
 * (NULL m, text, ids or n), NOMEM; *ids NULL and *n 0 on error. Thread-safe. */
strata_status strata_tokenize_alloc(const strata_model *m, const char *text, bool add_special, bool parse_special,
                                    int32_t **ids, size_t *n);

/* Decodes ids[0..n) to UTF-8 text, special tokens included (the inverse of
 * strata_tokenize with parse_special; a SentencePiece model's leading space
 * dropped). Writes the text and a terminating NUL into buf when cap >= *len +
 * 1, else returns NOMEM; *len is always the text's length (without the NUL).
 * buf may be NULL when cap is 0. Errors: INVALID_ARG (NULL pointers, an id
 * outside the tokenizer's vocabulary: the message names it), NOMEM.
 * Thread-safe. */
strata_status strata_detokenize(const strata_model *m, const int32_t *ids, size_t n, char *buf, size_t cap,
                                size_t *len);

/* ==== chat template ============================================================== */

/* Formats a conversation with the model's chat format (strata_model_info's
 * chat_template): messages i < n with roles[i] ("system", "user",
 * "assistant", ...) and contents[i] (UTF-8 text), then the assistant's header
 * when add_generation_prompt. The result is text: tokenize it with
 * add_special = false (it holds BOS where the format wants one) and
 * parse_special = true (its control tokens). Contents are copied as they are:
 * a content holding control token strings becomes those tokens when so
 * tokenized: to build a prompt from untrusted messages, use
 * strata_chat_tokenize instead. Output as strata_detokenize (buf, cap, *len, NOMEM).
 * Errors: INVALID_ARG (NULL pointers, n = 0, roles the format rejects, e.g.
 * Llama-2's alternation), UNSUPPORTED (no chat format: the model has no
 * template, or one that is not recognised: the message names its markers),
 * NOMEM. Thread-safe against itself; not against strata_chat_set_*. */
strata_status strata_chat_apply(const strata_model *m, const char *const *roles, const char *const *contents,
                                size_t n, bool add_generation_prompt, char *buf, size_t cap, size_t *len);

/* Formats a conversation as strata_chat_apply does and tokenizes it for the
 * prompt, safely: control tokens come only from the template; a content (or
 * role) that spells "<|im_end|>" or "<|im_start|>assistant" is encoded as
 * plain text, so a message cannot forge a turn. For contents without control
 * token strings the ids are those of strata_tokenize(strata_chat_apply(...),
 * add_special = false, parse_special = true). Submit them as prompt_ids.
 * Output as strata_tokenize (ids, cap, *n_ids always the full count, NOMEM
 * when it exceeds cap). Errors as strata_chat_apply. Thread-safe as
 * strata_chat_apply. */
strata_status strata_chat_tokenize(const strata_model *m, const char *const *roles, const char *const *contents,
                                   size_t n, bool add_generation_prompt, int32_t *ids, size_t cap, size_t *n_ids);

/* The chat format in use: *name = "chatml", "llama3", "llama2" or "none".
 * Returns UNSUPPORTED (message: the template's markers, *name "none") when
 * the model has a template that is not recognised and no format was set;
 * else STRATA_OK (*name "none": the model has no template or "none" was
 * set). INVALID_ARG for NULL arguments. */
strata_status strata_chat_template(const strata_model *m, const char **name);

/* Chooses the chat format: "chatml", "llama3" or "llama2" (a family: the
 * model's template details, such as SmolLM2's default system message, are
 * kept when its template is of that family), "none" (no chat format:
 * strata_chat_apply fails), or NULL (the model's own template again).
 * INVALID_ARG for another name. Not thread-safe: not while strata_chat_apply
 * or strata_model_info_get run. */
strata_status strata_chat_set_template(strata_model *m, const char *name);

/* Llama-3.1+ templates name a date in their system turn ("26 Jul 2024" by
 * default; transformers gives today's date when the template asks for it:
 * strata_model_info's chat_wants_date). Sets it (e.g. strftime "%d %b %Y";
 * the library never reads the clock). No effect (STRATA_OK) on formats
 * without a date. INVALID_ARG for NULL arguments. Not thread-safe, as
 * strata_chat_set_template. */
strata_status strata_chat_set_date(strata_model *m, const char *date);

/* ==== generation ================================================================= */

/* Why a request ended. */
typedef enum {
    STRATA_FINISH_STOP = 0, /* an end token (EOS, end of turn) or a stop string */
    STRATA_FINISH_LENGTH,   /* max_tokens reached, or the sequence filled max_seq_len */
    STRATA_FINISH_ABORT,    /* strata_abort, strata_stop or strata_model_free */
    STRATA_FINISH_ERROR,    /* the forward pass or the sampler failed (error says why) */
} strata_finish_reason;

#define STRATA_FINISH_COUNT 4 /* the reasons above */

/* "stop", "length", "abort" or "error" (a static string; "?" for another value). */
const char *strata_finish_reason_str(strata_finish_reason r);

/* How a request ended, as on_finish receives it (valid during the call
 * only). Times are seconds from strata_submit. */
typedef struct {
    strata_finish_reason reason;
    const char *detail;        /* "eos", "stop_string", "max_tokens", "context_full", "abort" or "error"
                                  (a static string) */
    int stop_string;           /* STOP by a stop string: its index in the request's list; else -1 */
    int64_t prompt_tokens;
    int64_t completion_tokens; /* tokens sampled (a final end token counts) */
    int64_t cached_tokens;     /* prompt tokens served from the prefix cache instead of computed */
    double queue_s;            /* until it got a slot */
    double ttft_s;             /* until its first sampled token (< 0: none) */
    double total_s;
    const char *error;         /* ERROR: why; else NULL */
} strata_finish;

/* A request. Zero-initialise it: zero fields are greedy decoding without
 * truncation or penalty, up to the context. Everything is copied by
 * strata_submit. */
/* The sampling ranges the front ends (strata run, strata serve) accept, the
 * same in both: temperature in [0, STRATA_TEMPERATURE_MAX] (OpenAI's range;
 * 0: greedy), seed an integer in [0, STRATA_SEED_MAX] (exact in a JSON number)
 * or -1 (as absent: a fresh seed). The engine itself takes any temperature
 * >= 0 and any 64-bit seed. */
#define STRATA_TEMPERATURE_MAX 2.0
#define STRATA_SEED_MAX 9007199254740992LL /* 2^53 */
/* ... and, in both: top_p in (0, 1], min_p in [0, 1], top_k >= -1 (0 and -1:
 * off), repetition_penalty in (0, STRATA_REPETITION_PENALTY_MAX]. */
#define STRATA_REPETITION_PENALTY_MAX 2.0

/* A sampling value the front ends read as a double (top_p,
 * repetition_penalty, min_p) as the float of strata_request_params: the
 * nearest float, except that a value > 0 below the float range becomes the
 * smallest positive float instead of 0, which those fields read as "off"
 * (top_p 1e-300 keeps only the most likely token, as asked). */
float strata_sampling_float(double v);

typedef struct {
    /* the prompt: token ids (ids in [0, tokenizer vocabulary)) or NUL-terminated text, not both */
    const int32_t *prompt_ids;
    size_t n_prompt_ids;
    const char *prompt_text;   /* tokenized with parse_special (control token strings are tokens)
                                  and BOS / EOS added as the tokenizer says, unless: */
    bool text_no_add_special;  /* the text already holds BOS (strata_chat_apply's output) */
    int64_t max_tokens;        /* > 0: at most this many sampled tokens; 0: until max_seq_len is full;
                                  < 0: INVALID_ARG */
    float temperature;         /* 0: greedy (deterministic); else > 0 */
    int32_t top_k;             /* 0: off */
    float top_p;               /* (0, 1]; 0 or 1: off */
    float min_p;               /* [0, 1]; 0: off */
    float repetition_penalty;  /* > 0, HF style; 0 or 1: off */
    int64_t repeat_last_n;     /* history tokens the penalty looks at (0: the whole sequence) */
    uint64_t seed;             /* random seed of a sampled (temperature > 0) request */
    const char *const *stop;   /* [n_stop] stop strings (non-empty UTF-8): the output ends before one */
    size_t n_stop;
    bool ignore_eos;           /* end tokens do not end it (benchmarks) */
    /* Prefill/decode disaggregation (see strata_kv_reserve):
     * prefill_only: the prompt's KV is computed, nothing is sampled; the request ends
     *   (STOP, detail "eos" does not apply: completion_tokens 0) once the whole prompt is in the cache.
     * export_kv (with prefill_only): after each engine step, every layer of the full
     *   prompt blocks from export_from_block on that became computed goes to the
     *   callbacks' on_kv, in a buffer from their kv_buffer (block order per layer).
     * kv_ticket: the request waits, holding no KV, until that reservation is resolved
     *   (its blocks adopted: found as a prefix hit; or cancelled: the prompt is computed here). */
    bool prefill_only;
    bool export_kv;
    int64_t export_from_block;
    uint64_t kv_ticket;
} strata_request_params;

/* One layer of a run of blocks of a prompt (block i = tokens [i * kv_block_size, (i + 1) *
 * kv_block_size)): block k's part at data + k * kv_layer_bytes (K rows, V rows, fp8 scales). */
typedef struct {
    int64_t layer, first_block, n_blocks; /* n_blocks 0: the export failed (data is still handed over) */
    void *data;                           /* the callee's (from kv_buffer) */
    size_t bytes;                         /* n_blocks * kv_layer_bytes */
} strata_kv_piece;

/* A request's callbacks, called on the thread that steps the engine
 * (strata_step's caller, or the engine thread), or for an abort by
 * strata_stop / strata_model_free on their caller's thread. They must be
 * quick and must not call strata_step, strata_stop or strata_model_free
 * (strata_submit and strata_abort are fine). */
typedef struct {
    /* Each new piece of output text (complete UTF-8, len > 0, not NUL-terminated, valid during the
       call; end tokens and stop strings are not included). May be NULL. */
    void (*on_text)(void *user, const char *text, size_t len);
    /* Exactly once per accepted request, last; after it `user` is never used again. May be NULL. */
    void (*on_finish)(void *user, const strata_finish *fin);
    void *user;
    /* export_kv requests only: memory for one piece (NULL: the request ends with an error; called on
       the stepping thread before a pass), and the filled piece, which is the callee's from then on.
       on_kv runs on the engine's export thread while the pass still computes (layer l is handed over
       once its copy completed, as the next layers run), every piece of a step before that step ends;
       it must be quick and thread-safe. */
    void *(*kv_buffer)(void *user, size_t bytes);
    void (*on_kv)(void *user, const strata_kv_piece *piece);
} strata_callbacks;

/* Queues a request (everything copied). On success *id (> 0) names it and
 * on_finish will be called exactly once. Errors, with no callback ever
 * called: INVALID_ARG for a bad request (NULL pointers, no prompt or both
 * kinds, an empty prompt, a prompt of max_seq_len tokens or more, ids outside
 * the vocabulary, negative max_tokens, bad sampling parameters, empty stop
 * strings: the message names it) or a model without engine, NOMEM when the
 * waiting queue is full, UNSUPPORTED after strata_stop. Thread-safe. */
strata_status strata_submit(strata_model *m, const strata_request_params *params, const strata_callbacks *cb,
                            uint64_t *id);

/* Asks request `id` to end: at the start of the next step it leaves and gets
 * on_finish(STRATA_FINISH_ABORT). NOT_FOUND when no such request is pending
 * (unknown or already finished). Thread-safe; may be called from callbacks. */
strata_status strata_abort(strata_model *m, uint64_t id);

/* One engine step on the calling thread: admits queued requests, runs one
 * batched forward pass, samples, streams text and finishes requests (their
 * callbacks run here). *worked (may be NULL): whether there was anything to
 * do. A request's failure finishes it with STRATA_FINISH_ERROR; the step
 * itself fails only when misused: INVALID_ARG for NULL m, a model without
 * engine, or while the engine thread runs (strata_start). Call it from one
 * thread at a time. */
strata_status strata_step(strata_model *m, bool *worked);

/* Starts the engine thread, which steps while there is work and sleeps
 * otherwise (callbacks then run on it). INVALID_ARG when already started, after
 * strata_stop, or without engine. Not thread-safe against strata_step /
 * strata_stop. */
strata_status strata_start(strata_model *m);

/* Stops and joins the engine thread (the step in progress completes), then
 * finishes every pending request with STRATA_FINISH_ABORT on the calling
 * thread. After it strata_submit refuses (UNSUPPORTED): the engine cannot be
 * restarted. Safe when not started. INVALID_ARG for NULL m or a model
 * without engine. */
strata_status strata_stop(strata_model *m);

/* ==== prefill / decode disaggregation ============================================= */

/* A decode node's reservation for blocks a prefill node will push: the full
 * blocks of the prompt before its last token that neither its device nor its
 * host KV tier holds, as host-tier blocks the transfer writes into (or, with
 * kv_landing_mem, a run of slots of the landing memory). */
typedef struct {
    uint64_t ticket;          /* 0: nothing to receive (n_blocks 0) */
    int64_t n_tokens, block_tokens;
    int64_t cached_blocks;    /* leading full blocks held here already */
    int64_t n_blocks;         /* blocks [cached_blocks, cached_blocks + n_blocks) to receive */
    int64_t n_layers;
    size_t layer_bytes;
    void *const *blocks;      /* [n_blocks]: block k's layer l at blocks[k] + l * layer_bytes; valid until
                                 the ticket is resolved; NULL with a landing arena (kv_landing_mem):
                                 block k's layer l at landing + l * landing_stride + k * layer_bytes, in
                                 the engine's device memory (CUDA memory when its backend is "cuda") */
    void *landing;
    size_t landing_stride;
} strata_kv_reservation;

/* Queues a reservation for the prompt ids[0..n) (copied); fn runs on the
 * engine's stepping thread at its next step, with the reservation or an
 * error (NOMEM: the host tier, or the landing memory, cannot hold them now;
 * the message says so; res NULL). Errors now: INVALID_ARG (bad ids),
 * UNSUPPORTED (neither a KV host tier nor landing memory,
 * or the engine stopped). Thread-safe. */
strata_status strata_kv_reserve(strata_model *m, const int32_t *ids, size_t n,
                                void (*fn)(void *user, strata_status st, const strata_kv_reservation *res),
                                void *user);
/* Ends a reservation: adopt (every block landed, nothing writes them any
 * more: they go on to the device pool ahead of the admission) or cancel
 * (nothing writes them any more: given back; waiting requests compute their
 * prompt). Requests waiting for the ticket go on at the next step. Unknown
 * tickets are ignored. Thread-safe. */
strata_status strata_kv_resolve(strata_model *m, uint64_t ticket, bool adopt);

/* Host memory that device copies reach fastest (pinned on CUDA; plain on the
 * CPU backend), e.g. for the KV pieces of kv_buffer. NOMEM when it cannot be
 * had. strata_host_free(NULL) is a no-op. Thread-safe. */
strata_status strata_host_alloc(strata_model *m, size_t bytes, void **out);
void strata_host_free(strata_model *m, void *p);
/* The engine's device memory (CUDA memory on "cuda", plain host memory on
 * the CPU backend), counted in its device budget, e.g. for KV pieces sent
 * from the device. NOMEM when it cannot be had. strata_device_free(NULL) is a
 * no-op. Thread-safe. */
strata_status strata_device_alloc(strata_model *m, size_t bytes, void **out);
void strata_device_free(strata_model *m, void *p);

/* ==== metrics ===================================================================== */

/* A histogram with fixed upper bounds (Prometheus style): counts[i] holds the
 * observations in (bounds[i-1], bounds[i]] (not cumulative), counts[n_bounds]
 * those above the last bound (+Inf). */
#define STRATA_HIST_MAX 24
typedef struct {
    int n_bounds;
    double bounds[STRATA_HIST_MAX];
    int64_t counts[STRATA_HIST_MAX + 1];
    int64_t count;                    /* observations */
    double sum;                       /* their sum */
} strata_histogram;

/* A snapshot of the engine's counters (cumulative since it was built, but
 * for the gauges running, waiting and kv_blocks_used). */
typedef struct {
    int64_t running;                  /* sequences holding a slot */
    int64_t waiting;                  /* requests waiting for a slot */
    int64_t max_batch, max_seq_len;   /* the engine's limits (strata_engine_info) */
    int64_t requests_added;           /* accepted by strata_submit */
    int64_t requests_finished[STRATA_FINISH_COUNT]; /* by strata_finish_reason */
    int64_t prompt_tokens;            /* prompt tokens computed (prefilled: recomputes after a preemption
                                         count, prefix-cache hits do not) */
    int64_t generation_tokens;        /* tokens sampled */
    int64_t steps;                    /* steps that ran the model */
    int64_t step_tokens;              /* tokens those steps' forward passes ran (prompt chunks + decodes) */
    double step_seconds;              /* wall time of those steps (sampling and callbacks included; not
                                         the idle time between steps) */
    double forward_seconds;           /* of which in the forward passes (device sampling included) */
    /* decode-only steps (every sequence of the batch ran one token, no prompt
     * chunk): how many, their tokens (= sequences), the keys those sequences
     * attended over (context lengths summed over sequences and steps), and
     * their wall time */
    int64_t decode_steps, decode_tokens, decode_kv_tokens;
    double decode_seconds;
    int64_t preemptions;              /* sequences sent back to waiting when KV blocks ran out */
    /* the paged KV cache, in blocks of kv_block_size tokens: blocks held by
     * live sequences (shared prefix blocks count once) and the cache size */
    int64_t kv_block_size, kv_blocks_used, kv_blocks_total;
    /* prefix cache, in prompt tokens: looked up / found already computed (any tier), and the
     * hits by tier */
    int64_t prefix_cache_queries, prefix_cache_hits;
    int64_t prefix_cache_hits_device, prefix_cache_hits_host, prefix_cache_hits_ssd;
    /* KV blocks by tier and state: used (held by sequences / being copied or written), cached
     * (kept for prefix hits), free */
    int64_t kv_device_used, kv_device_cached, kv_device_free;
    int64_t kv_host_used, kv_host_cached, kv_host_free;
    int64_t kv_ssd_used, kv_ssd_cached, kv_ssd_free;
    /* bytes moved between the tiers, and swaps (preempted sequences whose KV came back from a
     * lower tier instead of being recomputed) */
    int64_t kv_bytes_device_to_host, kv_bytes_host_to_device, kv_bytes_host_to_ssd, kv_bytes_ssd_to_host;
    int64_t kv_swaps;
    int64_t spec_drafted, spec_accepted; /* speculative decoding: drafts verified / accepted */
    int64_t pd_adopted, pd_cancelled; /* P-D reservations adopted / cancelled */
    strata_histogram ttft;            /* seconds from strata_submit to the first sampled token */
    strata_histogram tbt;             /* seconds between consecutive sampled tokens of a request */
    strata_histogram e2e;             /* seconds from strata_submit to the end */
} strata_metrics;

/* Copies the engine's counters into *out (zeroed on failure). Errors:
 * INVALID_ARG for NULL arguments or a model without engine. Thread-safe (any
 * thread, any time, callbacks included). */
strata_status strata_metrics_get(strata_model *m, strata_metrics *out);

#ifdef __cplusplus
}
#endif
