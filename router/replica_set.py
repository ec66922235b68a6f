"""The router replicas the endpoint picker (router/endpoint_picker.py) chooses among, and what each says of itself.

Where the set comes from, in the order the picker uses them:
  * the gateway's subset hint on a request (`envoy.lb.subset_hint`): the endpoints its InferencePool selects — the
    picker chooses only among those (an address seen there for the first time is probed before it is chosen);
  * `--epp-replicas HOST:PORT,...`: the replicas' HTTP addresses; a HOST naming several addresses (a headless
    Service's DNS name) stands for all of them, resolved again at every refresh, so replicas that come and go are
    followed;
  * neither: this router alone, at its own HTTP address.
Router replicas share no list of each other otherwise: they meet only on the workers (the shared prefix salt).

A replica is ready when its `/health` answers 200 — the same check as the router pods' readiness probe — and it
sheds load when its `/health` says `shedding` (its waiting queue is full: it would answer 429). The probes run on a
thread of their own every `interval` seconds, all replicas at once, each within `timeout`.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import ssl
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

log = logging.getLogger("expertmesh.router.epp")
MAX_HINTED = 1024  # addresses learned from subset hints kept probed


@dataclass(frozen=True)
class ReplicaState:
    address: str  # ip:port of its HTTP endpoint (what the gateway routes to)
    ready: bool
    shedding: bool = False
    replica: str | None = None  # its name in response ids (resp_<replica>_…)
    load: int = 0  # requests running + waiting there


def join_host_port(host: str, port: int) -> str:
    """`ip:port`, an IPv6 address bracketed (`[::1]:8000`), as Envoy writes endpoints."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(address: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` → (host, port); ValueError naming the address otherwise."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def parse_replicas(text: str) -> list[tuple[str, int]]:
    """`--epp-replicas HOST:PORT,...` → [(host, port)]; ValueError naming the flag and the entry."""
    out = []
    for entry in (e for e in text.split(",") if e.strip()):
        try:
            out.append(split_host_port(entry))
        except ValueError as e:
            raise ValueError(f"--epp-replicas: {e}") from None
    return out


def own_address(host: str, port: int) -> str:
    """This router's HTTP address as the gateway reaches it: `host`, or for a wildcard bind (0.0.0.0, ::) the pod's
    IP ($POD_IP, else what the hostname resolves to — the pod IP in Kubernetes)."""
    if host in ("", "0.0.0.0", "::"):
        host = os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())
    return join_host_port(host, port)


def resolve(host: str, port: int) -> list[str]:
    """Every address `host` stands for (an IP literal: itself), as ip:port; [] when it does not resolve."""
    try:
        ipaddress.ip_address(host)
        return [join_host_port(host, port)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        log.warning("--epp-replicas %s: does not resolve (%s)", host, e)
        return []
    return sorted({join_host_port(info[4][0], port) for info in infos})


class ReplicaSet:
    """The replicas' states, refreshed by probing; `states(subset)` is what the picker chooses from."""

    def __init__(
        self,
        seeds: list[tuple[str, int]],
        *,
        interval: float = 1.0,
        timeout: float = 1.0,
        tls: bool = False,
    ):
        """`seeds`: (host, port) of the replicas (--epp-replicas, or this router's own address); `tls`: the
        replicas serve HTTPS (their certificate is not verified: the probe reads readiness only, sends nothing)."""
        self.seeds = seeds
        self.interval, self.timeout = interval, timeout
        self.scheme = "https" if tls else "http"
        self._ssl = ssl._create_unverified_context() if tls else None
        self._lock = threading.Lock()
        self._states: dict[str, ReplicaState] = {}
        self._hinted: dict[str, None] = {}  # addresses learned from subset hints, probed from then on (oldest first)
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="epp-probe")
        self._stop = threading.Event()
        self.synced = threading.Event()  # set once the first refresh is done (the picker's readiness)
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ probing
    def probe(self, address: str) -> ReplicaState:
        """One replica's state from its /health (unreachable, slow or not 200: not ready)."""
        url = f"{self.scheme}://{address}/health"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout, context=self._ssl) as r:
                body = json.loads(r.read(65536) or b"{}")
        except (OSError, ValueError, urllib.error.URLError) as e:
            log.debug("replica %s: not ready (%s)", address, e)
            return ReplicaState(address, ready=False)
        if not isinstance(body, dict):
            return ReplicaState(address, ready=False)
        load = sum(v for v in (body.get("running"), body.get("waiting")) if isinstance(v, int))
        return ReplicaState(
            address,
            ready=True,
            shedding=bool(body.get("shedding")),
            replica=body.get("replica") if isinstance(body.get("replica"), str) else None,
            load=load,
        )

    def addresses(self) -> list[str]:
        """The seeds resolved now, plus the addresses subset hints named."""
        seen = [a for host, port in self.seeds for a in resolve(host, port)]
        with self._lock:
            seen += list(self._hinted)
        return list(dict.fromkeys(seen))

    def refresh(self) -> None:
        """Probe every replica at once and replace the states (replicas no longer resolved are forgotten)."""
        addresses = self.addresses()
        states = {s.address: s for s in self._pool.map(self.probe, addresses)}
        with self._lock:
            self._states = states
        self.synced.set()

    def start(self) -> ReplicaSet:
        self.refresh()
        self._thread = threading.Thread(target=self._watch, name="epp-replicas", daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.refresh()
            except Exception:  # a refresh that failed keeps the last states
                log.exception("endpoint picker: refreshing the replica set failed")

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ reading
    def states(self, subset: list[str] | None = None) -> list[ReplicaState]:
        """The known replicas' states, or with a `subset` (the request's hint) those of its addresses — one not
        known yet is probed now and followed from then on."""
        if subset is None:
            with self._lock:
                return list(self._states.values())
        with self._lock:
            unknown = [a for a in dict.fromkeys(subset) if a not in self._states]
        if unknown:
            probed = list(self._pool.map(self.probe, unknown))
            with self._lock:
                self._hinted.update(dict.fromkeys(unknown))
                for old in list(self._hinted)[: max(0, len(self._hinted) - MAX_HINTED)]:
                    del self._hinted[old]  # bounded: a gateway naming ever new addresses cannot grow it
                for s in probed:
                    self._states.setdefault(s.address, s)
        with self._lock:
            return [self._states[a] for a in dict.fromkeys(subset) if a in self._states]
