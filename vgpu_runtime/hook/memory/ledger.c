/*
 * ledger.c: what each allocation booked, so its free releases exactly that: a small
 * open-addressing table, allocation key -> (bytes, kind, gpu). Keys are device pointers, VMM
 * handles or array handles; the kind is part of the key, so a pointer and a handle with the
 * same value never collide. (The bytes held per GPU, which the channel re-declares, are in
 * core/held.c.)
 */
#include <stdlib.h>
#include <string.h>

#include "hook.h"

struct slot {
    uint64_t key;     /* 0: empty */
    uint64_t bytes;
    uint32_t kind;
    uint32_t gpu;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct slot *table;
static size_t capacity, used;   /* capacity: a power of two, or 0 */

static size_t home(uint64_t key, uint32_t kind) {
    uint64_t h = (key ^ ((uint64_t)kind << 56)) * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 17) & (capacity - 1);
}

static int grow(void) {
    size_t old_capacity = capacity;
    struct slot *old = table;
    size_t new_capacity = capacity ? capacity * 2 : 256;
    struct slot *fresh = calloc(new_capacity, sizeof *fresh);
    if (fresh == NULL) return -1;
    table = fresh;
    capacity = new_capacity;
    used = 0;
    for (size_t i = 0; i < old_capacity; i++) {
        if (old[i].key == 0) continue;
        size_t at = home(old[i].key, old[i].kind);
        while (table[at].key != 0) at = (at + 1) & (capacity - 1);
        table[at] = old[i];
        used++;
    }
    free(old);
    return 0;
}

void gm_ledger_put(uint64_t key, uint64_t bytes, uint32_t kind, uint32_t gpu) {
    pthread_mutex_lock(&lock);
    if ((used + 1) * 4 > capacity * 3 && grow() < 0) {
        pthread_mutex_unlock(&lock);
        gm_warn("out of host memory for the allocation table; a free of %llx will not be "
                "released to the daemon until exit", (unsigned long long)key);
        return;
    }
    size_t at = home(key, kind);
    while (table[at].key != 0 && !(table[at].key == key && table[at].kind == kind))
        at = (at + 1) & (capacity - 1);
    if (table[at].key == 0) used++;
    table[at] = (struct slot){key, bytes, kind, gpu};
    pthread_mutex_unlock(&lock);
}

int gm_ledger_take(uint64_t key, uint64_t *bytes, uint32_t *kind, uint32_t *gpu) {
    int found = 0;
    pthread_mutex_lock(&lock);
    if (capacity != 0) {
        size_t at = home(key, *kind);
        while (table[at].key != 0 && !(table[at].key == key && table[at].kind == *kind))
            at = (at + 1) & (capacity - 1);
        if (table[at].key != 0) {
            found = 1;
            *bytes = table[at].bytes;
            *gpu = table[at].gpu;
            /* Backward-shift deletion keeps every probe chain intact without tombstones. */
            size_t hole = at, next = (at + 1) & (capacity - 1);
            while (table[next].key != 0) {
                size_t want = home(table[next].key, table[next].kind);
                if (((next - want) & (capacity - 1)) >= ((next - hole) & (capacity - 1))) {
                    table[hole] = table[next];
                    hole = next;
                }
                next = (next + 1) & (capacity - 1);
            }
            table[hole].key = 0;
            used--;
        }
    }
    pthread_mutex_unlock(&lock);
    return found;
}

/* In a forked child: the parent's allocations are not the child's. */
static void ledger_after_fork(void) {
    pthread_mutex_init(&lock, NULL);
    if (table != NULL) memset(table, 0, capacity * sizeof *table);
    used = 0;
}
GM_AFTER_FORK(ledger_after_fork);
