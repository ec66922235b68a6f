"""A bound on how long a process may take to stop once it has been asked to.

The router and the workers shut down gracefully on SIGTERM (drain, then stop). Whoever sent it usually enforces a
limit (Kubernetes' terminationGracePeriodSeconds, `expertmesh up`'s stop), but not always: a child of `up` gets its
SIGTERM from the kernel when `up` dies (PR_SET_PDEATHSIG), and nobody is left to SIGKILL it. A shutdown that then
waits on a stuck call or thread would keep the process, and its ports, forever. `exit_after` arms a watchdog
that ends the process at the deadline, whatever is still running.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time


def exit_after(seconds: float, what: str, code: int = 1) -> threading.Thread:
    """Start a daemon thread that, `seconds` from now, writes one line naming `what` to stderr and ends the
    process with `code` (os._exit: no further cleanup, which is what is stuck). Arm it once the shutdown starts;
    a process that finishes its shutdown in time exits normally and the thread dies with it."""
    def expire() -> None:
        time.sleep(seconds)
        try:
            logging.shutdown()
            print(f"{what}: shutdown still running after {seconds:g}s; exiting now", file=sys.stderr, flush=True)
        except Exception:       # stderr may be a broken pipe (the parent that read it died): exit regardless
            pass
        os._exit(code)

    thread = threading.Thread(target=expire, name="shutdown-deadline", daemon=True)
    thread.start()
    return thread
