/*
 * token_echo.c: the floor of a native token path: a Unix-socket server of the daemon's shape in
 * C (one epoll thread, non-blocking sockets, whole frames read from a buffer), which answers
 * every TOKEN_REQUEST with a TOKEN_GRANT and decides nothing. bench-token-rtt's `c-echo` case
 * runs it beside the asyncio and uvloop echoes, with the same client (token_rtt.c).
 *
 * Usage: token_echo SOCKET   (serves until killed)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "gemini_wire.h"

#define MAX_CONNECTIONS 64
#define BUFFER_BYTES (64 * 1024)

struct connection {
    int fd;
    size_t used;
    unsigned char buffer[BUFFER_BYTES];
};

static struct connection connections[MAX_CONNECTIONS];

static void drop(int epoll, struct connection *c) {
    epoll_ctl(epoll, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    c->fd = -1;
    c->used = 0;
}

/* Serve every whole frame in the buffer; keep a partial one for the next read. */
static int serve(struct connection *c) {
    size_t offset = 0;
    while (c->used - offset >= sizeof(struct gm_header)) {
        struct gm_header h;
        memcpy(&h, c->buffer + offset, sizeof h);
        if (h.length < sizeof h || h.length > GM_MAX_FRAME) return -1;
        if (c->used - offset < h.length) break;
        if (h.type == GM_MSG_TOKEN_REQUEST) {
            struct gm_token_grant grant = {
                .h = {.length = sizeof grant, .type = GM_MSG_TOKEN_GRANT, .version = h.version,
                      .seq = h.seq},
                .status = GM_OK, .generation = 1, .valid_until_ns = INT64_MAX / 2};
            if (send(c->fd, &grant, sizeof grant, MSG_NOSIGNAL) != (ssize_t)sizeof grant)
                return -1;
        }
        offset += h.length;
    }
    memmove(c->buffer, c->buffer + offset, c->used - offset);
    c->used -= offset;
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: token_echo SOCKET\n");
        return 2;
    }
    int listener = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_un address = {.sun_family = AF_UNIX};
    if (listener < 0 || strlen(argv[1]) >= sizeof address.sun_path) return 1;
    strcpy(address.sun_path, argv[1]);
    if (bind(listener, (struct sockaddr *)&address, sizeof address) != 0 ||
        listen(listener, 16) != 0) {
        perror("token_echo: bind");
        return 1;
    }
    int epoll = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event event = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(epoll, EPOLL_CTL_ADD, listener, &event);
    for (int i = 0; i < MAX_CONNECTIONS; i++) connections[i].fd = -1;
    for (;;) {
        struct epoll_event ready[16];
        int n = epoll_wait(epoll, ready, 16, -1);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return 1;
        for (int i = 0; i < n; i++) {
            struct connection *c = ready[i].data.ptr;
            if (c == NULL) {
                int fd = accept4(listener, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                int slot = 0;
                while (slot < MAX_CONNECTIONS && connections[slot].fd >= 0) slot++;
                if (fd < 0) continue;
                if (slot == MAX_CONNECTIONS) {
                    close(fd);
                    continue;
                }
                connections[slot].fd = fd;
                struct epoll_event e = {.events = EPOLLIN, .data.ptr = &connections[slot]};
                epoll_ctl(epoll, EPOLL_CTL_ADD, fd, &e);
                continue;
            }
            ssize_t got = recv(c->fd, c->buffer + c->used, BUFFER_BYTES - c->used, 0);
            if (got < 0 && (errno == EAGAIN || errno == EINTR)) continue;
            if (got <= 0 || (c->used += (size_t)got, serve(c) != 0)) drop(epoll, c);
        }
    }
}
