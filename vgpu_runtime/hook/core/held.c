/*
 * held.c: the bytes this process holds, per GPU (index into the hello reply) per gm_mem_kind.
 * The channel changes it before it tells the daemon and re-declares it on every (re)connection,
 * so a restarted daemon loses nothing; the memory family and the counters read it.
 */
#include <string.h>

#include "hook.h"

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t held[GM_MAX_GPUS][GM_MEM_KIND_COUNT];

void gm_held_add(uint32_t gpu, uint32_t kind, int64_t delta) {
    if (gpu >= GM_MAX_GPUS || kind >= GM_MEM_KIND_COUNT) return;
    pthread_mutex_lock(&lock);
    if (delta < 0 && (uint64_t)(-delta) > held[gpu][kind]) held[gpu][kind] = 0;
    else held[gpu][kind] += (uint64_t)delta;
    pthread_mutex_unlock(&lock);
}

void gm_held_set(uint32_t gpu, uint32_t kind, uint64_t bytes) {
    if (gpu >= GM_MAX_GPUS || kind >= GM_MEM_KIND_COUNT) return;
    pthread_mutex_lock(&lock);
    held[gpu][kind] = bytes;
    pthread_mutex_unlock(&lock);
}

uint64_t gm_held_get(uint32_t gpu, uint32_t kind) {
    if (gpu >= GM_MAX_GPUS || kind >= GM_MEM_KIND_COUNT) return 0;
    pthread_mutex_lock(&lock);
    uint64_t bytes = held[gpu][kind];
    pthread_mutex_unlock(&lock);
    return bytes;
}

uint64_t gm_held_total(void) {
    uint64_t total = 0;
    pthread_mutex_lock(&lock);
    for (int g = 0; g < GM_MAX_GPUS; g++)
        for (int k = 0; k < GM_MEM_KIND_COUNT; k++) total += held[g][k];
    pthread_mutex_unlock(&lock);
    return total;
}

/* A forked child holds nothing: its parent's context is not usable there. */
void gm_held_reset(void) {
    pthread_mutex_init(&lock, NULL);
    memset(held, 0, sizeof held);
}
