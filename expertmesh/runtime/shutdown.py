"""Stopping a process: the stop request from a signal, and a bound on how long the stop may take.

`stop_on_signals` turns SIGTERM / SIGINT into a threading.Event without setting it inside the signal handler. A
handler runs in the main thread between two bytecodes; if the main thread is inside that Event's own wait, it holds
the Event's lock, and `Event.set` in the handler waits on it forever. (An expert worker of `up` was found an hour
after its SIGTERM in exactly that state, holding its port.) The handler does nothing; Python's C-level handler writes
the signal to a wakeup socket, and a relay thread sets the Event.

The router and the workers shut down gracefully on SIGTERM (drain, then stop). Whoever sent it usually enforces a
limit (Kubernetes' terminationGracePeriodSeconds, `expertmesh up`'s stop), but not always: a child of `up` gets its
SIGTERM from the kernel when `up` dies (PR_SET_PDEATHSIG), and nobody is left to SIGKILL it. A shutdown that then
waits on a stuck call or thread would keep the process, and its ports, forever. `exit_after` arms a watchdog
that ends the process at the deadline, whatever is still running.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time

PARENT_ENV = "EXPERTMESH_DIE_WITH_PARENT"  # set by `up` on its children: the pid of the process to die with


def die_with_parent() -> None:
    """In a process `up` started (PARENT_ENV: `up`'s pid): SIGTERM from the kernel when `up` dies, even by SIGKILL
    (Linux PR_SET_PDEATHSIG; it follows the starting *thread*, so `up` starts its children from its main thread),
    and exit at once if that already happened. Done here, first thing in the child, not in a preexec_fn: with a
    preexec_fn, subprocess forks the whole parent and runs its at-fork handlers (a test process with ~260 threads
    once hung in there for good); without one it uses vfork. Elsewhere, or without the variable: nothing."""
    parent = os.environ.pop(PARENT_ENV, None)
    if not parent:
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != int(parent):
        os._exit(1)


def stop_on_signals(signals=(signal.SIGTERM, signal.SIGINT)) -> threading.Event:
    """An Event that is set once one of `signals` arrives (call from the main thread; it takes over
    signal.set_wakeup_fd)."""
    stop = threading.Event()
    receive, send = socket.socketpair()
    send.setblocking(False)  # the C handler must never block on a full buffer
    signal.set_wakeup_fd(send.fileno(), warn_on_full_buffer=False)
    for sig in signals:
        signal.signal(sig, lambda *_: None)  # a Python handler, so the wakeup byte is written; no locks here

    def relay() -> None:
        while receive.recv(1):
            stop.set()

    threading.Thread(target=relay, name="signal-relay", daemon=True).start()
    stop.wakeup_sockets = (receive, send)  # kept open as long as the Event lives
    return stop


def exit_after(seconds: float, what: str, code: int = 1) -> threading.Thread:
    """Start a daemon thread that, `seconds` from now, writes one line naming `what` to stderr and ends the
    process with `code` (os._exit: no further cleanup, which is what is stuck). Arm it once the shutdown starts;
    a process that finishes its shutdown in time exits normally and the thread dies with it."""

    def expire() -> None:
        time.sleep(seconds)
        try:
            logging.shutdown()
            print(f"{what}: shutdown still running after {seconds:g}s; exiting now", file=sys.stderr, flush=True)
        except Exception:  # stderr may be a broken pipe (the parent that read it died): exit regardless
            pass
        os._exit(code)

    thread = threading.Thread(target=expire, name="shutdown-deadline", daemon=True)
    thread.start()
    return thread
