"""`expertmesh plan`: offline expert placement for a preset and a cluster shape.

    expertmesh plan --preset full-2.8t --expert-pods 16 --gpus-per-pod 8 --gpu-memory-gib 141 \\
        [--reserve-gib X] [--redundant-experts R] [--loads FILE.npy|FILE.json] [--previous PLAN.json] [--json OUT]

Prints, side by side, the plans without and with the R redundant slots per layer, made for uniform loads and for
the given loads (or Zipf-skewed synthetic ones): shards and bytes per GPU, physical vs logical experts, replicas,
the expected imbalance of each under both loads, and the planning time. `--json` writes the plan for the given
loads (uniform without `--loads`) with R redundant slots. A cluster too small exits 2 with the reason on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from expertmesh.model.config import PRESET_NAMES, preset
from expertmesh.placement.plan import PlacementPlan
from expertmesh.placement.planner import (
    ClusterShape,
    PlanError,
    imbalance,
    placed_layers,
    plan_placement,
    zipf_loads,
)
from expertmesh.placement.sizing import attention_memory, plan_expert_memory
from expertmesh.runtime.argtypes import nonnegative_float, nonnegative_int, positive_float, positive_int

GIB = 2**30


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=PRESET_NAMES, default="full-2.8t", help="model preset (default full-2.8t)")
    p.add_argument("--expert-pods", type=positive_int, metavar="N", help="expert worker pods (required without --slo)")
    p.add_argument("--gpus-per-pod", type=positive_int, default=8, metavar="G", help="GPUs per expert pod (default 8)")
    p.add_argument(
        "--gpu-memory-gib", type=positive_float, default=141.0, metavar="GIB", help="memory per GPU (default 141)"
    )
    p.add_argument(
        "--reserve-gib",
        type=nonnegative_float,
        default=0.0,
        metavar="GIB",
        help="per-GPU memory kept for activations and buffers, not experts (default 0)",
    )
    p.add_argument(
        "--redundant-experts",
        type=nonnegative_int,
        default=0,
        metavar="R",
        help="redundant expert slots per layer, all pods together (default 0)",
    )
    p.add_argument(
        "--loads", type=Path, metavar="FILE", help="tokens per (MoE layer, expert): .npy or .json [layers][experts]"
    )
    p.add_argument("--zipf-s", type=float, default=1.1, help="Zipf exponent of the synthetic skew without --loads")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the synthetic skew")
    p.add_argument("--previous", type=Path, metavar="PLAN", help="plan in force: report (and minimise) moved shards")
    p.add_argument(
        "--group-aware",
        action="store_true",
        help="each combine group's experts on one pod (less combine traffic; see plan_placement)",
    )
    p.add_argument("--json", type=Path, metavar="OUT", help="write the plan (given loads, R redundant) as JSON")
    p.add_argument(
        "--mtp-layers",
        type=nonnegative_int,
        default=0,
        metavar="N",
        help="place the experts of the model's N MTP layers too (speculative decoding with --speculative-method "
        "mtp; Kimi K3 ships 1); default 0",
    )

    slo = p.add_argument_group("sizing for an SLO (--slo): the smallest layout the forecast says meets it")
    slo.add_argument("--slo", metavar="ttft=S,tpot=MS", help="TTFT in seconds and TPOT in milliseconds to meet")
    slo.add_argument("--gpu", default="h200", help="GPU type for --slo (expertmesh predict's; default h200)")
    slo.add_argument("--input-len", type=positive_int, default=8192, metavar="N", help="prompt tokens (default 8192)")
    slo.add_argument("--output-len", type=positive_int, default=1024, metavar="N", help="output tokens (default 1024)")
    slo.add_argument("--weights", default="mxfp4", help="routed experts' dtype for --slo (default mxfp4)")
    slo.add_argument("--write-deployment", type=Path, metavar="FILE", help="write the proposal as a MoEDeployment")
    slo.add_argument("--name", default="kimi", help="the written MoEDeployment's name (default kimi)")


def run_slo(args) -> int:
    """`plan --slo`: the smallest layout meeting the SLO, printed, and optionally written as a MoEDeployment."""
    from expertmesh.forecast.predict import Workload
    from expertmesh.operator.forecast import deployment_manifest, forecast_summary, parse_slo, propose

    try:
        proposal = propose(
            args.preset, args.gpu, parse_slo(args.slo), Workload(args.input_len, args.output_len), args.weights
        )
    except ValueError as e:
        print(f"expertmesh plan: {e}", file=sys.stderr)
        return 2
    lay = proposal.layout
    attention = "DP attention" if lay.dp_attention else f"TP {lay.tp} attention"
    pools = f", prefill pool {lay.prefill_gpus} + decode pool {lay.decode_gpus} GPUs" if lay.prefill_gpus else ""
    print(
        f"expertmesh plan --slo {args.slo}: {args.preset} on {proposal.nodes} {args.gpu} node(s), {lay.gpus} GPUs, "
        f"{attention}, experts wide over each pool{pools}"
    )
    for key, value in forecast_summary(proposal).items():
        print(f"  {key}: {value}")
    if args.write_deployment is not None:
        import yaml

        manifest = deployment_manifest(args.name, args.preset, proposal, weights=args.weights)
        args.write_deployment.parent.mkdir(parents=True, exist_ok=True)
        args.write_deployment.write_text(yaml.safe_dump(manifest, sort_keys=False))
        print(f"wrote MoEDeployment {args.name} to {args.write_deployment}")
    return 0


def read_loads(path: Path) -> np.ndarray:
    """A loads file: .npy (any numeric array) or .json (nested lists [layers][experts])."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            return np.load(path, allow_pickle=False)
        if suffix == ".json":
            return np.asarray(json.loads(path.read_text()), dtype=np.float64)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"--loads {path}: cannot read it ({e})") from None
    raise ValueError(f"--loads {path}: expected a .npy or .json file, found {suffix or 'no suffix'}")


def _fmt(x: float, digits: int = 3) -> str:
    return f"{x:,.{digits}f}"


def _unit(n_bytes: float) -> tuple[str, int]:
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= size:
            return unit, size
    return "B", 1


def run(args) -> int:
    if args.slo:
        return run_slo(args)
    if args.expert_pods is None:
        print("expertmesh plan: --expert-pods N is required (or --slo to size for an SLO)", file=sys.stderr)
        return 2
    try:
        cfg = preset(args.preset)
        mtp = args.mtp_layers > 0
        if mtp:  # the presets carry the main layers; K3 checkpoints add num_nextn_predict_layers MTP layers
            cfg = cfg.model_copy(update={"n_mtp_layers": args.mtp_layers})
        n_placed = len(placed_layers(cfg, mtp))
        shape = ClusterShape(
            pods=args.expert_pods,
            gpus_per_pod=args.gpus_per_pod,
            gpu_memory_bytes=int(args.gpu_memory_gib * GIB),
            reserve_bytes=int(args.reserve_gib * GIB),
        )
        if args.loads is not None:
            skewed, skew_name = read_loads(args.loads), "given loads"
        else:
            skewed, skew_name = zipf_loads(cfg, s=args.zipf_s, seed=args.seed), f"zipf s={args.zipf_s:g}"
            if mtp:  # the MTP layers' rows skewed as the others'
                extra = zipf_loads(cfg, s=args.zipf_s, seed=args.seed + 1)[: n_placed - cfg.n_moe_layers]
                skewed = np.vstack([skewed, extra])
        previous = None
        if args.previous is not None:
            try:
                previous = PlacementPlan.from_json(args.previous.read_text())
            except OSError as e:
                raise ValueError(f"--previous {args.previous}: cannot read it ({e})") from None
        uniform = np.ones((n_placed, cfg.moe.n_routed_experts))
        R = args.redundant_experts
        columns = [("uniform", None, 0), (skew_name, skewed, 0)]
        if R > 0:
            columns = [("uniform", None, 0), ("uniform", None, R), (skew_name, skewed, 0), (skew_name, skewed, R)]
        results = []
        for name, loads, r in columns:
            t0 = time.perf_counter()
            plan = plan_placement(
                cfg, shape, redundant_slots=r, loads=loads, previous=previous, group_aware=args.group_aware, mtp=mtp
            )
            seconds = time.perf_counter() - t0
            results.append((f"{name}, r={r}", plan, seconds, imbalance(plan, uniform), imbalance(plan, skewed)))
    except PlanError as e:
        print(f"expertmesh plan: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"expertmesh plan: {e}", file=sys.stderr)
        return 2

    main = results[-1 if args.loads is not None else (1 if R > 0 else 0)]
    B = cfg.expert_bytes_mxfp4
    print(
        f"expertmesh plan: {cfg.name} ({n_placed} MoE layers{' with MTP' if mtp else ''} x "
        f"{cfg.moe.n_routed_experts} experts, "
        f"{B / _unit(B)[1]:,.1f} {_unit(B)[0]} each in MXFP4) on {shape.pods} pods x {shape.gpus_per_pod} GPUs x "
        f"{args.gpu_memory_gib:g} GiB (reserve {args.reserve_gib:g} GiB/GPU: {main[1].figures.slots_per_gpu:,} "
        f"expert slots/GPU)"
    )
    rows: list[tuple[str, list[str]]] = []

    def row(label, fn):
        rows.append((label, [fn(res) for res in results]))

    row("logical experts", lambda res: f"{res[1].figures.logical_experts:,}")
    row("physical experts", lambda res: f"{res[1].figures.physical_experts:,}")
    row(
        "redundant / layer (asked)",
        lambda res: f"{res[1].figures.redundant_per_layer} ({res[1].figures.redundant_requested})",
    )
    row("max replicas of an expert", lambda res: f"{int(res[1].replica_counts().max())}")
    row(
        "shards/GPU min/mean/max",
        lambda res: (
            f"{res[1].figures.shards_per_gpu_min}/"
            f"{res[1].figures.shards_per_gpu_mean:.1f}/{res[1].figures.shards_per_gpu_max}"
        ),
    )
    unit, size = _unit(max(res[1].figures.bytes_per_gpu_max for res in results))
    row(
        f"{unit}/GPU min/mean/max",
        lambda res: (
            f"{res[1].figures.bytes_per_gpu_min / size:.2f}/"
            f"{res[1].figures.bytes_per_gpu_mean / size:.2f}/"
            f"{res[1].figures.bytes_per_gpu_max / size:.2f}"
        ),
    )
    row("imbalance uniform (mean/worst)", lambda res: f"{_fmt(res[3].mean)}/{_fmt(res[3].worst)}")
    row(f"imbalance {skew_name} (mean/worst)", lambda res: f"{_fmt(res[4].mean)}/{_fmt(res[4].worst)}")
    if previous is not None:
        row("moved shards (vs --previous)", lambda res: f"{res[1].figures.moved_shards:,}")
    row("planning time (ms)", lambda res: f"{res[2] * 1000:.0f}")
    headers = [res[0] + (" *" if res is main and args.json else "") for res in results]
    width0 = max(len(label) for label, _ in rows)
    widths = [max(len(h), *(len(cells[i]) for _, cells in rows)) for i, h in enumerate(headers)]
    print(f"{'plan (loads, redundant/layer)':<{width0}}  " + "  ".join(f"{h:>{w}}" for h, w in zip(headers, widths)))
    print("-" * width0 + "  " + "  ".join("-" * w for w in widths))
    for label, cells in rows:
        print(f"{label:<{width0}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    print("imbalance = max/mean of per-GPU load per layer (tokens split evenly over replicas); mean/worst over layers")
    plan = main[1]
    worst = max(range(plan.cluster.pods), key=lambda o: plan.workers[o].bytes)
    em = plan_expert_memory(cfg, plan, worst)
    am = attention_memory(cfg, kv_blocks=0, block_size=16)
    print(
        f"resident per device (as `expertmesh worker --device meta --dry-run` reports): expert worker {worst} "
        f"max {max(em.devices.values()) / GIB:.2f} GiB (weights {em.weights_bytes / GIB:.2f} GiB over "
        f"{len(em.devices)} devices, workspace {em.workspace_bytes / GIB:.2f} GiB); attention worker weights "
        f"{am.weights_bytes / GIB:.2f} GiB bf16 + workspace {am.workspace_bytes / GIB:.2f} GiB before KV"
    )
    notes = [(res[0], n) for res in results for n in res[1].notes]
    for name, note in notes:
        print(f"note ({name}): {note}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(main[1].to_json())
        print(f"wrote plan {main[1].plan_hash()} ({main[0]}) to {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="expertmesh plan", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
