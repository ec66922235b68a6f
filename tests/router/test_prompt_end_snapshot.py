"""A resent prompt (a retry, a regenerate, a second sample) hits the snapshot at its prompt's end after it was
demoted (issue #53, item 5): KDA state cannot be cut back, so the prompt + answer snapshot is of no use to it, and the
prompt-end one must not be dropped as "superseded". Only the granules between a turn's prompt end and its answer end
are dropped."""

import random

import pytest

from expertmesh.entry.local import build_local_engine
from expertmesh.router.eviction import PrefixInfo, eviction_order
from expertmesh.router.kv import KVManager, WorkerKV, prefix_hashes
from expertmesh.wire.sampling_params import SamplingParams

CHUNK = 64
MIB = 2**20


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint  # the session's shared tiny checkpoint (tests/conftest.py): KDA + DSA layers


def test_the_user_scenario_a_resent_301_token_prompt_hits_its_prompt_end_snapshot_from_disk(ckpt, tmp_path):
    """The issue's run: a 301-token prompt answered with 20 tokens (snapshots at 256 = prompt end, 320 = answer
    end), pushed down to the disk tier by 8 other prompts, then sent again → 256 tokens cached, restored from disk,
    the same greedy answer."""
    rng = random.Random(53)
    prompts = [[rng.randrange(256) for _ in range(301)] for _ in range(9)]
    eng = build_local_engine(
        ckpt,
        prefill_chunk=CHUNK,
        kv_blocks=48,
        kv_growth=16,
        kv_tiers={"kv_disk_dir": str(tmp_path / "disk"), "kv_disk_bytes": 256 * MIB},
    )
    try:
        params = SamplingParams(max_tokens=20)
        first = eng.generate(prompts[0], params)
        for p in prompts[1:]:
            eng.generate(p, params)
        w = eng.attention[0]._client
        keys = dict(prefix_hashes(prompts[0] + first.output, CHUNK, eng.kv.salt))
        assert keys[320] not in w.prefixes and w.tiers.tier_of(keys[320]) == "disk", "pushed down to disk"
        again = eng.generate(prompts[0], params)
        assert again.cached_tokens == 256, "the prompt-end snapshot was kept and restored"
        assert again.output == first.output
        assert w.tiers.stats["disk"].restores >= 1
        # a prompt that reaches the answer's granule hits the answer-end snapshot as before
        longer = prompts[0] + first.output + [rng.randrange(256) for _ in range(10)]
        assert len(longer) == 331 and eng.generate(longer, SamplingParams(max_tokens=2)).cached_tokens == 320
    finally:
        eng.close()


def kv_with_a_turn() -> KVManager:
    """One worker; a turn whose prompt ends at 256 (its prompt-end snapshot) and whose answer reaches 320, saved
    as the router saves them: each key extending the previous one."""
    kv = KVManager([WorkerKV(0, 16, 100, 100)], CHUNK)
    parent = None
    for length in (64, 128, 192, 256, 320):
        kv.record_prefix(0, f"k{length}", length, parent=parent, prompt_end=length == 256)
        parent = f"k{length}"
    return kv


def test_only_the_granules_between_a_prompt_end_and_its_answer_end_are_superseded():
    kv = kv_with_a_turn()
    assert [k for k in ("k64", "k128", "k192", "k256", "k320") if kv.superseded(k)] == ["k64", "k128", "k192"]
    order = kv.victims(0)
    assert order[:3] == ["k64", "k128", "k192"]  # dropped first
    assert set(order[3:]) == {"k256", "k320"}  # then demoted, by their session's class
    # a second turn extends the first's answer: the first turn's answer end is now a granule between; its prompt
    # end stays a retry point
    kv.record_prefix(0, "k384", 384, parent="k320")
    kv.record_prefix(0, "k448", 448, parent="k384", prompt_end=True)
    kv.record_prefix(0, "k512", 512, parent="k448")
    assert not kv.superseded("k256") and not kv.superseded("k448") and not kv.superseded("k512")
    assert kv.superseded("k320") and kv.superseded("k384")
    kv.forget("k256")
    assert "k256" not in kv.prompt_ends


def test_a_prompt_end_key_recorded_again_without_the_mark_keeps_it():
    """A later save of the same key (a hit that reached it again) never unmarks it; a listing learnt from a worker
    neither."""
    kv = kv_with_a_turn()
    kv.record_prefix(0, "k256", 256, parent="k192")
    kv.learn(0, [("k256", 256, "disk")], known={"k256"})
    assert "k256" in kv.prompt_ends and not kv.superseded("k256")


def test_eviction_order_drops_superseded_first_and_demotes_the_rest():
    infos = [
        PrefixInfo("end", 256, 1, superseded=False, session="answered"),
        PrefixInfo("mid", 192, 0, superseded=True, session="answered"),
    ]
    assert [(v.key, v.demote) for v in eviction_order(infos)] == [("mid", False), ("end", True)]
