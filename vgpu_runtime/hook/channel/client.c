/*
 * client.c: the hook's one connection to the node daemon, <channel>/sched.sock (README.md,
 * "The channel"): opened lazily with SOCK_CLOEXEC, one per process; requests from all threads
 * take one mutex, one request and one reply at a time.
 *
 * Rules: a first need waits GEMINI_HOOK_DAEMON_WAIT for an absent daemon, then allocations fail
 * closed and nothing crashes the application; every (re)connection re-declares what this
 * process holds, so a restarted daemon loses nothing; each answered hello goes to the lifecycle,
 * which hands its pages to the families; a forked child never uses its parent's connection.
 */
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "hook.h"

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int fd = -1;
static pid_t owner;               /* the process that opened fd */
static uint32_t next_seq = 1;
static uint16_t spoken = GM_WIRE_VERSION;   /* this connection's: older with an older daemon */
static uint16_t refused_by;   /* the version of an older daemon that refused the last hello, or 0 */
static int gave_up;               /* a full wait failed: later needs try once, no wait */
static struct gm_grant_view grants[GM_MAX_GPUS];
static int grant_count = -1;      /* -1: no hello answered yet */

/* ---- enforcement settings: the daemon's (last hello), else these; env only makes safer ---- */

static _Atomic int64_t daemon_setting[5];   /* as struct gm_settings; 0: not said */
enum { TOKEN_TIMEOUT, FALLBACK_RETRY, IO_TIMEOUT, CONTEXT_BYTES, CONTEXT_MAX_BYTES };
static const int64_t default_setting[5] = {30000000000LL, 1000000000LL, 10000000000LL, 0,
                                           1LL << 30};

static int64_t setting(int which) {
    int64_t value = atomic_load_explicit(&daemon_setting[which], memory_order_relaxed);
    return value > 0 ? value : default_setting[which];
}

static int64_t at_least(int which, const char *name, double scale) {
    int64_t base = setting(which), asked = gm_env_number(name, scale);
    return asked > base ? asked : base;
}

int64_t gm_setting_token_timeout_ns(void) {
    return at_least(TOKEN_TIMEOUT, "GEMINI_HOOK_TOKEN_TIMEOUT", 1e9);
}

int64_t gm_setting_fallback_retry_ns(void) {
    int64_t base = setting(FALLBACK_RETRY);
    int64_t asked = gm_env_number("GEMINI_HOOK_FALLBACK_RETRY", 1e9);
    return asked > 0 && asked < base ? asked : base;
}

uint64_t gm_setting_context_bytes(void) {
    return (uint64_t)at_least(CONTEXT_BYTES, "GEMINI_HOOK_CONTEXT_BYTES", 1);
}

uint64_t gm_setting_context_max_bytes(void) {
    return (uint64_t)at_least(CONTEXT_MAX_BYTES, "GEMINI_HOOK_CONTEXT_MAX_BYTES", 1);
}

static void set_io_timeout(int sock) {
    int64_t ns = at_least(IO_TIMEOUT, "GEMINI_HOOK_IO_TIMEOUT", 1e9);
    struct timeval tv = {(time_t)(ns / 1000000000LL), (suseconds_t)(ns % 1000000000LL / 1000)};
    setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

/* How long a first need waits for an absent daemon (GEMINI_HOOK_DAEMON_WAIT seconds). */
static int64_t daemon_wait_ns(void) {
    int64_t asked = gm_env_number("GEMINI_HOOK_DAEMON_WAIT", 1e9);
    return asked >= 0 ? asked : 30000000000LL;
}

/* A poll timeout covering ns (rounded up a millisecond, as poll's unit is). */
static int poll_ms(int64_t ns) {
    int64_t ms = ns / 1000000 + 1;
    return ms < INT_MAX ? (int)ms : INT_MAX;
}

/* now + ns, saturated (an env setting may be up to 9e18 ns). */
static int64_t deadline_after(int64_t ns) {
    int64_t now = gm_now_ns();
    return ns > INT64_MAX - now ? INT64_MAX : now + ns;
}

static int send_all(int sock, const void *data, size_t len) {
    const char *p = data;
    while (len > 0) {
        ssize_t n = send(sock, p, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static int recv_all(int sock, void *data, size_t len) {
    char *p = data;
    while (len > 0) {
        ssize_t n = recv(sock, p, len, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static void fill_header(struct gm_header *h, uint16_t type, uint32_t length) {
    memset(h, 0, sizeof *h);
    h->length = length;
    h->type = type;
    h->version = spoken;
    h->seq = next_seq++;
}

union frame_buffer {
    struct gm_header h;
    char bytes[GM_MAX_FRAME];
};

static int send_frame(int sock, const void *frame) {
    GM_COUNT(frames_sent, 1);
    return send_all(sock, frame, ((const struct gm_header *)frame)->length);
}

/* One whole frame; -1 when the connection broke or the frame is unreadable. */
static int read_frame_body(int sock, union frame_buffer *frame) {
    if (frame->h.version >= 1 && frame->h.version < spoken && frame->h.type == GM_MSG_ERROR &&
        frame->h.length == sizeof(struct gm_error)) {
        /* An older daemon refuses a version it does not serve in its own version's frame. */
        struct gm_error error;
        memcpy(&error.h, &frame->h, sizeof error.h);
        if (recv_all(sock, (char *)&error + sizeof error.h, sizeof error - sizeof error.h) == 0 &&
            error.status == GM_ERR_BAD_VERSION)
            refused_by = frame->h.version;
        return -1;
    }
    if (frame->h.version != spoken || frame->h.length < sizeof frame->h ||
        frame->h.length > GM_MAX_FRAME) {
        gm_warn("daemon sent a malformed frame header; dropping the connection");
        return -1;
    }
    return recv_all(sock, frame->bytes + sizeof frame->h, frame->h.length - sizeof frame->h);
}

/* One whole frame; -1 when the connection broke or the frame is unreadable. */
static int read_frame(int sock, union frame_buffer *frame) {
    if (recv_all(sock, &frame->h, sizeof frame->h) < 0) return -1;
    return read_frame_body(sock, frame);
}

/* The hello reply: a frame whose first byte may carry descriptors (SCM_RIGHTS), which go to
 * fds (at most max; *count of them). -1 (nothing kept open) when the reply is unreadable. */
static int read_frame_with_fds(int sock, union frame_buffer *frame, int *fds, int max,
                               int *count) {
    *count = 0;
    union {
        struct cmsghdr align;
        char bytes[CMSG_SPACE(sizeof(int) * 2 * GM_MAX_GPUS)];
    } control;
    struct iovec iov = {&frame->h, sizeof frame->h};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.bytes,
                         .msg_controllen = sizeof control.bytes};
    ssize_t n;
    do {
        n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    } while (n < 0 && errno == EINTR);
    if (n <= 0) return -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        int got = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        for (int i = 0; i < got; i++) {
            int one;
            memcpy(&one, CMSG_DATA(c) + i * sizeof(int), sizeof one);
            if (*count < max) fds[(*count)++] = one;
            else close(one);
        }
    }
    int bad = (msg.msg_flags & MSG_CTRUNC) != 0 ||
              ((size_t)n < sizeof frame->h &&
               recv_all(sock, (char *)&frame->h + n, sizeof frame->h - (size_t)n) < 0) ||
              read_frame_body(sock, frame) < 0;
    if (bad) {
        for (int i = 0; i < *count; i++) close(fds[i]);
        *count = 0;
        return -1;
    }
    return 0;
}

/* The status of an ERROR frame (logged), or -1 for any other frame. */
static int error_status(union frame_buffer *frame) {
    if (frame->h.type != GM_MSG_ERROR || frame->h.length != sizeof(struct gm_error)) return -1;
    struct gm_error *error = (struct gm_error *)frame->bytes;
    error->reason[GM_REASON_BYTES - 1] = '\0';
    gm_warn("daemon refused the connection (status %u): %s", error->status, error->reason);
    return (int)error->status;
}

/* Lock held. A daemon older than token request flags refuses any as malformed: from then on
 * this process asks without them (report mode then charges as before the flags). */
static int flags_refused;

/* A grant whose waiter timed out earlier: nobody waits for it any more. */
static int is_stale_grant(const union frame_buffer *frame, uint32_t expected_seq) {
    return frame->h.type == GM_MSG_TOKEN_GRANT && frame->h.seq != expected_seq;
}

/* Send `request`, receive a frame of `reply_type` and exactly `reply_len` bytes into reply. */
static int exchange(int sock, void *request, void *reply, uint16_t reply_type, size_t reply_len) {
    const struct gm_header *sent = request;
    if (send_frame(sock, request) < 0) return -1;
    union frame_buffer frame;
    do {
        if (read_frame(sock, &frame) < 0) return -1;
    } while (is_stale_grant(&frame, sent->seq));
    if (error_status(&frame) >= 0) return -1;
    if (frame.h.type != reply_type || frame.h.length != reply_len || frame.h.seq != sent->seq) {
        gm_warn("daemon answered type %u (%u bytes, seq %u) to a request expecting type %u",
                frame.h.type, frame.h.length, frame.h.seq, reply_type);
        return -1;
    }
    memcpy(reply, frame.bytes, reply_len);
    return 0;
}

/* The hello reply of `version` (the frame's length checked) as this version's struct: a
 * version-1 or -2 reply gives what this version has of it (their grants' limit_ppm is not read;
 * version 1 has no pages and no settings: 0, the hook's defaults). 0 for a reserved field that
 * is not zero. */
static int convert_hello_reply(uint16_t version, const union frame_buffer *frame,
                               struct gm_hello_reply *reply) {
    memset(reply, 0, sizeof *reply);
    if (version >= 3) {
        memcpy(reply, frame->bytes, sizeof *reply);
        for (uint32_t i = 0; i < reply->gpu_count && i < GM_MAX_GPUS; i++)
            if (reply->gpus[i].reserved != 0) return 0;
        return reply->reserved == 0;
    }
    struct gm_hello_reply_v2 old;   /* version 1's reply is its prefix */
    memset(&old, 0, sizeof old);
    memcpy(&old, frame->bytes, frame->h.length);
    reply->h = old.h;
    reply->status = old.status;
    reply->gpu_count = old.gpu_count;
    memcpy(reply->allocation_id, old.allocation_id, sizeof reply->allocation_id);
    for (int i = 0; i < GM_MAX_GPUS; i++) {
        memcpy(reply->gpus[i].uuid, old.gpus[i].uuid, GM_UUID_BYTES);
        reply->gpus[i].memory_limit = old.gpus[i].memory_limit;
        reply->gpus[i].share_ppm = old.gpus[i].share_ppm;
    }
    reply->page_fds = old.page_fds;
    reply->settings = old.settings;
    return old.reserved == 0;
}

/* HELLO in `version`, and its reply read with the page descriptors into *reply (this
 * version's struct, whatever version was spoken); -1 (nothing open) on any failure. */
static int hello_exchange(int sock, uint16_t version, struct gm_hello_reply *reply, int *fds,
                          int *nfds) {
    spoken = version;
    refused_by = 0;
    struct gm_hello hello;
    memset(&hello, 0, sizeof hello);
    fill_header(&hello.h, GM_MSG_HELLO, sizeof hello);
    hello.proto_version = version;
    hello.pid = (uint32_t)getpid();
    if (send_frame(sock, &hello) < 0) return -1;
    union frame_buffer frame;
    if (read_frame_with_fds(sock, &frame, fds, 2 * GM_MAX_GPUS, nfds) < 0) return -1;
    size_t length = version == 1   ? sizeof(struct gm_hello_reply_v1)
                    : version == 2 ? sizeof(struct gm_hello_reply_v2)
                                   : sizeof *reply;
    int ok = error_status(&frame) < 0 && frame.h.type == GM_MSG_HELLO_REPLY &&
             frame.h.length == length && frame.h.seq == hello.h.seq;
    memset(reply, 0, sizeof *reply);
    if (ok && !convert_hello_reply(version, &frame, reply)) {
        gm_warn("hello reply has a reserved field that is not zero");
        ok = 0;
    }
    ok = ok && reply->status == GM_OK && reply->gpu_count <= GM_MAX_GPUS;
    if (ok && (reply->page_fds != (uint32_t)*nfds ||
               (*nfds != 0 && *nfds != 2 * (int)reply->gpu_count))) {
        gm_warn("hello reply announced %u page descriptors, %d arrived", reply->page_fds, *nfds);
        ok = 0;
    }
    if (!ok) {
        for (int i = 0; i < *nfds; i++) close(fds[i]);
        *nfds = 0;
        return -1;
    }
    return 0;
}

/* A version-1 daemon's pages, opened from the channel in the order a hello passes them: per
 * GPU the token page, then the activity page (writable, so only where the channel is; -1 in a
 * pod's read-only channel). Their count. */
static int open_legacy_pages(const char *dir, int count, int *fds) {
    int n = 0;
    for (int i = 0; i < count && i < GM_MAX_GPUS; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/token.%d", dir, i);
        fds[n++] = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        snprintf(path, sizeof path, "%s/activity.%d", dir, i);
        fds[n++] = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    }
    return n;
}

static int connect_and_hello(void) {
    const char *dir = gm_channel_dir();
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (dir == NULL ||
        (size_t)snprintf(addr.sun_path, sizeof addr.sun_path, "%s/" GM_CHANNEL_SOCKET_NAME,
                         dir) >= sizeof addr.sun_path)
        return -1;
    struct gm_hello_reply reply;
    int fds[2 * GM_MAX_GPUS], nfds = 0;
    int sock = -1;
    /* Newest first; a daemon that refuses it names its own version, which is older: speak
     * that on a new connection. */
    for (uint16_t version = GM_WIRE_VERSION;; version = refused_by) {
        sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (sock < 0) return -1;
        set_io_timeout(sock);
        if (connect(sock, (struct sockaddr *)&addr, sizeof addr) == 0 &&
            hello_exchange(sock, version, &reply, fds, &nfds) == 0)
            break;
        close(sock);
        if (refused_by == 0) return -1;
        static _Atomic int said;
        if (!atomic_exchange(&said, 1))
            gm_warn("the node daemon speaks wire version %u, this hook %u: speaking version %u "
                    "to it%s until it is upgraded", refused_by, GM_WIRE_VERSION, refused_by,
                    refused_by == 1 ? " (pages from the channel, the hook's default settings)"
                                    : "");
    }
    const int64_t said[5] = {reply.settings.token_timeout_ns, reply.settings.fallback_retry_ns,
                             reply.settings.io_timeout_ns, (int64_t)reply.settings.context_bytes,
                             (int64_t)reply.settings.context_max_bytes};
    for (int i = 0; i < 5; i++) atomic_store(&daemon_setting[i], said[i] > 0 ? said[i] : 0);
    set_io_timeout(sock);   /* now with the daemon's setting */
    uint32_t shares[GM_MAX_GPUS];
    for (uint32_t i = 0; i < reply.gpu_count; i++) {
        memcpy(grants[i].uuid, reply.gpus[i].uuid, GM_UUID_BYTES);
        grants[i].memory_limit = reply.gpus[i].memory_limit;
        shares[i] = reply.gpus[i].share_ppm;
    }
    grant_count = (int)reply.gpu_count;
    GM_COUNT(daemon_connects, 1);
    if (spoken == 1) nfds = open_legacy_pages(dir, grant_count, fds);
    struct gm_hello_view hello = {grant_count, shares, fds, nfds};
    gm_lifecycle_hello(&hello);
    for (int i = 0; i < nfds; i++)
        if (fds[i] >= 0) close(fds[i]);
    return sock;
}

/* After a (re)connection: tell the daemon everything this process holds. */
static int redeclare(int sock) {
    for (int gpu = 0; gpu < grant_count; gpu++) {
        for (uint32_t kind = 1; kind < GM_MEM_KIND_COUNT; kind++) {
            uint64_t bytes = gm_held_get((uint32_t)gpu, kind);
            if (bytes == 0) continue;
            struct gm_mem_request set = {.gpu = (uint32_t)gpu, .kind = kind, .bytes = bytes};
            fill_header(&set.h, GM_MSG_MEM_SET, sizeof set);
            struct gm_mem_reply reply;
            if (exchange(sock, &set, &reply, GM_MSG_MEM_REPLY, sizeof reply) < 0) return -1;
            gm_debug("re-declared gpu %d kind %u: %llu bytes (status %u)", gpu, kind,
                     (unsigned long long)bytes, reply.status);
        }
    }
    return 0;
}

static void drop_connection(void) {
    if (fd >= 0) close(fd);
    fd = -1;
}

/* Lock held. 0 when connected; *fresh says whether this call (re)connected. */
static int ensure_connected(int may_wait, int *fresh) {
    if (fd >= 0 && owner != getpid()) {   /* a fork that skipped the atfork handler */
        drop_connection();
        gm_held_reset();
    }
    if (fd >= 0) return 0;
    int64_t wait = (may_wait && !gave_up) ? daemon_wait_ns() : 0;
    int64_t deadline = deadline_after(wait);
    long backoff_ms = 10;
    for (;;) {
        int sock = connect_and_hello();
        if (sock >= 0) {
            if (redeclare(sock) == 0) {
                fd = sock;
                owner = getpid();
                if (gave_up) gm_warn("daemon is back; re-declared what this process holds");
                gave_up = 0;
                *fresh = 1;
                return 0;
            }
            close(sock);
        }
        if (gm_now_ns() >= deadline) break;
        struct timespec pause = {backoff_ms / 1000, (backoff_ms % 1000) * 1000000L};
        nanosleep(&pause, NULL);
        if (backoff_ms < 500) backoff_ms *= 2;
    }
    if (may_wait && !gave_up) {
        gm_warn("no answer from the node daemon at %s/" GM_CHANNEL_SOCKET_NAME " after %.1f s: "
                "allocations fail closed until it answers", gm_channel_dir(), (double)wait / 1e9);
        gave_up = 1;
    }
    return -1;
}

int gm_channel_grants(struct gm_grant_view *out, int max, int may_wait) {
    pthread_mutex_lock(&lock);
    int fresh = 0;
    if (grant_count < 0) ensure_connected(may_wait, &fresh);
    int count = grant_count < max ? grant_count : max;
    if (count > 0) memcpy(out, grants, (size_t)count * sizeof *out);
    pthread_mutex_unlock(&lock);
    return count;
}

int gm_channel_mem(uint16_t type, uint32_t gpu, uint32_t kind, uint64_t bytes,
                   struct gm_mem_reply *reply, int may_wait) {
    pthread_mutex_lock(&lock);
    /* The hook's own bookkeeping changes first: it is the truth re-declared on reconnection. */
    if (type == GM_MSG_MEM_RELEASE) gm_held_add(gpu, kind, -(int64_t)bytes);
    if (type == GM_MSG_MEM_SET) gm_held_set(gpu, kind, bytes);
    int rc = -1;
    for (int attempt = 0; attempt < 2 && rc < 0; attempt++) {
        int fresh = 0;
        if (ensure_connected(may_wait, &fresh) < 0) break;
        if (type == GM_MSG_MEM_RELEASE && fresh) {   /* the re-declaration already said it */
            memset(reply, 0, sizeof *reply);
            rc = 0;
            break;
        }
        struct gm_mem_request request = {.gpu = gpu, .kind = kind, .bytes = bytes};
        fill_header(&request.h, type, sizeof request);
        if (exchange(fd, &request, reply, GM_MSG_MEM_REPLY, sizeof *reply) == 0) rc = 0;
        else drop_connection();
    }
    /* Booked while the lock is held, so a re-declaration never misses an acknowledged one. */
    if (rc == 0 && type == GM_MSG_MEM_RESERVE && reply->status == GM_OK)
        gm_held_add(gpu, kind, (int64_t)bytes);
    pthread_mutex_unlock(&lock);
    return rc;
}

int gm_channel_ensure(int may_wait) {
    pthread_mutex_lock(&lock);
    int fresh = 0;
    int count = ensure_connected(may_wait, &fresh) == 0 ? grant_count : -1;
    pthread_mutex_unlock(&lock);
    return count;
}

int gm_channel_token(uint32_t gpu, uint32_t flags, int64_t burst_ns, int64_t work_end_ns,
                     struct gm_token_grant *out) {
    int64_t timeout = gm_setting_token_timeout_ns();
    pthread_mutex_lock(&lock);
    int rc = -1;
    for (int attempt = 0; attempt < 2 && rc == -1; attempt++) {
        int fresh = 0;
        if (ensure_connected(1, &fresh) < 0) break;
        uint32_t sent_flags = flags_refused ? 0 : flags;
        struct gm_token_request request = {.gpu = gpu, .flags = sent_flags,
                                           .burst_ns = burst_ns, .work_end_ns = work_end_ns};
        fill_header(&request.h, GM_MSG_TOKEN_REQUEST, sizeof request);
        if (send_frame(fd, &request) < 0) {
            drop_connection();
            continue;
        }
        int64_t deadline = deadline_after(timeout);
        for (;;) {
            int64_t left = deadline - gm_now_ns();
            struct pollfd p = {.fd = fd, .events = POLLIN};
            int ready = left > 0 ? poll(&p, 1, poll_ms(left)) : 0;
            if (ready < 0 && errno == EINTR) continue;
            if (ready == 0) {   /* the connection stays: a late grant is skipped when read */
                rc = -2;
                break;
            }
            union frame_buffer frame;
            if (ready < 0 || read_frame(fd, &frame) < 0) {
                drop_connection();
                break;
            }
            if (is_stale_grant(&frame, request.h.seq)) continue;
            if (frame.h.type == GM_MSG_TOKEN_GRANT && frame.h.length == sizeof *out) {
                memcpy(out, frame.bytes, sizeof *out);
                rc = 0;
                break;
            }
            int status = error_status(&frame);
            if (status < 0)
                gm_warn("daemon answered type %u to a token request", frame.h.type);
            drop_connection();
            if (status == GM_ERR_MALFORMED && sent_flags != 0) {
                /* An older daemon: reconnect (re-declaring what this process holds) and ask
                 * again at once, without the flags. */
                gm_warn("the node daemon does not know token request flags; asking without");
                flags_refused = 1;
                break;
            }
            /* A daemon shutting down closes every channel (no allocation): connect again,
             * waiting for the next daemon. Other errors (an old daemon: unsupported) are not
             * retried now. */
            if (status != GM_ERR_NO_ALLOCATION) attempt = 2;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

void gm_channel_revive(void) {
    if (pthread_mutex_trylock(&lock) != 0) return;   /* another thread talks to the daemon */
    if (fd >= 0 && owner == getpid()) {
        struct pollfd p = {.fd = fd, .events = POLLRDHUP};
        if (poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL)))
            drop_connection();   /* the daemon went away: its pages are written no more */
    }
    int fresh = 0;
    if (fd < 0 && grant_count >= 0) ensure_connected(0, &fresh);   /* no wait: one try */
    pthread_mutex_unlock(&lock);
}

int gm_channel_notify(void *frame) {
    if (pthread_mutex_trylock(&lock) != 0) return -1;
    int rc = -1;
    if (fd >= 0 && owner == getpid()) {
        struct gm_header *h = frame;
        fill_header(h, h->type, h->length);
        /* What older versions reserve (gemini_wire.h), zero on a connection that speaks one. */
        if (h->type == GM_MSG_USAGE_REPORT && spoken < GM_WIRE_BURSTS_SINCE)
            ((struct gm_usage_report *)frame)->bursts = 0;
        rc = send_frame(fd, frame);
        if (rc < 0) drop_connection();
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

/* A forked child never talks over its parent's connection, and holds nothing yet. */
static void channel_after_fork(void) {
    pthread_mutex_init(&lock, NULL);   /* another parent thread may have held it at fork */
    if (fd >= 0) close(fd);            /* our copy only: the parent's stays open */
    fd = -1;
    gave_up = 0;
    gm_held_reset();
}
GM_AFTER_FORK(channel_after_fork);
