/* The sandbox ("pause") process of the test cluster's pods: it holds the pod's namespaces open,
 * reaps orphans (it is pid 1 when the pod shares its pid namespace) and exits on SIGINT/SIGTERM.
 * Written for this project after the behaviour of Kubernetes' build/pause/linux/pause.c;
 * built statically so the image needs no libc. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void terminate(int signo) {
    (void)signo;
    _exit(0);
}

static void reap(int signo) {
    (void)signo;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "-v") == 0) {
        puts("gemini-pause 1");
        return 0;
    }
    struct sigaction stop = {.sa_handler = terminate};
    struct sigaction child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
    if (sigaction(SIGINT, &stop, NULL) < 0 || sigaction(SIGTERM, &stop, NULL) < 0 ||
        sigaction(SIGCHLD, &child, NULL) < 0) {
        perror("sigaction");
        return 1;
    }
    for (;;)
        pause();
}
