"""Workers load their C++ CPU kernels when they start, not on their first request (kernels/cpu_warmup.py): a
fresh process that builds an attention worker and an expert worker has every kernel loaded before any step."""

import json
import os
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import json, sys
    from expertmesh.kernels.dsa import cpu_kernel as dsa
    from expertmesh.kernels.linear import cpu_kernel as linear
    from expertmesh.kernels.moe import cpu_kernel as moe
    from expertmesh.kernels.norm import cpu_kernel as norm
    from expertmesh.worker.attention import AttentionWorker
    from expertmesh.worker.expert import ExpertWorker
    before = {"linear": linear.EXTENSION._tried, "norm": norm.EXTENSION._tried, "dsa": dsa.EXTENSION._tried,
              "dense": dsa.DENSE_EXTENSION._tried, "mxfp4": moe._tried}
    AttentionWorker(sys.argv[1], kv_blocks=8)
    attention = {"linear": linear.EXTENSION.ops is not None, "norm": norm.EXTENSION.ops is not None,
                 "dsa": dsa.EXTENSION.ops is not None, "dense": dsa.DENSE_EXTENSION._tried, "mxfp4": moe._tried}
    ExpertWorker(sys.argv[1], [(1, 0)])
    print(json.dumps({"before": before, "attention": attention, "expert": moe._ops is not None}))
""")


def test_workers_load_their_cpu_kernels_before_the_first_request(tiny_checkpoint_dir):
    ckpt = tiny_checkpoint_dir
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE, str(ckpt)], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert not any(seen["before"].values()), seen  # importing loads nothing
    assert seen["attention"] == {"linear": True, "norm": True, "dsa": True, "dense": True, "mxfp4": False}, seen
    assert seen["expert"] is True
