/* The infra container's only process: hold the crew's network namespace open and do nothing.
 *
 * It runs as PID 1 of its container, so the kernel delivers it no signal it has not installed a
 * handler for: SIGTERM and SIGINT get one (exit at once, so `docker stop` takes no grace period),
 * and SIGCHLD reaps any child that is ever reparented to it (nothing else runs here, but a zombie
 * must not accumulate if something does). Built with -static: the image holds this file alone.
 */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int signo) { _exit(128 + signo); }

static void on_child(int signo) {
    (void)signo;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction stop = {.sa_handler = on_stop};
    struct sigaction child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
    if (sigaction(SIGTERM, &stop, NULL) != 0 || sigaction(SIGINT, &stop, NULL) != 0 ||
        sigaction(SIGCHLD, &child, NULL) != 0) {
        return 1;
    }
    for (;;) {
        pause();
    }
}
