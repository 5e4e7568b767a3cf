/*
 * lifecycle.c: runs what the families registered (include/lifecycle.h) when the channel
 * says a hello was answered, and in a forked child (pthread_atfork), in link order.
 */
#include "hook.h"

void gm_lifecycle_hello(const struct gm_hello_view *hello) {
    for (const gm_on_hello_fn *fn = __start_gm_on_hello; fn < __stop_gm_on_hello; fn++)
        (*fn)(hello);
}

static void after_fork_child(void) {
    for (const gm_after_fork_fn *fn = __start_gm_after_fork; fn < __stop_gm_after_fork; fn++)
        (*fn)();
}

__attribute__((constructor)) static void register_fork_handler(void) {
    pthread_atfork(NULL, NULL, after_fork_child);
}
