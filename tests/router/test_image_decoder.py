"""The router's image decoder pool (router/image_decode.py) as processes: they end with the router."""

import os
import signal
import subprocess
import sys
import textwrap
import time

ROUTER = textwrap.dedent("""
    import multiprocessing.forkserver as fs, sys, time
    from expertmesh.router.image_decode import ImageDecoder
    pool = ImageDecoder(2)
    pool.warm()
    ex = pool._executor()
    while len(ex._processes) < 2:
        time.sleep(0.05)
    print(*ex._processes, fs._forkserver._forkserver_pid, flush=True)
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_decoder_processes_end_when_the_router_is_killed():
    """A SIGKILLed router left its two decoder processes and their forkserver running for good (each decoder holds
    the writing end of the pool's call queue, and the forkserver's liveness pipe)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", ROUTER], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONSAFEPATH": "1"}
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 3 and all(_alive(p) for p in pids)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"decoder processes still running after the router was killed: {left}"


def test_closing_the_pool_and_waiting_leaves_no_process():
    """The router's shutdown (close(wait=True)): the decoders, the forkserver and the resource tracker have exited
    when it returns."""
    import multiprocessing.forkserver as fs
    import multiprocessing.resource_tracker as rt

    from expertmesh.router.image_decode import ImageDecoder

    pool = ImageDecoder(2)
    pool.warm()
    ex = pool._executor()
    deadline = time.monotonic() + 30
    while not ex._processes and time.monotonic() < deadline:
        time.sleep(0.05)
    # a second decoder starts only if the first is busy when warm()'s second task arrives (ProcessPoolExecutor
    # reuses an idle one): on a loaded machine one may be all there is — what close() must end either way
    pids = [*ex._processes, fs._forkserver._forkserver_pid, rt._resource_tracker._pid]
    assert len(ex._processes) >= 1 and all(_alive(p) for p in pids)
    pool.close(wait=True)
    assert [p for p in pids if _alive(p)] == []
