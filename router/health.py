"""The attention workers' health as the router sees it: which are down, which expert workers each live one sees down,
and the sequences to close on a worker once it answers again.

A worker is marked down when a call to it fails (unreachable, past its deadline, restarted, hung) — a step, a
control call or a heartbeat —; its cached prefixes are forgotten and it gets no new sequence until it answers its
health check again (sticky: one failed call costs one deadline, later requests never touch it). The watch thread heartbeats the live workers once an
interval (the heartbeat keeps this router's sequence leases, and says which expert workers the worker sees down) and
takes a down worker back once it answers SERVING again: reconnected to the expert workers (a restarted worker has no
expert table), the sequences left open there closed, its free blocks read again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from expertmesh.router.kv import KVManager
from expertmesh.wire.worker_api import NotFound

log = logging.getLogger("expertmesh.router")
LISTING_TRIES = 5  # take-backs a worker stays down for while its prefix listing fails (then back without it)


def serving(client, timeout: float | None = None) -> bool:
    """Whether a worker answers its health check (in-process workers have none and never go down)."""
    health = getattr(client, "health", None)
    if health is None:
        return True
    try:
        return (health(timeout=timeout) if timeout is not None else health()) == "SERVING"
    except Exception:
        return False


class AttentionHealth:
    def __init__(self, clients: list, kv: KVManager, *, owner: str, interval: float, connect: Callable[[int], None]):
        """`owner`: the router instance the heartbeat renews leases for; `connect(i)`: push the expert workers and
        the replica table to attention worker i."""
        self.clients = clients
        self.kv = kv
        self.owner = owner
        self.interval = interval
        self.connect = connect
        self.down: set[int] = set()
        self.experts_down_by: dict[int, set[int]] = {}  # attention worker → expert workers it sees down
        self.pending_closes: dict[int, list[str]] = {}  # attention worker → sequences to close once it answers
        self.listing_failures: dict[int, int] = {}  # attention worker → take-backs its prefix listing failed in a row

    @property
    def experts_down(self) -> list[int]:
        """Expert workers some live attention worker saw down after its last step."""
        return sorted(set().union(*[d for w, d in self.experts_down_by.items() if w not in self.down]))

    def mark_down(self, worker: int, error: Exception) -> None:
        if worker not in self.down:
            log.warning("attention worker %d marked down: %s", worker, error)
        self.down.add(worker)
        self.kv.lost(worker)

    def close(self, worker: int, seq_id: str) -> None:
        """Close a sequence; a worker that is down or does not answer gets it again once it is back (no leak)."""
        if worker in self.down:
            self.close_later(worker, seq_id)
            return
        try:
            self.kv.report(worker, self.clients[worker].close_sequence(seq_id))
        except NotFound:
            pass  # already gone (a restarted worker)
        except Exception as e:
            log.warning("close_sequence %s on attention worker %d failed, will retry: %s", seq_id, worker, e)
            self.close_later(worker, seq_id)

    def close_later(self, worker: int, seq_id: str) -> None:
        self.pending_closes.setdefault(worker, []).append(seq_id)

    def retry_closes(self, worker: int) -> None:
        for seq_id in self.pending_closes.pop(worker, []):
            self.close(worker, seq_id)

    def watch(self, stopped: Callable[[], bool]) -> None:
        """The health thread: until `stopped()`, heartbeat the live workers and take back the ones that answer."""
        while not stopped():
            time.sleep(self.interval)
            for i, client in enumerate(self.clients):
                if i not in self.down:
                    try:
                        self.experts_down_by[i] = set(client.info(owner=self.owner)["experts_down"])
                    except ConnectionError as e:  # unreachable or hung: down before a request finds out
                        self.mark_down(i, e)
                    except Exception:
                        pass
            for i in list(self.down):
                if serving(self.clients[i]):
                    self._take_back(i)

    def _take_back(self, worker: int) -> None:
        try:
            self.connect(worker)  # a restarted worker has no expert table
        except Exception:
            return
        try:  # what it still holds, known before a request is placed (its disk tier survives a restart)
            self.kv.learn(worker, self.clients[worker].list_prefixes())
            self.listing_failures.pop(worker, None)
        except Exception as e:
            # a worker still busy with the step it missed answers its listing late: stay down and ask again at the
            # next heartbeat, or a replay placed now would recompute what it holds; back anyway after a few tries
            failures = self.listing_failures[worker] = self.listing_failures.get(worker, 0) + 1
            log.warning(
                "list_prefixes on attention worker %d failed (%d of %d): %s", worker, failures, LISTING_TRIES, e
            )
            if failures < LISTING_TRIES:
                return
            self.listing_failures.pop(worker, None)
        try:
            self.down.discard(worker)
            self.retry_closes(worker)
            self.kv.report(worker, self.clients[worker].info(owner=self.owner)["free_blocks"])
        except Exception:
            self.down.add(worker)
            return
        log.info("attention worker %d is back", worker)
