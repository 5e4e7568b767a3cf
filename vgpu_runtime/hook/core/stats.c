/* stats.c: the per-process counters, readable in-process and dumped at exit on request. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/stat.h>
#include <sys/auxv.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "hook.h"
#ifdef GM_PROFILE
GM_HIDDEN int gm_profile_dump(char *text, size_t size, int n);   /* launch/profile.c */
#endif

GM_EXPORT int gemini_hook_stats(struct gemini_hook_stats *out) {
    if (out == NULL) return -1;
    memset(out, 0, sizeof *out);
    out->version = GEMINI_HOOK_STATS_VERSION;
    out->active = (uint32_t)gm_active();
    out->bytes_held = gm_held_total();
#define LOAD(name) out->name = atomic_load_explicit(&gm_counters.name, memory_order_relaxed);
    GEMINI_HOOK_COUNTERS(LOAD)
#undef LOAD
    return 0;
}

/* A regular file of this process's user? Through the statx system call, a fixed kernel ABI:
 * glibc's fstat symbol is 2.33's, and the hook loads on 2.17. No answer (a kernel before 4.11)
 * is a no: nothing is written. */
static int own_regular_file(int fd) {
    struct statx st;
    if (syscall(SYS_statx, fd, "", AT_EMPTY_PATH, STATX_TYPE | STATX_UID, &st) != 0) return 0;
    return S_ISREG(st.stx_mode) && st.stx_uid == geteuid();
}

/* GEMINI_HOOK_STATS=<path>: key=value lines at exit, for tools that cannot call in.
 * The path comes from whoever set the environment, so: ignored in a setuid, setgid or
 * capability-raising program (AT_SECURE: the environment is not the program's user's), and
 * written only as a regular file this process owns, never through a link. */
__attribute__((destructor)) static void dump_stats_at_exit(void) {
    if (getauxval(AT_SECURE)) return;
    const char *path = getenv("GEMINI_HOOK_STATS");
    if (path == NULL || path[0] == '\0') return;
    struct gemini_hook_stats s;
    gemini_hook_stats(&s);
    char text[2048];
    int n = snprintf(text, sizeof text, "pid=%d\nactive=%u\nbytes_held=%llu\n", (int)getpid(),
                     s.active, (unsigned long long)s.bytes_held);
#define DUMP(name)                                                                       \
    if (n >= 0 && (size_t)n < sizeof text)                                               \
        n += snprintf(text + n, sizeof text - (size_t)n, #name "=%llu\n",               \
                      (unsigned long long)s.name);
    GEMINI_HOOK_COUNTERS(DUMP)
#undef DUMP
#ifdef GM_PROFILE
    n = gm_profile_dump(text, sizeof text, n);
#endif
    if (n < 0) return;
    int fd = open(path, O_WRONLY | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0600);
    if (fd < 0) return;
    if (own_regular_file(fd) && ftruncate(fd, 0) == 0)
        (void)!write(fd, text, (size_t)n < sizeof text ? (size_t)n : sizeof text - 1);
    close(fd);
}
