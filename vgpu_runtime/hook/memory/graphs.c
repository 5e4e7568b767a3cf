/*
 * graphs.c: graph memory nodes, added by hand (cuGraphAddMemAllocNode) or captured from
 * cuMemAllocAsync. The driver takes their memory from the device's graph pool when the graph
 * is launched or uploaded, in no allocation call; pools.c measures the pool after each launch
 * (MEM_SET GM_MEM_GRAPH) but cannot refuse what has run.
 *
 * So each executable graph's need is read when it is instantiated: the sizes of its memory
 * nodes per device, child graphs included. A launch or upload whose need is more than the
 * graph pool holds now is checked with the daemon first, and refused with
 * CUDA_ERROR_OUT_OF_MEMORY when the container's other use plus that need passes the limit.
 * A need the pool already holds is launched unchecked (the pool reuses what it holds), so a
 * relaunch costs nothing; two graphs whose allocations outlive their launches at the same time
 * can still pass the limit together, and are then accounted (pools.c) and logged.
 *
 * The table of graphs with memory nodes is looked at only while it is not empty (one relaxed
 * load otherwise): graph launches without memory nodes take no lock and make no call.
 */
#include <stdlib.h>

#include "memory.h"

#define MAX_DEPTH 16   /* child graphs within child graphs */

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct need {
    CUgraphExec exec;
    uint64_t bytes[GM_MAX_GPUS];
} *needs;
static size_t count, capacity;
static _Atomic size_t needy;   /* = count, read without the lock */

/* Adds the memory nodes of `graph` (and its child graphs) to bytes[gpu]; -1 if unreadable. */
static int graph_need(CUgraph graph, uint64_t bytes[GM_MAX_GPUS], int depth) {
    if (depth > MAX_DEPTH) return -1;
    size_t n = 0;
    if (GM_REAL(cuGraphGetNodes)(graph, NULL, &n) != CUDA_SUCCESS) return -1;
    if (n == 0) return 0;
    CUgraphNode *nodes = malloc(n * sizeof *nodes);
    if (nodes == NULL) return -1;
    int rc = GM_REAL(cuGraphGetNodes)(graph, nodes, &n) == CUDA_SUCCESS ? 0 : -1;
    for (size_t i = 0; rc == 0 && i < n; i++) {
        CUgraphNodeType type;
        if (GM_REAL(cuGraphNodeGetType)(nodes[i], &type) != CUDA_SUCCESS) continue;
        if (type == CU_GRAPH_NODE_TYPE_MEM_ALLOC) {
            CUDA_MEM_ALLOC_NODE_PARAMS params;
            if (GM_REAL(cuGraphMemAllocNodeGetParams)(nodes[i], &params) != CUDA_SUCCESS) {
                rc = -1;
                break;
            }
            int gpu = gm_gpu_of_device(params.poolProps.location.id);
            if (gpu >= 0 && gpu < GM_MAX_GPUS) bytes[gpu] += params.bytesize;
        } else if (type == CU_GRAPH_NODE_TYPE_GRAPH) {
            CUgraph child;
            if (GM_REAL(cuGraphChildGraphNodeGetGraph)(nodes[i], &child) == CUDA_SUCCESS)
                rc = graph_need(child, bytes, depth + 1);
        }
    }
    free(nodes);
    return rc;
}

static void remember(CUgraphExec exec, const uint64_t bytes[GM_MAX_GPUS]) {
    pthread_mutex_lock(&lock);
    if (count == capacity) {
        size_t grown_capacity = capacity ? capacity * 2 : 16;
        struct need *grown = realloc(needs, grown_capacity * sizeof *needs);
        if (grown == NULL) {
            pthread_mutex_unlock(&lock);
            gm_warn("out of host memory to remember graph %p's memory nodes; its launches are "
                    "accounted after they run", (void *)exec);
            return;
        }
        needs = grown;
        capacity = grown_capacity;
    }
    needs[count].exec = exec;
    for (int gpu = 0; gpu < GM_MAX_GPUS; gpu++) needs[count].bytes[gpu] = bytes[gpu];
    count++;
    atomic_store_explicit(&needy, count, memory_order_relaxed);
    pthread_mutex_unlock(&lock);
}

static void forget(CUgraphExec exec) {
    if (atomic_load_explicit(&needy, memory_order_relaxed) == 0) return;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < count; i++) {
        if (needs[i].exec == exec) {
            needs[i] = needs[--count];
            break;
        }
    }
    atomic_store_explicit(&needy, count, memory_order_relaxed);
    pthread_mutex_unlock(&lock);
}

static CUresult instantiated(CUresult result, CUgraphExec *exec, CUgraph graph) {
    if (result != CUDA_SUCCESS || !gm_active() || exec == NULL) return result;
    uint64_t bytes[GM_MAX_GPUS] = {0};
    int any = 0;
    if (graph_need(graph, bytes, 0) < 0)
        gm_debug("graph %p: memory nodes unreadable; accounted after launch", (void *)graph);
    for (int gpu = 0; gpu < GM_MAX_GPUS; gpu++) any |= bytes[gpu] != 0;
    if (any) remember(*exec, bytes);
    return result;
}

CUresult gm_graph_memory_check(CUgraphExec exec) {
    if (atomic_load_explicit(&needy, memory_order_relaxed) == 0 || !gm_active())
        return CUDA_SUCCESS;
    uint64_t bytes[GM_MAX_GPUS] = {0};
    int found = 0;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < count && !found; i++) {
        if (needs[i].exec != exec) continue;
        found = 1;
        for (int gpu = 0; gpu < GM_MAX_GPUS; gpu++) bytes[gpu] = needs[i].bytes[gpu];
    }
    pthread_mutex_unlock(&lock);
    for (int gpu = 0; found && gpu < GM_MAX_GPUS; gpu++) {
        uint64_t held = gm_held_get((uint32_t)gpu, GM_MEM_GRAPH);
        if (bytes[gpu] <= held) continue;   /* the pool holds it already */
        uint64_t used = 0, limit = 0;
        gm_usage(gpu, &used, &limit);   /* the daemon's figures, else this process's own */
        uint64_t others = used > held ? used - held : 0;
        if (others + bytes[gpu] > limit || others + bytes[gpu] < others) {
            GM_COUNT(mem_refused, 1);
            gm_debug("graph %p needs %llu bytes of graph memory on gpu %d: refused", (void *)exec,
                     (unsigned long long)bytes[gpu], gpu);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    return CUDA_SUCCESS;
}

CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                            char *logBuffer, size_t bufferSize) {
    return instantiated(GM_REAL(cuGraphInstantiate)(phGraphExec, hGraph, phErrorNode, logBuffer,
                                                    bufferSize),
                        phGraphExec, hGraph);
}

CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                               char *logBuffer, size_t bufferSize) {
    return instantiated(GM_REAL(cuGraphInstantiate_v2)(phGraphExec, hGraph, phErrorNode,
                                                       logBuffer, bufferSize),
                        phGraphExec, hGraph);
}

CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                     unsigned long long flags) {
    return instantiated(GM_REAL(cuGraphInstantiateWithFlags)(phGraphExec, hGraph, flags),
                        phGraphExec, hGraph);
}

CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                      CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams) {
    return instantiated(
        GM_REAL(cuGraphInstantiateWithParams)(phGraphExec, hGraph, instantiateParams),
        phGraphExec, hGraph);
}

CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                           CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams) {
    return instantiated(
        GM_REAL(cuGraphInstantiateWithParams_ptsz)(phGraphExec, hGraph, instantiateParams),
        phGraphExec, hGraph);
}

CUresult cuGraphExecDestroy(CUgraphExec hGraphExec) {
    CUresult result = GM_REAL(cuGraphExecDestroy)(hGraphExec);
    if (result == CUDA_SUCCESS) forget(hGraphExec);
    return result;
}

/* An upload takes the graph's memory as its launch would. */
CUresult cuGraphUpload(CUgraphExec hGraphExec, CUstream hStream) {
    CUresult result = gm_graph_memory_check(hGraphExec);
    if (result != CUDA_SUCCESS) return result;
    result = GM_REAL(cuGraphUpload)(hGraphExec, hStream);
    if (result == CUDA_SUCCESS) gm_account_graph_memory(hStream, 0);
    return result;
}

CUresult cuGraphUpload_ptsz(CUgraphExec hGraphExec, CUstream hStream) {
    CUresult result = gm_graph_memory_check(hGraphExec);
    if (result != CUDA_SUCCESS) return result;
    result = GM_REAL(cuGraphUpload_ptsz)(hGraphExec, hStream);
    if (result == CUDA_SUCCESS) gm_account_graph_memory(hStream, 1);
    return result;
}

/* In a forked child: the parent's graphs are not the child's. */
static void graphs_after_fork(void) {
    pthread_mutex_init(&lock, NULL);
    count = 0;
    atomic_store(&needy, 0);
}
GM_AFTER_FORK(graphs_after_fork);
