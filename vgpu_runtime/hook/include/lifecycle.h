/* lifecycle.h: the two moments every family may need to hear about (core/lifecycle.c).
 *
 * The channel reports them; families register for them. A family registers at link time
 * (GM_ON_HELLO, GM_AFTER_FORK put a pointer in a section the linker gathers), so nothing can
 * miss a hello that happens before the library's constructors run, and the channel never
 * calls up into the families. */
#ifndef GEMINI_LIFECYCLE_H
#define GEMINI_LIFECYCLE_H

#include <stdint.h>

/* What an answered hello says about the allocation's GPUs, in the reply's order. */
struct gm_hello_view {
    int gpu_count;
    const uint32_t *share_ppm;   /* per GPU: its share of GPU time, parts per million */
    const int *page_fds;         /* per GPU: token page (read-only), activity page; -1: none */
    int page_fd_count;           /* 0 or 2 * gpu_count; the channel closes them afterwards */
};

typedef void (*gm_on_hello_fn)(const struct gm_hello_view *hello);
typedef void (*gm_after_fork_fn)(void);

#define GM_LIFECYCLE_ENTRY(section_name, type, fn)                                    \
    static const type gm_lifecycle_##fn                                               \
        __attribute__((used, section(section_name), aligned(sizeof(void *)))) = fn
/* fn runs after every answered hello (first connection and each reconnection). */
#define GM_ON_HELLO(fn) GM_LIFECYCLE_ENTRY("gm_on_hello", gm_on_hello_fn, fn)
/* fn runs in a forked child before anything else: it drops what was the parent's. */
#define GM_AFTER_FORK(fn) GM_LIFECYCLE_ENTRY("gm_after_fork", gm_after_fork_fn, fn)

/* The sections' bounds, which the linker defines for section names that are C identifiers. */
extern const gm_on_hello_fn __start_gm_on_hello[] __attribute__((visibility("hidden")));
extern const gm_on_hello_fn __stop_gm_on_hello[] __attribute__((visibility("hidden")));
extern const gm_after_fork_fn __start_gm_after_fork[] __attribute__((visibility("hidden")));
extern const gm_after_fork_fn __stop_gm_after_fork[] __attribute__((visibility("hidden")));

/* Called by the channel once a hello is answered. */
__attribute__((visibility("hidden"))) void gm_lifecycle_hello(const struct gm_hello_view *hello);

#endif
