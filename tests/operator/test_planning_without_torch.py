"""The operator plans without torch: its planning path (spec → model → plan_for, in-process and in PlanRunner's
child process) leaves torch unloaded in a fresh interpreter."""

import json
import subprocess
import sys

SCRIPT = """
import asyncio, json, sys
from expertmesh.operator.placement_policy import plan_for
from expertmesh.operator.planning import PlanRunner
from expertmesh.operator.spec import parse_spec, resolve_model

spec = parse_spec({
    "model": {"preset": "tiny", "checkpoint": {"pvc": {"claimName": "weights", "path": "/tiny"}}},
    "attentionWorkers": {"replicas": 1, "gpusPerPod": 0},
    "expertWorkers": {"replicas": 2, "gpusPerPod": 0, "reserveGiB": 0, "gpuMemoryGiB": 0.01},
})
cfg = resolve_model(spec)
here = plan_for(spec, cfg)


async def in_child():
    runner = PlanRunner(idle=0)
    try:
        plan = await runner.run(plan_for, spec, cfg)
        return plan, await runner.run(eval, "'torch' in __import__('sys').modules")
    finally:
        runner.close()


child_plan, child_torch = asyncio.run(in_child())
print(json.dumps({
    "shards": sum(len(g.shards) for w in here.workers for g in w.gpus),
    "same_plan": child_plan.plan_hash() == here.plan_hash(),
    "torch_here": "torch" in sys.modules,
    "torch_in_child": child_torch,
}))
"""


def test_operator_planning_loads_no_torch():
    out = subprocess.run([sys.executable, "-P", "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["shards"] >= 3 * 16 and got["same_plan"]  # a plan holding every (layer, expert) of tiny
    assert not got["torch_here"], "the operator's planning imported torch"
    assert not got["torch_in_child"], "the planning process imported torch"
