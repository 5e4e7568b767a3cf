/*
 * token_rtt.c: token round trips over an allocation's channel, as the hook's C client makes
 * them (one blocking socket, whole frames), with nothing of Python on the client side.
 *
 * Usage: token_rtt SOCKET COUNT HOLD_US OUT [hello|plain] [handshake] [spin]
 * With `hello` it says HELLO first (the page descriptors it is passed are closed), as
 * on a daemon's channel; without (or `plain`), it talks to a bare echo server. With `handshake`
 * it prints "ready" and reads a line from stdin before the rounds, and prints "done" and reads
 * another after them, so a benchmark can read the server's CPU time around the rounds alone.
 * With `spin` it waits for each grant by polling the socket without blocking, so it is awake
 * when the grant comes: a handoff then costs the daemon's wake-up and work, not the waiter's.
 * Then COUNT times: TOKEN_REQUEST
 * for GPU 0, block for the TOKEN_GRANT, hold HOLD_US (a spin on the clock, so the process stays
 * on the CPU as a launching one would), TOKEN_RELEASE. OUT gets one line per round:
 * "asked granted released" in CLOCK_MONOTONIC nanoseconds.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "gemini_wire.h"

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int recv_all_flags(int fd, void *buf, size_t size, int flags) {
    size_t got = 0;
    while (got < size) {
        ssize_t n = recv(fd, (char *)buf + got, size - got, flags);
        if (n < 0 && errno == EAGAIN && (flags & MSG_DONTWAIT)) continue;
        if (n <= 0) return -1;
        got += (size_t)n;
    }
    return 0;
}

static int recv_all(int fd, void *buf, size_t size) { return recv_all_flags(fd, buf, size, 0); }

static int has_flag(int argc, char **argv, const char *flag) {
    for (int i = 5; i < argc; i++)
        if (strcmp(argv[i], flag) == 0) return 1;
    return 0;
}

static void header(struct gm_header *h, uint16_t type, uint32_t length, uint32_t seq) {
    memset(h, 0, sizeof *h);
    h->type = type;
    h->length = length;
    h->version = GM_WIRE_VERSION;
    h->seq = seq;
}

static int hello(int fd) {
    struct gm_hello frame = {.proto_version = GM_WIRE_VERSION, .pid = (uint32_t)getpid()};
    header(&frame.h, GM_MSG_HELLO, sizeof frame, 1);
    if (send(fd, &frame, sizeof frame, MSG_NOSIGNAL) != (ssize_t)sizeof frame) return -1;
    static struct gm_hello_reply reply;
    char control[CMSG_SPACE(sizeof(int) * 2 * GM_MAX_GPUS)];
    struct iovec iov = {&reply, sizeof reply};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                         .msg_controllen = sizeof control};
    ssize_t n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
    if (n <= 0) return -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
            for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); i++)
                close(((int *)CMSG_DATA(c))[i]);
    if ((size_t)n < sizeof reply && recv_all(fd, (char *)&reply + n, sizeof reply - n) != 0)
        return -1;
    return reply.h.type == GM_MSG_HELLO_REPLY && reply.status == GM_OK ? 0 : -1;
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: token_rtt SOCKET COUNT HOLD_US OUT [hello] [handshake] [spin]\n");
        return 2;
    }
    long count = atol(argv[2]);
    int64_t hold = atoll(argv[3]) * 1000;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", argv[1]);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        perror("token_rtt: connect");
        return 1;
    }
    if (has_flag(argc, argv, "hello") && hello(fd) != 0) {
        fprintf(stderr, "token_rtt: hello refused\n");
        return 1;
    }
    int handshake = has_flag(argc, argv, "handshake");
    int wait_flags = has_flag(argc, argv, "spin") ? MSG_DONTWAIT : 0;
    char line[64];
    if (handshake && (printf("ready\n") < 0 || fflush(stdout) != 0 ||
                      fgets(line, sizeof line, stdin) == NULL))
        return 1;
    int64_t(*rounds)[3] = calloc((size_t)count, sizeof *rounds);
    for (long i = 0; i < count; i++) {
        struct gm_token_request request = {.gpu = 0, .burst_ns = -1, .work_end_ns = -1};
        header(&request.h, GM_MSG_TOKEN_REQUEST, sizeof request, (uint32_t)(2 * i + 2));
        struct gm_token_grant grant;
        rounds[i][0] = now_ns();
        if (send(fd, &request, sizeof request, MSG_NOSIGNAL) != (ssize_t)sizeof request ||
            recv_all_flags(fd, &grant, sizeof grant, wait_flags) != 0 || grant.h.type != GM_MSG_TOKEN_GRANT) {
            fprintf(stderr, "token_rtt: no grant for round %ld\n", i);
            return 1;
        }
        rounds[i][1] = now_ns();
        while (now_ns() - rounds[i][1] < hold) {
        }
        struct gm_token_release release = {.gpu = 0, .work_end_ns = -1};
        header(&release.h, GM_MSG_TOKEN_RELEASE, sizeof release, (uint32_t)(2 * i + 3));
        rounds[i][2] = now_ns();
        if (send(fd, &release, sizeof release, MSG_NOSIGNAL) != (ssize_t)sizeof release) return 1;
    }
    if (handshake && (printf("done\n") < 0 || fflush(stdout) != 0 ||
                      fgets(line, sizeof line, stdin) == NULL))
        return 1;
    FILE *out = fopen(argv[4], "w");
    if (out == NULL) return 1;
    for (long i = 0; i < count; i++)
        fprintf(out, "%lld %lld %lld\n", (long long)rounds[i][0], (long long)rounds[i][1],
                (long long)rounds[i][2]);
    return fclose(out) != 0;
}
