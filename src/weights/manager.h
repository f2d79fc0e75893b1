/* weights/manager: the weight streaming runtime.
 *
 * Given a placement (plan.h), the manager makes each group's tensors
 * available on the device when the forward pass asks for them:
 *
 *   st_wm_acquire(wm, group, &view)      view.data[i]: device pointer of tensor i
 *   if (view.ready) stream_wait_event(compute, view.ready)
 *   ... ops on the compute stream ...
 *   if (view.done) event_record(view.done, compute)
 *   st_wm_release(wm, group, view.done)
 *
 * DEVICE groups: resident, read in place; acquire takes no lock and returns
 * no events. On the CPU backend with an unlimited device (device_mem 0) they
 * are the file mapping itself (zero copy, as before streaming existed);
 * otherwise each is one device block filled at init.
 *
 * Streamed groups (HOST and SSD) pass through a ring of `ring_slots` device
 * slots in the cyclic order of the forward pass (the order wraps from the
 * output group of one step to the first layer of the next). Sequence number
 * k (k = 0, 1, ... over all steps) is group order[k % n_streamed] in slot
 * k % ring_slots. Two threads keep the ring ahead of the compute stream:
 *
 *   reader   decides each sequence's source (the host tier if that group is
 *            pinned by now, else the file) and, for file reads, submits the
 *            group's aligned extents in staging-sized pieces to io_uring
 *            (up to queue_depth in flight) into a ring of pinned staging
 *            chunks; it runs ahead of the copier by up to the staging size;
 *   copier   owns the copy stream (high priority): for sequence k it waits
 *            (host side) until the compute thread released sequence
 *            k - ring_slots, makes the copy stream wait on that release's
 *            compute-done event (device side), copies the group into the
 *            slot (from the host tier, or piece by piece from staging as the
 *            reads land) and records the slot's ready event.
 *
 * The compute thread never waits for the device: acquire waits only until
 * the copier has *enqueued* the group's copies (for a file group that means
 * its bytes have been read), and every device-side ordering goes through
 * events. On the CPU backend the copies are memcpys done by the copier
 * thread and events are complete when recorded; the same ordering rules make
 * that correct (a slot is overwritten only after the release of the group
 * that used it, which on CPU follows its ops).
 *
 * Acquiring out of order is allowed: sequences between the expected one and
 * the requested one are skipped (a forward pass that skips the output group,
 * or one that failed midway); what was prefetched for them is dropped.
 *
 * The host tier is pinned and filled by a third thread, in the order the
 * groups are first needed, while the model already runs (groups not yet
 * pinned are read from the file meanwhile); progress goes to the log.
 *
 * Errors on the worker threads (an I/O error, a short read, a file changed
 * underneath, a device call failing) are sticky: the failing call and every
 * later acquire return that status with its message; nothing hangs and no
 * group is handed out with wrong bytes.
 *
 * One compute thread drives a manager (acquire/release/embed are not
 * reentrant) and holds at most one streamed group at a time. */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "backend/backend.h"
#include "weights/groups.h"
#include "weights/plan.h"
#include "weights/ssd.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef struct st_wm st_wm;

typedef struct {
    size_t host_mem;       /* pinned host cap (the plan's host_mem) */
    int queue_depth;       /* reads in flight (0: the number of staging chunks) */
    bool use_pread;        /* skip io_uring */
    bool no_direct;        /* read through the page cache */
    bool pin_sync;         /* fill the host tier before st_wm_init returns */
    int pin_delay_ms;      /* test hook: pause before pinning each host group */
    st_ssd_faults faults;  /* test hooks: injected read errors */
} st_wm_params;
/* Ring slots, staging and the embedding rows buffer (max_batch = the plan's
 * prefill_chunk) are sized by the plan. */

typedef struct {
    const void *data[ST_WG_MAX_TENSORS]; /* device pointers, in role order */
    st_event *ready; /* the compute stream waits on it before using data (NULL: resident) */
    st_event *done;  /* record it on the compute stream after the ops (NULL: resident) */
} st_wm_view;

/* Counters since init. Groups are counted when acquired (used), so that
 * per-step figures are exact; the reader's own counters include what it
 * read ahead. */
typedef struct {
    uint64_t seq_ssd;          /* streamed groups used, served from the file */
    uint64_t seq_host;         /* ... from the host tier */
    uint64_t seq_skipped;      /* prefetched or expected, then skipped */
    uint64_t ssd_group_bytes;  /* image bytes of the groups used that came from the file */
    uint64_t ssd_read_bytes;   /* bytes requested from the files by the reader (incl. read-ahead) */
    uint64_t ssd_reads;
    uint64_t h2d_bytes;        /* tensor bytes of the groups used that were copied into ring slots */
    uint64_t copied;           /* sequences the copier copied into ring slots (incl. ahead of their use) */
    uint64_t gather_bytes;     /* embedding rows copied */
    uint64_t seq_cpu;          /* CPU-tier groups handed out in host memory (st_wm_acquire_host) */
    uint64_t cpu_bytes;        /* their tensor bytes */
    double cpu_wait_s;         /* their executor's time waiting for the device's work before each (st_wm_note_cpu) */
    double cpu_compute_s;      /* ... and computing them */
    double acquire_wait_s;     /* compute thread time blocked in acquire */
    uint64_t pinned_bytes;     /* host tier filled so far (image bytes) */
    uint64_t pin_total_bytes;
    int pinned_groups, pin_total_groups;
    bool pin_done;
    double pin_seconds;
    size_t host_used, host_peak; /* pinned host memory (staging + host tier + embedding rows) */
    bool uring, direct;
} st_wm_stats;

/* Builds the manager for `plan` (copied) over `groups` (borrowed, as are be
 * and files; all must outlive it): allocates resident blocks and ring slots
 * on the device (counted in be->device_budget), staging and the embedding
 * rows in pinned memory (counted against params->host_mem), loads the
 * resident groups, and starts the threads. The caller owns *out. */
strata_status st_wm_init(st_backend *be, const st_model_files *files, const st_wgroups *groups,
                         const st_wplan *plan, const st_wm_params *params, st_wm **out);
/* Stops the threads (reads in flight complete first), frees everything. */
void st_wm_free(st_wm *wm); /* NULL is a no-op */

/* At the start of a forward pass: a sticky error, or a model file that
 * changed since it was opened, is returned here. */
strata_status st_wm_begin(st_wm *wm);

strata_status st_wm_acquire(st_wm *wm, int group, st_wm_view *out);
/* `done`: view.done after recording it (NULL for a resident group). A
 * streamed group released with done == NULL (its ops could not be ordered)
 * fails the manager. */
strata_status st_wm_release(st_wm *wm, int group, st_event *done);

/* CPU tier (plan.h ST_TIER_CPU): groups pinned like the host tier (the file
 * mapping until pinned). While stream_cpu is off (the default: decode) they
 * are not in the streamed order at all: the compute thread takes them in
 * host memory with st_wm_acquire_host (nothing to release: the bytes stay
 * put), and the ring's look-ahead (ring_slots sequences) holds only groups
 * the device computes, so the copier fills it while the CPU computes. While
 * on (prefill), the order holds every non-resident group and CPU-tier groups
 * are copied into ring slots and acquired like host-tier groups. Switching
 * is allowed between passes (no group held): when the order changes, what
 * the reader and the copier prepared for the old one is skipped (up to the
 * look-ahead's bytes copied in vain). */
void st_wm_stream_cpu(st_wm *wm, bool on);
/* data[i] = host pointer of tensor i of CPU-tier group `group` (role order). */
strata_status st_wm_acquire_host(st_wm *wm, int group, const void **data);
/* The executor of a CPU-tier group reports how long it waited for the
 * device's work before it and how long it computed (into the stats). */
void st_wm_note_cpu(st_wm *wm, double wait_s, double compute_s);

/* The embedding rows of host token ids tokens[0..n) (validated by the
 * caller, n <= max_batch) as a weight for get_rows on stream s: when the
 * table is resident, *w is the table and *ids NULL (index it by token id);
 * otherwise the rows are gathered from the file mapping into pinned staging,
 * copied on `s` into a device buffer, and *ids is [0, n) on the device. */
strata_status st_wm_embed(st_wm *wm, st_stream *s, const int32_t *tokens, int64_t n, st_weight *w,
                          const int32_t **ids);

/* Blocks until the host tier is filled (tests, benchmarks). */
strata_status st_wm_wait_pinned(st_wm *wm);
void st_wm_stats_get(st_wm *wm, st_wm_stats *out);
const st_wplan *st_wm_plan(const st_wm *wm);
/* Streamed group count (0: everything resident). */
int st_wm_streamed(const st_wm *wm);
/* Every group resident and the embedding table too: acquire/embed enqueue
 * nothing and return fixed pointers (a step can be recorded as a graph). */
bool st_wm_all_resident(const st_wm *wm);

#ifdef __cplusplus
}
#endif
