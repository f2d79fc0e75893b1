/* strata public C API: status codes, log callback, version.
 * Everything else is reached through the module headers for now; handles are
 * opaque and owned by whoever called their *_init / *_load function. */
#pragma once
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

#ifdef __cplusplus
}
#endif
