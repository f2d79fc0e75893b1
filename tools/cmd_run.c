/* strata run MODEL [-p PROMPT | -f FILE] [options]: text in, text out.
 *
 * Through the public C API (strata.h): the serving engine with one request
 * at a time, stepped on this thread: one prompt (from -p, -f or a piped standard input) -> the
 * answer streamed to stdout (on_text), then one stats line on stderr (from
 * the request's finish info). With no prompt and a terminal on stdin: an
 * interactive chat; each turn sends the whole conversation again and the
 * engine's prefix cache serves the earlier turns' KV (only the new tokens
 * are prefilled). */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "strata.h"

#include "commands.h"
#include "common.h" /* the model options shared by the commands (tool_model_opts) */

#define DEF_N_PREDICT 256
#define DEF_TEMP 0.7
#define DEF_TOP_K 40
#define DEF_TOP_P 0.95
#define DEF_MIN_P 0.05
#define DEF_REPEAT_PENALTY 1.0
#define MAX_STOP 16

static void run_usage(FILE *f) {
    fprintf(f,
            "usage: strata run MODEL [-p PROMPT | -f FILE] [options]\n"
            "Generates text with a model (a Hugging Face directory with tokenizer.json, or a .gguf file)\n"
            "and streams it to standard output; a stats line goes to standard error.\n"
            "The prompt comes from -p, -f, or standard input when it is not a terminal. With no\n"
            "prompt and a terminal on standard input: an interactive chat (type /exit or Ctrl-D to\n"
            "quit, /reset to start over); each turn sends the whole conversation, whose earlier turns\n"
            "the prefix cache still holds (only the new tokens are prefilled); when the context is\n"
            "full the conversation starts over.\n\n"
            "  -p, --prompt TEXT       the prompt (in chat mode, trailing newlines of a prompt are dropped)\n"
            "  -f, --file FILE         read the prompt from FILE\n"
            "  -n, --n-predict N       generate at most N tokens (default %d; -1: until an end token\n"
            "                          or the context is full)\n"
            "  --chat / --no-chat      wrap the prompt in the model's chat template as a user message\n"
            "                          (default: --chat when the model has a chat template); with\n"
            "                          --no-chat the prompt is plain text, BOS added as the tokenizer says\n"
            "  --chat-template NAME    use this format instead of the model's template: chatml,\n"
            "                          llama3 or llama2 (needed when the model's template is not\n"
            "                          one of these)\n"
            "  --system TEXT           the system message (chat mode; default: the template's own,\n"
            "                          e.g. SmolLM2's, or none)\n"
            "  --temp T                temperature in [0, 2] (default %.2g; 0: greedy, deterministic)\n"
            "  --top-k K               keep the K most likely tokens (default %d; 0 or -1: off)\n"
            "  --top-p P               keep the smallest set holding probability P, in (0, 1] (default\n"
            "                          %.2g; 1: off)\n"
            "  --min-p P               drop tokens less likely than P x the top one, in [0, 1] (default\n"
            "                          %.2g; 0: off)\n"
            "  --repeat-penalty R      penalise tokens already seen (this answer's prompt tokens and\n"
            "                          its output so far), HF style, in (0, 2] (default %.1f: off)\n"
            "                          The model's own recommendations replace these defaults (not\n"
            "                          options given here): generation_config.json in a Hugging Face\n"
            "                          directory (temperature, top_p, top_k, min_p, repetition_penalty;\n"
            "                          do_sample false: greedy), general.sampling.* keys in a GGUF file;\n"
            "                          a line on stderr says which were taken\n"
            "  --repeat-last-n N       how many recent tokens the penalty looks at (default 0: all)\n"
            "  --seed S                random seed, an integer in [0, 2^53] (default, or -1: a new one\n"
            "                          each run, shown in the stats); ranges as strata serve's\n"
            "  --stop STR              stop when the output contains STR (not printed); repeatable\n"
            "                          (up to %d). The model's end tokens always stop it.\n"
            "  -q, --quiet             no loading line and no stats line\n"
            TOOL_MODEL_OPTS_HELP TOOL_KV_TIER_OPTS_HELP TOOL_KV_STREAM_OPT_HELP TOOL_SPEC_OPTS_HELP
            "\nStats line (stderr), one per answer:\n"
            "  prompt: P tokens in S s (R tok/s), generated: G tokens in S s (R tok/s), load: S s, stop: WHY[, seed: S][, cached: C]\n"
            "  [, drafts: A of D accepted] (speculative decoding)\n"
            "where P counts the prompt tokens computed (C more came from the prefix cache: the earlier\n"
            "turns of a chat), G every sampled token (an end token included), prompt time is the\n"
            "prefill up to the first token, generation time runs from there to the end, and WHY is\n"
            "eos, max_tokens, stop_string or context_full.\n",
            DEF_N_PREDICT, DEF_TEMP, DEF_TOP_K, DEF_TOP_P, DEF_MIN_P, DEF_REPEAT_PENALTY, MAX_STOP);
}

typedef struct {
    const char *model_path, *prompt, *prompt_file, *system, *chat_template;
    int chat; /* -1: auto, 0: no, 1: yes */
    int64_t n_predict;
    strata_request_params sp; /* the sampling fields: temperature .. seed */
    bool seed_given;
    /* sampling options given on the command line (the model's defaults do not replace them) */
    bool temp_given, top_k_given, top_p_given, min_p_given, rep_given;
    const char *stop[MAX_STOP];
    int n_stop;
    bool quiet;
    tool_model_opts mo;
} run_opts;

/* ---- a growable string --------------------------------------------------------------*/
typedef struct {
    char *p;
    size_t len, cap;
} strbuf;

static bool sb_add(strbuf *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t c = b->cap ? b->cap : 256;
        while (c < b->len + n + 1) c *= 2;
        char *np = realloc(b->p, c);
        if (!np) return false;
        b->p = np;
        b->cap = c;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
    return true;
}

static void sb_clear(strbuf *b) {
    b->len = 0;
    if (b->p) b->p[0] = '\0';
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Prints "strata CMD: <strata_last_error()>" to stderr. */
static void print_error(const char *cmd) {
    const char *msg = strata_last_error();
    fprintf(stderr, "strata %s: %s\n", cmd, msg && *msg ? msg : "failed");
}

static bool is_chat_format(const char *name) {
    return !strcmp(name, "chatml") || !strcmp(name, "llama3") || !strcmp(name, "llama2");
}

/* ---- options ----------------------------------------------------------------------------*/
/* 1: parsed, 0: --help shown, -1: usage error (message printed) */
static int parse_args(int argc, char **argv, run_opts *o) {
    memset(o, 0, sizeof *o);
    o->mo = (tool_model_opts)TOOL_ENGINE_OPTS_INIT;
    o->mo.spec_opts = true;
    o->chat = -1;
    o->n_predict = DEF_N_PREDICT;
    o->sp.temperature = (float)DEF_TEMP;
    o->sp.top_k = DEF_TOP_K;
    o->sp.top_p = (float)DEF_TOP_P;
    o->sp.min_p = (float)DEF_MIN_P;
    o->sp.repetition_penalty = (float)DEF_REPEAT_PENALTY;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        int r = tool_parse_model_opt(argc, argv, &i, &o->mo);
        if (r < 0) return -1;
        if (r > 0) continue;
        double d;
        int64_t v;
#define NEED_VALUE()                                                        \
    do {                                                                    \
        if (!val) {                                                         \
            fprintf(stderr, "strata run: %s needs a value\n", a);           \
            return -1;                                                      \
        }                                                                   \
        i++;                                                                \
    } while (0)
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            run_usage(stdout);
            return 0;
        } else if (!strcmp(a, "-p") || !strcmp(a, "--prompt")) {
            NEED_VALUE();
            o->prompt = val;
        } else if (!strcmp(a, "-f") || !strcmp(a, "--file")) {
            NEED_VALUE();
            o->prompt_file = val;
        } else if (!strcmp(a, "-n") || !strcmp(a, "--n-predict")) {
            if (!tool_parse_i64(val, -1, INT32_MAX, a, &v)) return -1;
            if (v == 0) {
                fprintf(stderr, "strata run: %s: 0 tokens; give N >= 1, or -1 for no limit\n", a);
                return -1;
            }
            o->n_predict = v;
            i++;
        } else if (!strcmp(a, "--chat")) {
            o->chat = 1;
        } else if (!strcmp(a, "--no-chat")) {
            o->chat = 0;
        } else if (!strcmp(a, "--chat-template")) {
            NEED_VALUE();
            if (!is_chat_format(val)) {
                fprintf(stderr, "strata run: --chat-template: '%s' is not one of chatml, llama3, llama2\n", val);
                return -1;
            }
            o->chat_template = val;
        } else if (!strcmp(a, "--system")) {
            NEED_VALUE();
            o->system = val;
        } else if (!strcmp(a, "--temp") || !strcmp(a, "--temperature")) {
            if (!tool_parse_f64(val, 0, STRATA_TEMPERATURE_MAX, a, &d)) return -1; /* as strata serve */
            o->sp.temperature = (float)d;
            o->temp_given = true;
            i++;
        } else if (!strcmp(a, "--top-k")) {
            if (!tool_parse_i64(val, -1, INT32_MAX, a, &v)) return -1; /* as strata serve: -1 is off too */
            o->sp.top_k = v < 0 ? 0 : (int32_t)v;
            o->top_k_given = true;
            i++;
        } else if (!strcmp(a, "--top-p")) {
            if (!tool_parse_f64(val, 0, 1, a, &d)) return -1;
            if (d <= 0) {
                fprintf(stderr, "strata run: --top-p: must be > 0 (1: off)\n");
                return -1;
            }
            o->sp.top_p = strata_sampling_float(d); /* as strata serve: 1e-300 is not 0 (off) */
            o->top_p_given = true;
            i++;
        } else if (!strcmp(a, "--min-p")) {
            if (!tool_parse_f64(val, 0, 1, a, &d)) return -1;
            o->sp.min_p = strata_sampling_float(d);
            o->min_p_given = true;
            i++;
        } else if (!strcmp(a, "--repeat-penalty")) {
            if (!tool_parse_f64(val, 0, STRATA_REPETITION_PENALTY_MAX, a, &d)) return -1; /* as strata serve */
            if (d <= 0) {
                fprintf(stderr, "strata run: --repeat-penalty: must be > 0 (1: off)\n");
                return -1;
            }
            o->sp.repetition_penalty = strata_sampling_float(d);
            o->rep_given = true;
            i++;
        } else if (!strcmp(a, "--repeat-last-n")) {
            if (!tool_parse_i64(val, 0, INT32_MAX, a, &v)) return -1;
            o->sp.repeat_last_n = v;
            i++;
        } else if (!strcmp(a, "--seed")) {
            /* as strata serve: -1 (a fresh one, as without --seed) or [0, 2^53] */
            if (!tool_parse_i64(val, -1, STRATA_SEED_MAX, a, &v)) return -1;
            o->sp.seed = v < 0 ? 0 : (uint64_t)v;
            o->seed_given = v >= 0;
            i++;
        } else if (!strcmp(a, "--stop")) {
            NEED_VALUE();
            if (!val[0]) {
                fprintf(stderr, "strata run: --stop: the stop string is empty\n");
                return -1;
            }
            if (o->n_stop == MAX_STOP) {
                fprintf(stderr, "strata run: --stop: at most %d stop strings\n", MAX_STOP);
                return -1;
            }
            o->stop[o->n_stop++] = val;
        } else if (!strcmp(a, "-q") || !strcmp(a, "--quiet")) {
            o->quiet = true;
        } else if (a[0] == '-' && a[1] != '\0') {
            fprintf(stderr, "strata run: unknown option '%s' (strata run --help lists them)\n", a);
            return -1;
        } else if (!o->model_path) {
            o->model_path = a;
        } else {
            fprintf(stderr, "strata run: unexpected argument '%s' (the prompt goes after -p)\n", a);
            return -1;
        }
#undef NEED_VALUE
    }
    if (!o->model_path) {
        fprintf(stderr, "strata run: no MODEL given\n");
        return -1;
    }
    if (!tool_spec_settle(&o->mo)) return -1;
    if (o->prompt && o->prompt_file) {
        fprintf(stderr, "strata run: give either -p or -f, not both\n");
        return -1;
    }
    if (o->chat == 0 && (o->system || o->chat_template)) {
        fprintf(stderr, "strata run: %s needs chat mode (drop --no-chat)\n",
                o->system ? "--system" : "--chat-template");
        return -1;
    }
    if (!o->seed_given) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        o->sp.seed = (((uint64_t)ts.tv_sec * 1000000007ull) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 40)) %
                     ((uint64_t)STRATA_SEED_MAX + 1); /* a value --seed takes again */
    }
    return 1;
}

/* ---- the model's limits and recommendations -------------------------------------------------*/
/* With the model's files open (no weights loaded yet): checks --ctx against
 * the positions the model was trained for, and takes its recommended sampling
 * settings for the options not given. 0: go on, 2: a usage error (messages
 * printed). */
static int precheck_model(run_opts *o, const strata_model *m, const strata_model_info *info) {
    const int64_t ctx = o->mo.ctx, trained = info->context_length;
    if (trained > 0 && ctx > trained) {
        /* linear scaling stretches positions by its factor (HF: max_position_embeddings is the
           unscaled length); llama3 scaling's max_position_embeddings is already the scaled one */
        const int64_t allowed = info->context_limit;
        if (ctx > allowed) {
            fprintf(stderr,
                    "strata run: --ctx %lld is more than the %lld positions %s was trained for "
                    "(max_position_embeddings%s); give --ctx %lld or less\n",
                    (long long)ctx, (long long)trained, o->model_path,
                    allowed > trained ? " with its RoPE scaling" : "", (long long)allowed);
            return 2;
        }
        fprintf(stderr,
                "strata run: warning: --ctx %lld is more than the %lld positions %s was trained for; "
                "its linear RoPE scaling (factor %g) allows up to %lld\n",
                (long long)ctx, (long long)trained, o->model_path, info->rope_linear_factor, (long long)allowed);
    }
    strata_sampling_defaults sd;
    if (strata_model_sampling_defaults(m, &sd) != STRATA_OK) {
        fprintf(stderr, "strata run: warning: the model's sampling settings are ignored: %s\n", strata_last_error());
        memset(&sd, 0, sizeof sd);
    }
    char took[256] = "";
    size_t n = 0;
#define TAKE(has, given, field, value, fmt, label)                                               \
    do {                                                                                         \
        if (sd.has && !o->given) {                                                               \
            o->sp.field = value;                                                                 \
            if (n < sizeof took)                                                                 \
                n += (size_t)snprintf(took + n, sizeof took - n, "%s" label " " fmt, n ? ", " : "", \
                                      sd.field);                                                 \
        }                                                                                        \
    } while (0)
    TAKE(has_temperature, temp_given, temperature, (float)sd.temperature, "%g", "temperature");
    TAKE(has_top_k, top_k_given, top_k, (int32_t)sd.top_k, "%" PRId64, "top-k");
    TAKE(has_top_p, top_p_given, top_p, strata_sampling_float(sd.top_p), "%g", "top-p");
    TAKE(has_min_p, min_p_given, min_p, strata_sampling_float(sd.min_p), "%g", "min-p");
    TAKE(has_repetition_penalty, rep_given, repetition_penalty, strata_sampling_float(sd.repetition_penalty), "%g",
         "repeat-penalty");
#undef TAKE
    if (took[0] && !o->quiet) fprintf(stderr, "strata: sampling from %s: %s\n", sd.source, took);
    return 0;
}

/* ---- the loaded model ---------------------------------------------------------------------*/
typedef struct {
    strata_model *m;      /* files, backend, tokenizer, chat format, engine (one sequence at a time,
                             stepped on this thread) */
    bool chat;            /* a chat format is in use (false: plain text) */
    const char *chat_name;
    int64_t n_ctx;        /* the engine's max_seq_len */
    double load_s;
    int64_t drafted, accepted; /* speculative decoding: the engine's counters before this answer */
} runner;

/* page-in progress on stderr: shown when paging in takes more than a second */
typedef struct {
    FILE *f;
    double t0, last;
    int last_pct;
    uint64_t total;
} page_progress;

static void on_page_in(void *user, uint64_t done, uint64_t total) {
    page_progress *p = user;
    p->total = total;
    double now = now_s();
    int pct = (int)(done * 100 / (total ? total : 1));
    if (now - p->t0 > 1.0 && now - p->last > 0.5 && pct != p->last_pct) {
        fprintf(p->f, "\rstrata: paging in %.1f MB of weights ... %d%%", total / 1e6, pct);
        fflush(p->f);
        p->last = now;
        p->last_pct = pct;
    }
}

/* Touches every page of the mapped model files, so that the first prefill is
 * not timed with the page faults of reading the weights. When this takes more
 * than a second, shows a percentage on `progress`. */
static void page_in(const runner *r, FILE *progress) {
    page_progress pp = {progress, now_s(), 0, -1, 0};
    pp.last = pp.t0;
    strata_model_page_in(r->m, progress ? on_page_in : NULL, &pp);
    if (pp.last_pct >= 0) fprintf(progress, "\rstrata: paging in %.1f MB of weights ... 100%%\n", pp.total / 1e6);
}

static void runner_close(runner *r) {
    strata_model_free(r->m);
    memset(r, 0, sizeof *r);
}

/* The tokenizer must not produce ids the model does not have. */
static bool check_vocab(const run_opts *o, const strata_model_info *info) {
    if (info->tokenizer_vocab_size > info->vocab_size) {
        fprintf(stderr, "strata run: %s: the tokenizer has %lld tokens, more than the model's vocabulary of %lld\n",
                o->model_path, (long long)info->tokenizer_vocab_size, (long long)info->vocab_size);
        return false;
    }
    return true; /* padded embedding rows beyond the tokenizer are never drawn */
}

/* Chooses the chat format: the model's template, --chat-template, or none. */
static bool settle_chat(const run_opts *o, runner *r) {
    r->chat = false;
    if (o->chat == 0) return strata_chat_set_template(r->m, "none") == STRATA_OK;
    const char *name = "none";
    strata_status dst = strata_chat_template(r->m, &name);
    if (o->chat_template) {
        /* a format other than the model's own: the model was not trained on it */
        if (dst == STRATA_OK && strcmp(name, "none") != 0 && strcmp(name, o->chat_template) != 0)
            fprintf(stderr,
                    "strata run: warning: --chat-template %s differs from the model's own template (%s); "
                    "expect poor answers\n",
                    o->chat_template, name);
        /* same family as the model's: its details (default system, date) kept */
        if (strata_chat_set_template(r->m, o->chat_template) != STRATA_OK) {
            print_error("run");
            return false;
        }
    } else if (dst != STRATA_OK) {
        fprintf(stderr,
                "strata run: %s: %s.\n"
                "Pass --no-chat to use the prompt as plain text, or --chat-template chatml|llama3|llama2 to "
                "choose a format.\n",
                o->model_path, strata_last_error());
        return false;
    } else if (!strcmp(name, "none")) {
        if (o->chat == 1) {
            fprintf(stderr, "strata run: %s has no chat template; pass --chat-template chatml|llama3|llama2 "
                            "or --no-chat\n", o->model_path);
                return false;
        }
        if (o->system) {
            fprintf(stderr, "strata run: --system: %s has no chat template (pass --chat-template NAME)\n",
                    o->model_path);
                return false;
        }
        return true; /* plain text */
    }
    strata_model_info info;
    if (strata_model_info_get(r->m, &info) != STRATA_OK) {
        print_error("run");
        return false;
    }
    if (info.chat_wants_date) {
        /* transformers gives such templates today's date, as strftime("%d %b %Y") */
        char buf[32];
        time_t now = time(NULL);
        struct tm tmv;
        if (localtime_r(&now, &tmv) && strftime(buf, sizeof buf, "%d %b %Y", &tmv))
            strata_chat_set_date(r->m, buf);
    }
    r->chat = true;
    r->chat_name = info.chat_template;
    return true;
}

/* Loads model + tokenizer, settles the chat format and builds the engine
 * (one sequence; KV pool of one context; prefix cache on). Prints errors. */
/* Loads the model; false on failure with *rc the exit status (messages printed). */
static bool runner_open(run_opts *o, runner *r, int *rc) {
    *rc = 1;
    memset(r, 0, sizeof *r);
    FILE *pg = o->quiet ? NULL : stderr;
    double t0 = now_s();
    if (pg) {
        fprintf(pg, "strata: loading %s ...\n", o->model_path);
        fflush(pg);
    }
    /* the context: --ctx, else the model's, at most 4096 (the API's default, as tools/common.h says) */
    const tool_model_opts *mo = &o->mo;
    strata_model_params mp = {
        .device = mo->device,
        .threads = mo->threads,
        .cpu_act = mo->cpu_act8 ? STRATA_CPU_ACT_INT8 : STRATA_CPU_ACT_PRECISE,
        .device_mem = mo->device_mem,
        .host_mem = mo->host_mem,
        .kv_dtype = mo->kv_dtype == ST_KV_FP8 ? STRATA_KV_FP8 : mo->kv_dtype == ST_KV_F32 ? STRATA_KV_F32 : STRATA_KV_BF16,
        .max_batch = 1,
        .max_seq_len = mo->ctx,
        .prefill_chunk = mo->batch > 0 ? mo->batch : 512, /* at most the context */
        .max_waiting = 1,
        .prefill = mo->prefill < 0 ? STRATA_PREFILL_PRECISE : mo->prefill > 0 ? STRATA_PREFILL_FAST : STRATA_PREFILL_AUTO,
        .ring_slots = mo->ring_slots,
        .cpu_layers = mo->cpu_layers,
        .cpu_split = mo->cpu_split,
        .cpu_max_tokens = mo->cpu_max_tokens,
        .cpu_pass_tokens = mo->cpu_pass_tokens,
        .h2d_gbps = mo->h2d_bw,
        .ssd_gbps = mo->ssd_bw,
        .kv_host_mem = mo->kv_host_mem,
        .kv_offload_lazy = mo->kv_offload_lazy,
        .kv_ssd_dir = mo->kv_ssd_dir,
        .kv_ssd_size = mo->kv_ssd_size,
        .kv_stream = mo->kv_stream,
        .kv_segment = mo->kv_segment,
        .kv_stream_mem = mo->kv_stream_mem,
        .kv_cpu_attn = mo->kv_cpu_attn,
        .spec = mo->spec,
        .spec_k = mo->spec_k,
        .spec_cost = mo->spec_cost,
        .draft_model = mo->draft,
    };
    tool_test_faults(mo, &mp); /* --test-fault (test builds) */
    if (strata_model_open(o->model_path, &mp, &r->m) != STRATA_OK) {
        print_error("load");
        return false;
    }
    double t_tok = now_s();
    strata_model_info info;
    if (strata_model_info_get(r->m, &info) != STRATA_OK) {
        print_error("run");
        runner_close(r);
        return false;
    }
    if ((*rc = precheck_model(o, r->m, &info)) != 0) {
        runner_close(r);
        return false;
    }
    *rc = 1;
    if (!settle_chat(o, r) || !check_vocab(o, &info)) {
        runner_close(r);
        return false;
    }
    if (strata_model_create_engine(r->m) != STRATA_OK || strata_model_info_get(r->m, &info) != STRATA_OK) {
        print_error("model");
        runner_close(r);
        return false;
    }
    double t_model = now_s();
    const bool cpu = !strcmp(info.backend, "cpu");
    if (cpu) page_in(r, pg);
    double t_end = now_s();
    r->load_s = t_end - t0;
    r->n_ctx = info.max_seq_len;
    if (pg)
        fprintf(pg, "strata: loaded in %.2f s (tokenizer %.2f s, model and engine %.2f s, paging in weights %.2f s; %s)\n",
                r->load_s, t_tok - t0, t_model - t_tok, t_end - t_model, cpu ? "cpu" : "cuda");
    return true;
}

/* ---- one answer ------------------------------------------------------------------------------*/
typedef struct {
    strbuf answer;
    bool finished;
    strata_finish fin;
    char error[512];
} out_state;

static void on_text(void *user, const char *t, size_t n) {
    out_state *s = user;
    fwrite(t, 1, n, stdout);
    fflush(stdout);
    sb_add(&s->answer, t, n);
}

static void on_finish(void *user, const strata_finish *f) {
    out_state *s = user;
    s->fin = *f;
    snprintf(s->error, sizeof s->error, "%s", f->error ? f->error : "");
    s->fin.error = NULL;
    s->finished = true;
}

/* The stats line from the request's finish info: the prompt part is the
 * tokens computed (the prefix cache's are not), timed up to the first token. */
static void print_stats(const run_opts *o, runner *r, const strata_finish *f) {
    strata_metrics mt;
    const bool spec = o->mo.spec != STRATA_SPEC_OFF && strata_metrics_get(r->m, &mt) == STRATA_OK;
    const int64_t drafted = spec ? mt.spec_drafted - r->drafted : 0, accepted = spec ? mt.spec_accepted - r->accepted : 0;
    if (spec) {
        r->drafted = mt.spec_drafted;
        r->accepted = mt.spec_accepted;
    }
    if (o->quiet) return;
    const int64_t computed = f->prompt_tokens - f->cached_tokens;
    const double prompt_s = f->ttft_s >= 0 ? f->ttft_s - f->queue_s : f->total_s - f->queue_s;
    const double gen_s = f->ttft_s >= 0 ? f->total_s - f->ttft_s : 0.0;
    fprintf(stderr,
            "prompt: %lld tokens in %.3f s (%.1f tok/s), generated: %lld tokens in %.3f s (%.1f tok/s), "
            "load: %.3f s, stop: %s",
            (long long)computed, prompt_s, prompt_s > 0 ? computed / prompt_s : 0.0, (long long)f->completion_tokens,
            gen_s, gen_s > 0 ? f->completion_tokens / gen_s : 0.0, r->load_s, f->detail);
    if (o->sp.temperature > 0) fprintf(stderr, ", seed: %llu", (unsigned long long)o->sp.seed);
    if (f->cached_tokens > 0) fprintf(stderr, ", cached: %lld", (long long)f->cached_tokens);
    if (spec) fprintf(stderr, ", drafts: %lld of %lld accepted", (long long)accepted, (long long)drafted);
    fputc('\n', stderr);
}

/* text -> *ids (malloc'd, the caller frees; NULL when *n is 0), control
 * token strings parsed. Prints errors. */
static bool encode(const runner *r, const char *text, bool add_special, int32_t **ids, int64_t *n) {
    size_t got = 0;
    if (strata_tokenize_alloc(r->m, text, add_special, true, ids, &got) != STRATA_OK) {
        print_error("run");
        return false;
    }
    *n = (int64_t)got;
    return true;
}

/* The chat format applied to msgs, tokenized: control tokens only from the
 * template, the contents as plain text (strata_chat_tokenize) -> *ids
 * (malloc'd, the caller frees). Prints errors. */
static bool chat_encode(const runner *r, const char *const *roles, const char *const *contents, size_t n,
                        int32_t **ids, int64_t *n_ids) {
    *ids = NULL;
    *n_ids = 0;
    size_t cap = 64, got = 0;
    for (size_t i = 0; i < n; i++) cap += strlen(roles[i]) + strlen(contents[i]) + 64;
    for (int tries = 0; tries < 2; tries++) {
        int32_t *buf = malloc(cap * sizeof *buf);
        if (!buf) {
            fprintf(stderr, "strata run: out of memory\n");
            return false;
        }
        strata_status st = strata_chat_tokenize(r->m, roles, contents, n, true, buf, cap, &got);
        if (st == STRATA_OK) {
            *ids = buf;
            *n_ids = (int64_t)got;
            return true;
        }
        free(buf);
        if (st != STRATA_ERR_NOMEM || got <= cap) break;
        cap = got;
    }
    print_error("run");
    return false;
}

/* Runs ids[0..n) as one request through the engine (stepped here until it
 * finishes); streams; stats. */
static bool answer(const run_opts *o, runner *r, const int32_t *ids, int64_t n, out_state *os) {
    strata_request_params rq = o->sp;
    rq.prompt_ids = ids;
    rq.n_prompt_ids = (size_t)n;
    rq.max_tokens = o->n_predict > 0 ? o->n_predict : 0;
    rq.stop = o->stop;
    rq.n_stop = (size_t)o->n_stop;
    const strata_callbacks cb = {.on_text = on_text, .on_finish = on_finish, .user = os};
    sb_clear(&os->answer);
    os->finished = false;
    uint64_t id;
    if (strata_submit(r->m, &rq, &cb, &id) != STRATA_OK) {
        print_error("run");
        return false;
    }
    bool worked = true;
    while (!os->finished && worked)
        if (strata_step(r->m, &worked) != STRATA_OK) {
            print_error("run");
            return false;
        }
    if (os->answer.len > 0 && os->answer.p[os->answer.len - 1] != '\n') fputc('\n', stdout);
    fflush(stdout);
    if (!os->finished || os->fin.reason == STRATA_FINISH_ERROR || os->fin.reason == STRATA_FINISH_ABORT) {
        fprintf(stderr, "strata run: %s\n", !os->finished ? "the request did not finish"
                                             : os->fin.reason == STRATA_FINISH_ERROR ? os->error : "aborted");
        return false;
    }
    print_stats(o, r, &os->fin);
    return true;
}

static char *read_stream(FILE *f) {
    strbuf b = {0};
    char chunk[65536];
    size_t k;
    while ((k = fread(chunk, 1, sizeof chunk, f)) > 0)
        if (!sb_add(&b, chunk, k)) {
            free(b.p);
            return NULL;
        }
    if (ferror(f)) {
        free(b.p);
        return NULL;
    }
    if (!b.p) b.p = calloc(1, 1);
    return b.p;
}

static void chop_newlines(char *s) {
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == '\n' || s[n - 1] == '\r')) s[--n] = '\0';
}

/* One prompt -> one answer. */
static int run_once(const run_opts *o, runner *r, char *prompt) {
    int32_t *ids = NULL;
    int64_t n = 0;
    bool ok;
    if (r->chat) {
        chop_newlines(prompt);
        const char *roles[2], *contents[2];
        size_t nm = 0;
        if (o->system) roles[nm] = "system", contents[nm++] = o->system;
        roles[nm] = "user", contents[nm++] = prompt;
        ok = chat_encode(r, roles, contents, nm, &ids, &n); /* the template holds BOS where it wants one */
    } else {
        ok = encode(r, prompt, true, &ids, &n);
    }
    if (!ok) return 1;
    if (n == 0) {
        fprintf(stderr, "strata run: the prompt is empty\n");
        return 1;
    }
    if (n >= r->n_ctx) {
        fprintf(stderr, "strata run: the prompt has %lld tokens; the context holds %lld (--ctx)\n", (long long)n,
                (long long)r->n_ctx);
        free(ids);
        return 1;
    }
    out_state os = {0};
    ok = answer(o, r, ids, n, &os);
    free(os.answer.p);
    free(ids);
    return ok ? 0 : 1;
}

/* ---- interactive chat ----------------------------------------------------------------------------*/
typedef struct {
    const char **roles; /* static strings */
    char **contents;    /* owned copies */
    int64_t n, cap;
} conv;

static bool conv_add(conv *c, const char *role, const char *content) {
    if (c->n == c->cap) {
        int64_t cap = c->cap ? c->cap * 2 : 16;
        const char **nr = realloc(c->roles, (size_t)cap * sizeof *nr);
        if (!nr) return false;
        c->roles = nr;
        char **nc = realloc(c->contents, (size_t)cap * sizeof *nc);
        if (!nc) return false;
        c->contents = nc;
        c->cap = cap;
    }
    char *copy = strdup(content);
    if (!copy) return false;
    c->roles[c->n] = role;
    c->contents[c->n++] = copy;
    return true;
}

/* Drops everything but the system message (index 0 when there is one). */
static void conv_reset(conv *c, bool keep_system) {
    int64_t keep = keep_system && c->n > 0 && !strcmp(c->roles[0], "system") ? 1 : 0;
    for (int64_t i = keep; i < c->n; i++) free(c->contents[i]);
    c->n = keep;
}

static int run_interactive(const run_opts *o, runner *r) {
    conv c = {0};
    if (o->system && !conv_add(&c, "system", o->system)) return 1;
    strbuf plain = {0};     /* plain text mode: the conversation so far */
    char *line = NULL;
    size_t line_cap = 0;
    out_state os = {0};
    int rc = 0;
    fprintf(stderr, "strata: chat with %s (%s, context %lld tokens). /exit or Ctrl-D quits, /reset starts over.\n",
            o->model_path, !r->chat ? "plain text, no chat template" : r->chat_name,
            (long long)r->n_ctx);
    for (;;) {
        fputs("> ", stdout);
        fflush(stdout);
        ssize_t got = getline(&line, &line_cap, stdin);
        if (got < 0) {
            fputc('\n', stdout);
            break;
        }
        chop_newlines(line);
        if (!strcmp(line, "/exit") || !strcmp(line, "/quit")) break;
        if (!strcmp(line, "/reset")) {
            conv_reset(&c, true);
            sb_clear(&plain);
            fprintf(stderr, "strata: conversation cleared\n");
            continue;
        }
        if (!line[0]) continue;

        /* the whole conversation with this question; the engine's prefix
         * cache holds the earlier turns' KV */
        int32_t *ids = NULL;
        int64_t n = 0;
        bool fresh = false; /* the conversation was started over for this turn */
        for (;;) {
            if (r->chat) {
                if (!conv_add(&c, "user", line)) { rc = 1; break; }
                /* a template holds BOS where it wants one */
                if (!chat_encode(r, c.roles, (const char *const *)c.contents, (size_t)c.n, &ids, &n)) {
                    free(c.contents[--c.n]);
                    break;
                }
            } else {
                strbuf b = {0};
                if (!sb_add(&b, plain.p ? plain.p : "", plain.len) || !sb_add(&b, line, strlen(line)) ||
                    !sb_add(&b, "\n", 1)) { free(b.p); rc = 1; break; }
                /* plain text: BOS as the tokenizer says */
                bool ok = encode(r, b.p, true, &ids, &n);
                free(b.p);
                if (!ok) { rc = 1; break; }
            }
            const int64_t reserve = o->n_predict > 0 && o->n_predict < r->n_ctx / 4 ? o->n_predict : r->n_ctx / 4;
            const bool has_history = !r->chat ? plain.len > 0 : c.n > 1 + (o->system != NULL);
            if (n + reserve <= r->n_ctx || !has_history || fresh) break;
            /* too long: keep the system message and this question */
            fprintf(stderr, "strata: the context is full (%lld + %lld tokens of %lld): starting a new conversation\n",
                    (long long)n, (long long)reserve, (long long)r->n_ctx);
            free(ids);
            ids = NULL;
            conv_reset(&c, true);
            sb_clear(&plain);
            fresh = true;
        }
        if (rc) break;
        if (!ids) continue;
        if (n >= r->n_ctx) {
            fprintf(stderr, "strata run: this message needs %lld tokens; the context holds %lld (--ctx)\n",
                    (long long)n, (long long)r->n_ctx);
            free(ids);
            conv_reset(&c, true);
            sb_clear(&plain);
            continue;
        }
        bool ok = n > 0 && answer(o, r, ids, n, &os);
        free(ids);
        if (!ok) {
            if (r->chat) free(c.contents[--c.n]);
            continue;
        }
        if (r->chat) {
            if (!conv_add(&c, "assistant", os.answer.p ? os.answer.p : "")) {
                rc = 1;
                break;
            }
        } else if (!sb_add(&plain, line, strlen(line)) || !sb_add(&plain, "\n", 1) ||
                   !sb_add(&plain, os.answer.p ? os.answer.p : "", os.answer.len)) {
            rc = 1;
            break;
        }
    }
    conv_reset(&c, false);
    free(c.roles);
    free(c.contents);
    free(line);
    free(plain.p);
    free(os.answer.p);
    return rc;
}

int cmd_run(int argc, char **argv) {
    run_opts o;
    int pr = parse_args(argc, argv, &o);
    if (pr <= 0) {
        if (pr < 0) fprintf(stderr, "usage: strata run MODEL [-p PROMPT | -f FILE] [options]  (--help for more)\n");
        return pr < 0 ? 2 : 0;
    }
    /* read the prompt before loading, so a bad -f fails fast */
    char *prompt = NULL;
    bool interactive = false;
    if (o.prompt) {
        prompt = strdup(o.prompt);
    } else if (o.prompt_file) {
        FILE *f = fopen(o.prompt_file, "rb");
        if (!f) {
            fprintf(stderr, "strata run: %s: cannot open: %s\n", o.prompt_file, strerror(errno));
            return 1;
        }
        prompt = read_stream(f);
        fclose(f);
        if (!prompt) {
            fprintf(stderr, "strata run: %s: read error\n", o.prompt_file);
            return 1;
        }
    } else if (isatty(STDIN_FILENO)) {
        interactive = true;
    } else {
        prompt = read_stream(stdin);
        if (!prompt) {
            fprintf(stderr, "strata run: cannot read the prompt from standard input\n");
            return 1;
        }
    }
    if (!interactive && !prompt) {
        fprintf(stderr, "strata run: out of memory\n");
        return 1;
    }
    runner r;
    int orc = 1;
    if (!runner_open(&o, &r, &orc)) {
        free(prompt);
        return orc;
    }
    int rc = interactive ? run_interactive(&o, &r) : run_once(&o, &r, prompt);
    runner_close(&r);
    free(prompt);
    return rc;
}
