"""Speculative decoding over real processes (#52): `LocalCluster` (what `expertmesh up` runs) with a prefill pool
handing each sequence to a decode pool, attention workers drafting with the MTP layer — whose routed experts the
plan places on the expert workers, reached over gRPC like any layer's — give the greedy tokens of a plain in-process
deployment, and the router's metrics show drafts verified and accepted."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from support.k3_checkpoint import write_k3_checkpoint
from support.router_client import EOS, grpc_generate

from expertmesh.entry.cluster import LocalCluster, free_port
from expertmesh.entry.local import build_local_engine
from expertmesh.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
PROMPTS = [[5, 17, 42, 99, 17, 42, 7, 3, 250, 61, 17, 42], [9, 8, 7, 6, 5, 4, 3], [300, 301, 302, 300, 301]]
N_TOKENS = 20


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.timeout(900)  # five processes starting on a shared machine
def test_mtp_speculation_over_grpc_workers_with_a_prefill_hand_off_matches_plain(tmp_path):
    ckpt = write_k3_checkpoint(tmp_path / "k3", mtp=True)
    plain = build_local_engine(str(ckpt))
    try:
        params = SamplingParams(max_tokens=N_TOKENS, stop_token_ids=(EOS,))
        want = [plain.generate(p, params, timeout=300).output for p in PROMPTS]
    finally:
        plain.close()
    grpc_port = free_port()
    cluster = LocalCluster(
        ckpt,
        attention_workers=1,
        prefill_workers=1,
        expert_workers=2,
        http_port=free_port(),
        grpc_port=grpc_port,
        speculative_method="mtp",
        speculative_tokens=2,
    )
    try:
        cluster.start(timeout=600)  # five processes: a shared machine's start-up can be slow
        with ThreadPoolExecutor(3) as pool:
            got = [t for t, _ in pool.map(lambda p: grpc_generate(f"127.0.0.1:{grpc_port}", p, N_TOKENS), PROMPTS)]
        text = httpx.get(cluster.http_url + "/metrics").text
    finally:
        cluster.stop()
    assert got == want
    assert metric(text, "expertmesh_spec_draft_tokens_total") > 0  # the decode pool verified drafts after the hand-off
    assert metric(text, "expertmesh_spec_verify_steps_total") > 0
