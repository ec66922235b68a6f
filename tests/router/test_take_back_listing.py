"""A worker taken back after a missed step is listed before a request is placed on it (router/health.py): while
its prefix listing fails (it is still busy with the step it missed) it stays down and is asked again at the next
heartbeat, so a replay is not placed where the router knows none of the prefixes the worker holds; after
LISTING_TRIES failures in a row it is back without the listing."""

from expertmesh.router.health import LISTING_TRIES, AttentionHealth
from expertmesh.router.kv import KVManager, WorkerKV


class BusyWorker:
    """An attention worker's client whose prefix listing times out the first `busy` times it is asked."""

    def __init__(self, busy: int):
        self.busy, self.asked = busy, 0

    def list_prefixes(self):
        self.asked += 1
        if self.asked <= self.busy:
            raise TimeoutError("the step lock is held")
        return []

    def info(self, owner: str = ""):
        return {"free_blocks": 64, "experts_down": []}


def _health(client) -> AttentionHealth:
    kv = KVManager([WorkerKV(0, 16, 64, 64)], chunk=16)
    health = AttentionHealth([client], kv, owner="r", interval=1.0, connect=lambda i: None)
    health.mark_down(0, TimeoutError("no step result"))
    return health


def test_a_worker_whose_listing_fails_stays_down_until_it_answers():
    client = BusyWorker(busy=2)
    health = _health(client)
    for attempt in range(2):
        health._take_back(0)
        assert 0 in health.down, f"taken back after failed listing {attempt + 1}"
    health._take_back(0)
    assert 0 not in health.down and client.asked == 3


def test_a_worker_that_never_lists_is_back_after_the_tries():
    client = BusyWorker(busy=10**6)
    health = _health(client)
    for _ in range(LISTING_TRIES - 1):
        health._take_back(0)
        assert 0 in health.down
    health._take_back(0)
    assert 0 not in health.down and client.asked == LISTING_TRIES
