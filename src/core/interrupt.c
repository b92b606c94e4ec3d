/* The process-wide stop request: set from a signal handler (a sig_atomic_t store, the
 * one thing a handler may do), read by the loops that must end early. */
#include "anneal/core.h"

#include <signal.h>

static volatile sig_atomic_t pending; /* 0: none; else the signal, or -1 */
static int held;                      /* anneal_interrupt_hold depth (the main thread's) */

void anneal_interrupt_hold(bool on) { held += on ? 1 : (held > 0 ? -1 : 0); }

void anneal_interrupt_request(int signo) { pending = signo > 0 ? signo : -1; }

int anneal_interrupt_pending(void) { return pending; }

void anneal_interrupt_reset(void) { pending = 0; }

anneal_status anneal_interrupt_check(const char *what) {
    int s = pending;
    if (!s || held) return ANNEAL_OK;
    const char *name = s == SIGTERM ? "SIGTERM" : s == SIGINT ? "SIGINT" : s == SIGHUP ? "SIGHUP" : "a stop request";
    return anneal_set_error(ANNEAL_ERR_INTERRUPTED, "interrupted by %s while %s", name, what ? what : "working");
}
