"""The operator and the router cannot drift apart (issue #56): every flag the operator renders on the router's command
line — across the spec's features, the gateway's endpoint picker among them — is one the router's own command-line
parser defines, spelled in full (argparse would also take an abbreviation, which a later router flag could make
ambiguous), and the whole command parses as `expertmesh router` parses it in the pod. `expertmesh router --help`, run
as a process, lists the picker's flags."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.tiny_deployment import by_kind_and_name, tiny

from expertmesh.operator.children import build_children
from expertmesh.operator.naming import router_name
from expertmesh.operator.placement_policy import plan_for
from expertmesh.operator.spec import parse_spec, resolve_model

# each spec turns on features that add router flags; together they cover every flag the operator renders
SPECS = {
    "defaults": {},
    "gateway": {"gateway": {"inferencePool": True, "eppPort": 9100}, "router": {"replicas": 3, "httpPort": 8080}},
    "pools": {"prefillWorkers": {"replicas": 2, "minPromptTokens": 64}, "kv": {"hostGiB": 1, "maxContext": 1024}},
    "serving": {"speculative": {"method": "ngram", "tokens": 3}, "thinking": {"low": 3, "high": 5, "max": 7}},
    "collective": {"transport": "collective", "security": {"workerTls": False}},
    "leaderworkerset": {"workload": "leaderworkerset", "gateway": {"inferencePool": True}},
}


def _router_command(over: dict) -> tuple[list[str], list[str]]:
    spec = parse_spec(tiny(**over))
    cfg = resolve_model(spec)
    children = by_kind_and_name(build_children("kimi", "serving", spec, cfg, plan_for(spec, cfg)))
    container = children[("Deployment", router_name("kimi"))]["spec"]["template"]["spec"]["containers"][0]
    return container["command"], container["args"]


def _router_parser():
    """The `router` subcommand's parser of the real `expertmesh` command line (what the pod runs)."""
    from expertmesh.entry.cli import build_parser

    top = build_parser()
    sub = next(a for a in top._actions if a.__class__.__name__ == "_SubParsersAction")
    return top, sub.choices["router"]


@pytest.mark.parametrize("case", sorted(SPECS))
def test_every_rendered_router_flag_is_the_routers_own(case):
    command, args = _router_command(SPECS[case])
    assert command == ["expertmesh"] and args[0] == "router"
    top, router = _router_parser()
    known = {s for action in router._actions for s in action.option_strings}
    rendered = [a for a in args[1:] if a.startswith("--")]
    assert rendered and not [f for f in rendered if f not in known], f"flags the router does not define: {case}"
    parsed = top.parse_args(args)  # the whole command, as `expertmesh router ...` parses it
    assert parsed.func.__module__ == "expertmesh.router.server"


def test_the_gateway_case_carries_the_pickers_flags():
    """The case list above really exercises the picker's flags (and the other features' ones)."""
    rendered = {a for over in SPECS.values() for a in _router_command(over)[1] if a.startswith("--")}
    for flag in (
        "--epp-port",
        "--epp-replicas",
        "--prefill",
        "--prefill-min-tokens",
        "--max-context",
        "--thinking-budgets",
        "--speculative-method",
        "--worker-tls-ca",
        "--transport",
        "--prefix-salt-file",
    ):
        assert flag in rendered, flag
    top, _ = _router_parser()
    parsed = top.parse_args(_router_command(SPECS["gateway"])[1])
    assert (parsed.epp_port, parsed.epp_replicas) == (9100, "kimi-router-headless.serving.svc:8080")


def test_expertmesh_router_help_lists_the_picker_flags():
    exe = Path(sys.executable).with_name("expertmesh")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "expertmesh.entry.cli"]
    out = subprocess.run([*cmd, "router", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--epp-port PORT" in out.stdout and "--epp-replicas HOST:PORT,..." in out.stdout
