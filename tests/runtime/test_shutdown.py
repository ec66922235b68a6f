"""expertmesh.runtime.shutdown: a process whose shutdown is stuck still ends at its deadline (a real process)."""

import subprocess
import sys
import time

STUCK = """
import threading, time
from expertmesh.runtime.shutdown import exit_after
threading.Thread(target=time.sleep, args=(120,)).start()   # a non-daemon thread: interpreter exit waits on it
exit_after({deadline}, "demo")
"""


def test_a_stuck_shutdown_ends_at_its_deadline_naming_the_process():
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", STUCK.format(deadline=0.5)], capture_output=True, text=True, timeout=60
    )
    took = time.monotonic() - start
    assert done.returncode == 1 and took < 30
    assert "demo: shutdown still running after 0.5s; exiting now" in done.stderr


def test_a_shutdown_that_finishes_in_time_exits_normally():
    quick = "from expertmesh.runtime.shutdown import exit_after\nexit_after(30, 'demo')\nprint('bye')"
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", quick], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "bye\n" and "exiting now" not in done.stderr
    assert time.monotonic() - start < 25  # the armed deadline does not hold the exit back


WAITS_FOR_A_SIGNAL = """
from expertmesh.runtime.shutdown import stop_on_signals
stop = stop_on_signals()
print("ready", flush=True)
while not stop.wait(0.0001):
    pass
"""


def test_a_burst_of_sigterms_stops_the_process_every_time():
    """stop_on_signals under a burst of 300 SIGTERMs, 50 processes: each stops. (With the Event set inside the
    handler, a handler re-entered while the previous one held the Event's lock deadlocked: 3 of 20 hung.)"""
    import signal

    hung = 0
    for _ in range(50):
        p = subprocess.Popen([sys.executable, "-c", WAITS_FOR_A_SIGNAL], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline() == "ready\n"
        for _ in range(300):
            p.send_signal(signal.SIGTERM)
        try:
            # 0, or -SIGTERM for a signal of the burst that lands while the interpreter finalizes (handlers reset)
            assert p.wait(10) in (0, -signal.SIGTERM)
        except subprocess.TimeoutExpired:
            hung += 1
            p.kill()
            p.wait()
    assert hung == 0


DIES_WITH_PARENT = """
import os, sys, time
from expertmesh.runtime.shutdown import PARENT_ENV, die_with_parent
die_with_parent()
print("running", PARENT_ENV in os.environ, flush=True)
time.sleep(float(sys.argv[1]))
"""


def test_a_child_of_up_dies_with_it_and_never_outlives_it():
    """die_with_parent (what `up`'s children run first, instead of a preexec_fn): with its parent's pid the child
    runs (the variable not passed on) and gets SIGTERM when that parent is SIGKILLed; with another pid — its parent
    already gone — it exits at once; without the variable nothing changes."""
    import os
    import signal

    from expertmesh.runtime.shutdown import PARENT_ENV

    env = {**os.environ, PARENT_ENV: str(os.getpid())}
    ok = subprocess.run(
        [sys.executable, "-c", DIES_WITH_PARENT, "0"], env=env, capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0 and ok.stdout == "running False\n"
    gone = subprocess.run(
        [sys.executable, "-c", DIES_WITH_PARENT, "0"],
        env={**env, PARENT_ENV: "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert gone.returncode == 1 and gone.stdout == ""
    # a middle process starts the child with its own pid and is SIGKILLed: the child gets SIGTERM from the kernel
    middle = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
import os, subprocess, sys, time
p = subprocess.Popen([sys.executable, "-c", {DIES_WITH_PARENT!r}, "60"],
                     env={{**os.environ, {PARENT_ENV!r}: str(os.getpid())}}, stdout=subprocess.PIPE, text=True)
print(p.pid, p.stdout.readline().strip(), flush=True)
time.sleep(60)
""",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    pid, state = middle.stdout.readline().split(" ", 1)
    assert state.strip() == "running False"
    middle.kill()
    middle.wait(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(int(pid), signal.SIGKILL)
        raise AssertionError("the child outlived its SIGKILLed parent")
