/* Graphs of the CUDA backend (backend.h graph_*): stream capture into a CUDA
 * graph, instantiated once and replayed.
 *
 * graph_begin starts a capture of the stream in thread-local mode: a call of
 * this thread that is not allowed inside a capture (a host sync such as the
 * one st_cuda_scratch does when a buffer grows, cudaMalloc, ...) fails, the
 * capture is invalidated, and graph_end reports it, so the caller can drop the
 * recording and run the ops eagerly (nothing ran while recording). The legacy
 * default stream (a NULL st_stream) cannot be captured.
 *
 * A replay reads the device and pinned host buffers the recorded ops were
 * given, with the values they hold when the replay runs; every pointer, size
 * and launch configuration is the one of the recording. */
#include "backend/cuda/cuda_internal.h"

#define GRAPH_MAGIC 0x43475248u /* "CGRH" */

typedef struct {
    uint32_t magic;
    cudaGraphExec_t exec;
} cuda_graph;

strata_status st_cuda_graph_begin(st_backend *be, st_stream *s) {
    st_cuda_stream *cs = st_cuda_stream_get(be, s);
    if (!cs->owned)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda graph_begin: the default stream cannot be recorded");
    ST_CUDA_TRY(cudaSetDevice(st_cuda_of(be)->device));
    ST_CUDA_TRY(cudaStreamBeginCapture(cs->s, cudaStreamCaptureModeThreadLocal));
    return STRATA_OK;
}

strata_status st_cuda_graph_end(st_backend *be, st_stream *s, st_graph **out) {
    if (out) *out = NULL;
    st_cuda_stream *cs = st_cuda_stream_get(be, s);
    cudaGraph_t graph = NULL;
    cudaError_t e = cudaStreamEndCapture(cs->s, &graph);
    if (e != cudaSuccess || !graph) {
        (void)cudaGetLastError(); /* clears the error an invalidated capture leaves */
        if (graph) cudaGraphDestroy(graph);
        if (!out) return STRATA_OK; /* dropping a failed recording is what was asked */
        return st_err(STRATA_ERR_BACKEND, "cudaStreamEndCapture failed: %s at %s:%d in %s (an op that "
                      "cannot be recorded ran while recording)", cudaGetErrorString(e), __FILE__, __LINE__,
                      __func__);
    }
    if (!out) {
        ST_CUDA_TRY(cudaGraphDestroy(graph));
        return STRATA_OK;
    }
    cuda_graph *g = st_calloc(1, sizeof *g);
    if (!g) {
        cudaGraphDestroy(graph);
        return st_err(STRATA_ERR_NOMEM, "cuda graph_end: out of memory for the graph's record (%zu bytes)", sizeof *g);
    }
    e = cudaGraphInstantiate(&g->exec, graph, 0);
    cudaError_t e2 = cudaGraphDestroy(graph); /* the executable graph is independent of it */
    if (e != cudaSuccess || e2 != cudaSuccess) {
        if (e == cudaSuccess) cudaGraphExecDestroy(g->exec);
        st_free(g);
        return st_err(STRATA_ERR_BACKEND, "cudaGraphInstantiate / cudaGraphDestroy failed: %s at %s:%d in %s",
                      cudaGetErrorString(e != cudaSuccess ? e : e2), __FILE__, __LINE__, __func__);
    }
    g->magic = GRAPH_MAGIC;
    *out = (st_graph *)g;
    return STRATA_OK;
}

strata_status st_cuda_graph_launch(st_backend *be, st_stream *s, st_graph *graph) {
    if (!graph) return st_err(STRATA_ERR_INVALID_ARG, "cuda graph_launch: graph is NULL");
    cuda_graph *g = (cuda_graph *)graph;
    ST_ASSERT(g->magic == GRAPH_MAGIC);
    ST_CUDA_TRY(cudaSetDevice(st_cuda_of(be)->device));
    ST_CUDA_TRY(cudaGraphLaunch(g->exec, st_cuda_stream_get(be, s)->s));
    return STRATA_OK;
}

void st_cuda_graph_destroy(st_backend *be, st_graph *graph) {
    if (!graph) return;
    cuda_graph *g = (cuda_graph *)graph;
    ST_ASSERT(g->magic == GRAPH_MAGIC);
    ST_CUDA_LOG(cudaSetDevice(st_cuda_of(be)->device));
    ST_CUDA_LOG(cudaGraphExecDestroy(g->exec));
    g->magic = 0;
    st_free(g);
}
