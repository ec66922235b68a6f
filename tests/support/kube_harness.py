"""A node for kmock's Kubernetes emulator: the workload controllers and a kubelet that run pods as local processes.


`LocalNode` plays, for the objects in one namespace of the emulator (`support.kopf_cluster.Emulator`):
  - the StatefulSet and Deployment controllers (`support.kube_workloads.WorkloadControllers`);
  - the kubelet of node `LocalNode.NODE` (every pod the controllers create is bound to it): it starts each pod's
    single container as a process, translated as `support.kube_containers` describes (env, volumes, the
    `expertmesh` entry point, `/bin/sh -c` scripts, loopback networking with stable per-pod ports, cluster DNS
    names); init containers run first, one after the other, each to completion (a failed one is restarted with
    the back-off; the pod is Pending with `initContainerStatuses` meanwhile); a ConfigMap volume follows its
    ConfigMap while the container runs, each changed key replaced atomically. A StatefulSet pod keeps its loopback
    address across recreation (stable network identity).
    The pod is Running once started and Ready (conditions + containerStatuses) once the process prints its
    `READY ...` line. A pod that disappears (deleted) has its process SIGKILLed — a pod loss, not a graceful
    termination. A process that exits on its own is marked not Ready and restarted with a (short) back-off, as
    restartPolicy Always does (CrashLoopBackOff, compressed to `backoff`).
`stop()` SIGTERMs every process (router pods first, so no request finds its workers gone), SIGKILLs what is left
after `grace`, and `orphans()` lists every process group that still has a live member.

Everything runs as a task in the event loop that serves the emulator; its reads come from the emulator's memory,
its writes go through the emulator's HTTP API (as a real controller's and kubelet's would).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from expertmesh.operator.naming import COMPONENT_ROUTER, LABEL_COMPONENT
from support.kube_containers import ContainerLaunch, Process
from support.kube_workloads import WorkloadControllers


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class LocalNode(WorkloadControllers, ContainerLaunch):
    """The node of the module docstring: the kubelet here, the controllers and the container launch from its bases."""

    def __init__(
        self,
        emu,
        namespace: str,
        run_dir: Path,
        volumes: dict[str, Path] | None = None,
        *,
        tick: float = 0.1,
        backoff: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0),
        env: dict[str, str] | None = None,
        echo: bool = False,
    ):
        self.emu, self.ns = emu, namespace
        self.run_dir = Path(run_dir)
        self.volumes = {k: Path(v) for k, v in (volumes or {}).items()}  # PVC claimName → host directory
        self.tick, self.backoff = tick, backoff
        self.extra_env = dict(env or {})
        self.echo = echo
        self.ports: dict[tuple[str, int], int] = {}  # (pod name, container port) → loopback port
        self.running: dict[str, Process] = {}  # pod name → its current process
        self.history: list[Process] = []  # every process ever started, in order
        self.stage: dict[str, int] = {}  # pod uid → index of its running container (inits first)
        self.errors: list[str] = []  # unexpected failures of the loop (a test asserts none)
        self._task: asyncio.Task | None = None
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> LocalNode:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._task = asyncio.create_task(self._loop(), name="local-node")
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def _loop(self) -> None:
        while not self._stopping:
            try:
                await self._controllers()
                await self._kubelet()
                self._sync_configmaps()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep the node running; the test sees what went wrong
                if len(self.errors) < 50:
                    self.errors.append(f"{type(e).__name__}: {e}")
            await asyncio.sleep(self.tick)

    async def stop(self, grace: float = 15.0) -> list[Process]:
        """Stop reconciling, then SIGTERM the router processes, then the workers; SIGKILL after `grace`.
        Returns every process ever started."""
        self._stopping = True
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        routers = [p for p in self.running.values() if p.component == COMPONENT_ROUTER]
        others = [p for p in self.running.values() if p.component != COMPONENT_ROUTER]
        for wave in (routers, others):
            for p in wave:
                if p.alive:
                    p.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for p in wave:
                try:
                    await asyncio.to_thread(p.popen.wait, max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    await asyncio.to_thread(p.popen.wait)
        return list(self.history)

    def kill_all(self) -> None:
        """Last resort (a failing test): SIGKILL every process group still alive."""
        for p in self.history:
            try:
                os.killpg(p.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if p.popen.poll() is None:
                p.popen.wait()

    def orphans(self) -> list[str]:
        """Processes (by pod and pid) whose process group still has a live member."""
        out = []
        for p in self.history:
            try:
                os.killpg(p.popen.pid, 0)
                out.append(f"{p.pod} pid {p.popen.pid}")
            except ProcessLookupError:
                pass
        return out

    # ------------------------------------------------------------------ kubelet
    async def _kubelet(self) -> None:
        pods = {n: p for n, p in self.pods().items() if (p.get("spec") or {}).get("nodeName") == self.NODE}
        for name, proc in list(self.running.items()):  # pods gone: their processes die with them
            pod = pods.get(name)
            if pod is None or pod["metadata"].get("uid") != proc.uid:
                if proc.alive:
                    proc.killed = True
                    proc.popen.kill()
                    await asyncio.to_thread(proc.popen.wait)
                del self.running[name]
        now = time.monotonic()
        for name, pod in pods.items():
            proc = self.running.get(name)
            if proc is None:
                started = self._start(pod)
                if started is not None:
                    await self._patch_pod_status(name, self._status(started, ready=False))
            elif not proc.alive and proc.init and proc.popen.returncode == 0:  # on to the next container
                if not proc.exit_reported:
                    proc.exit_reported = True
                    self.stage[proc.uid] = self.stage.get(proc.uid, 0) + 1
                started = self._start(pod)
                if started is not None:
                    await self._patch_pod_status(name, self._status(started, ready=False))
            elif not proc.alive:
                if not proc.exit_reported:
                    proc.exit_reported = True
                    proc.restart_at = now + self.backoff[min(proc.restarts, len(self.backoff) - 1)]
                    await self._patch_pod_status(name, self._status(proc, ready=False))
                elif now >= proc.restart_at:
                    failure = proc.tail(5)[-1000:] if proc.popen.returncode else ""
                    started = self._start(pod, restarts=proc.restarts + 1, last_failure=failure)
                    if started is not None:
                        await self._patch_pod_status(name, self._status(started, ready=False))
            elif proc.address and not proc.marked_ready:
                proc.marked_ready = True
                await self._patch_pod_status(name, self._status(proc, ready=True))

    def _status(self, proc: Process, ready: bool) -> dict:
        """The pod status a kubelet reports for this run: Running (Ready or not), or the container's exit; while
        an init container runs, Pending with its state (the termination message of a failed run: its last log
        lines, as terminationMessagePolicy FallbackToLogsOnError)."""
        flag = "True" if ready else "False"
        rc = proc.popen.poll()
        if rc is None:
            state = {"running": {"startedAt": _now()}}
        else:
            state = {
                "terminated": {
                    "exitCode": rc if rc >= 0 else 128 - rc,
                    "reason": "Error" if rc else "Completed",
                    "message": proc.tail(5)[-1000:],
                }
            }
        this = {
            "name": proc.container or proc.component,
            "ready": ready,
            "started": rc is None,
            "restartCount": proc.restarts,
            "state": state,
            "image": "local",
            "containerID": f"local://{proc.popen.pid}",
        }
        if proc.last_failure:
            this["lastState"] = {"terminated": {"exitCode": 1, "reason": "Error", "message": proc.last_failure}}
        done = [
            {
                "name": n,
                "ready": True,
                "restartCount": 0,
                "image": "local",
                "state": {"terminated": {"exitCode": 0, "reason": "Completed"}},
            }
            for n in proc.inits_done
        ]
        out = {
            "phase": "Pending" if proc.init else "Running",
            "podIP": "127.0.0.1",
            "hostIP": "127.0.0.1",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "False" if proc.init else "True"},
                {"type": "ContainersReady", "status": flag},
                {"type": "Ready", "status": flag},
            ],
        }
        if proc.init:
            out["initContainerStatuses"] = done + [this]
        else:
            out["containerStatuses"] = [this]
            if done:
                out["initContainerStatuses"] = done
        return out

    # ------------------------------------------------------------------ running containers
    def _sync_configmaps(self) -> None:
        """The kubelet's periodic sync: a running container's ConfigMap volumes follow their ConfigMap's data
        (a process that re-reads a mounted file sees the new content)."""
        for proc in list(self.running.values()):
            if proc.alive:
                for name, d in proc.configmaps:
                    cm = self._get("v1/configmaps", name)
                    if cm is not None:
                        self._write_configmap(cm, d)

    def _start(self, pod: dict, restarts: int = 0, last_failure: str = "") -> Process | None:
        meta, spec = pod["metadata"], pod["spec"]
        name, uid = meta["name"], meta.get("uid", "")
        inits = spec.get("initContainers") or []
        stage = self.stage.get(uid, 0)
        (main,) = spec["containers"]  # one container per pod in these workloads (after its init containers)
        container = inits[stage] if stage < len(inits) else main
        pod_dir = self.run_dir / f"{name}-{uid[:8]}"
        pod_dir.mkdir(parents=True, exist_ok=True)
        self._cm_dirs: list[tuple[str, Path]] = []
        mounts = self._mounts(pod, container, pod_dir)
        if mounts is None:
            return None
        env = self._env(pod, container)
        argv = self._argv(pod, container, env, mounts)
        full_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        full_env.update(
            {
                "HOSTNAME": spec.get("hostname") or name,
                "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "EXPERTMESH_TORCH_THREADS": "1",
                **env,
                **self.extra_env,
            }
        )
        popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
            cwd=str(pod_dir),
            start_new_session=True,
        )
        component = (meta.get("labels") or {}).get(LABEL_COMPONENT, container["name"])
        proc = Process(
            pod=name,
            uid=uid,
            component=component,
            argv=argv,
            popen=popen,
            restarts=restarts,
            container=container["name"],
            init=stage < len(inits),
            last_failure=last_failure,
            inits_done=tuple(c["name"] for c in inits[:stage]),
            configmaps=tuple(self._cm_dirs),
        )
        log = open(pod_dir / f"run-{container['name']}-{restarts}.log", "w")
        threading.Thread(target=self._pump, args=(proc, log), daemon=True, name=f"log-{name}").start()
        self.running[name] = proc
        self.history.append(proc)
        return proc

    def _pump(self, proc: Process, log) -> None:
        with log:
            for line in proc.popen.stdout:
                line = line.rstrip("\n")
                proc.lines.append(line)
                log.write(line + "\n")
                log.flush()
                if line.startswith("READY "):
                    proc.address = line.split()[-1]
                if self.echo:
                    print(f"[{proc.pod}#{proc.restarts}] {line}", file=sys.stderr)

    # ------------------------------------------------------------------ for tests
    def process(self, pod: str) -> Process | None:
        return self.running.get(pod)

    async def read_log(self, namespace: str, pod: str, container: str) -> str:
        """The log of a pod's container (its latest run), as the API's pods/log gives it."""
        runs = [p for p in self.history if p.pod == pod and p.container == container]
        if namespace != self.ns or not runs:
            raise LookupError(f"no log of container {container} in pod {pod}")
        return "\n".join(runs[-1].lines[-20:])

    def logs(self, n: int = 15) -> str:
        """The last lines of every process, for a failure message."""
        return "\n".join(f"--- {p.pod} (run {p.restarts}, rc {p.popen.poll()})\n{p.tail(n)}" for p in self.history)
