"""`spec.speculative {method, tokens}` (issue #52): its bounds in the spec and the generated CRD, the flags the operator
renders on the router and every attention pod (none on the expert pods), the KV the pools hold for the drafts, and
`method: mtp` refused (NoMTPLayers) for a model without an MTP layer — by the pure functions and by the operator
(Kopf for real against kmock)."""

from __future__ import annotations

import asyncio

import jsonschema
import pytest
from support.kopf_cluster import NS, eventually, operator, tiny_spec
from support.tiny_deployment import TINY_EXPERT_BYTES, by_kind_and_name, tiny

from expertmesh.model.config import preset
from expertmesh.operator import crd
from expertmesh.operator.children import build_children
from expertmesh.operator.naming import attention_name, expert_name, prefill_name, router_name
from expertmesh.operator.placement_policy import plan_for
from expertmesh.operator.pools import DECODE, MIXED, PREFILL, pool_kv
from expertmesh.operator.spec import API_VERSION, GIB, KIND, NoMTPLayers, SpecError, parse_spec, resolve_model

SPECULATIVE_FLAGS = ("--speculative-method", "--speculative-tokens")


def _with_mtp_config(spec: dict, layers: int = 1) -> dict:
    """`spec` serving the tiny model named by an inline config with `layers` MTP layers."""
    cfg = preset("tiny").model_dump(mode="json") | {"n_mtp_layers": layers}
    # the plan places the MTP layer's experts too: room for them on the expert pods
    experts = {**spec.get("expertWorkers", {}), "gpuMemoryGiB": (40 * TINY_EXPERT_BYTES + 10) / GIB}
    return {
        **spec,
        "expertWorkers": experts,
        "model": {"config": cfg, "checkpoint": {"uri": "/opt/expertmesh/checkpoints/tiny-mtp"}},
    }


def _kimi_k3(mtp_layers: int) -> dict:
    """A Hugging Face kimi_k3 wrapper config (as a checkpoint's config.json) with `num_nextn_predict_layers`."""
    text = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "hidden_act": "situ",
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 2,
        "moe_intermediate_size": 32,
        "routed_expert_hidden_size": 32,
        "first_k_dense_replace": 1,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "attn_res_block_size": 2,
        "linear_attn_config": {
            "full_attn_layers": [2, 4],
            "num_heads": 4,
            "head_dim": 16,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        "num_nextn_predict_layers": mtp_layers,
    }
    return {"model_type": "kimi_k3", "text_config": text}


def _args(children: list[dict]) -> dict[str, list[str]]:
    """Each workload's main container command line (args, or the expert's shell command)."""
    out = {}
    for c in children:
        if c["kind"] in ("StatefulSet", "Deployment"):
            container = c["spec"]["template"]["spec"]["containers"][0]
            out[c["metadata"]["name"]] = [*container.get("command", []), *container.get("args", [])]
    return out


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


# ------------------------------------------------------------------------------------------------ the spec
@pytest.mark.parametrize(
    "speculative, named",
    [
        ({"method": "eagle", "tokens": 3}, ["spec.speculative.method", "'mtp' or 'ngram'", "'eagle'"]),
        ({"method": "ngram", "tokens": 0}, ["spec.speculative.tokens", "greater than or equal to 1", "0"]),
        ({"method": "ngram", "tokens": 9}, ["spec.speculative.tokens", "less than or equal to 8", "9"]),
        ({"method": "ngram", "tokens": "three"}, ["spec.speculative.tokens", "'three'"]),
        ({"method": "ngram", "tokens": True}, ["spec.speculative.tokens"]),
        ({"tokens": 2}, ["spec.speculative.method", "Field required"]),
        ({"method": "ngram"}, ["spec.speculative.tokens", "Field required"]),
        ({"method": "ngram", "tokens": 2, "draftModel": "x"}, ["spec.speculative.draftModel", "Extra inputs"]),
    ],
)
def test_bad_speculative_values_are_refused_naming_the_field(speculative, named):
    with pytest.raises(SpecError) as e:
        parse_spec(tiny(speculative=speculative))
    assert type(e.value) is SpecError and e.value.reason == "InvalidSpec"
    missing = [n for n in named if n not in str(e.value)]
    assert not missing, f"{e.value} does not name {missing}"


def test_absent_is_off_and_good_values_parse():
    assert parse_spec(tiny()).speculative is None
    s = parse_spec(tiny(speculative={"method": "ngram", "tokens": 8})).speculative
    assert (s.method, s.tokens) == ("ngram", 8)
    assert parse_spec(tiny(speculative={"method": "ngram", "tokens": 1})).to_yaml_dict()["speculative"] == {
        "method": "ngram",
        "tokens": 1,
    }


def test_mtp_needs_an_mtp_layer_in_the_model():
    """The operator knows the model from the spec (a preset, or an inline config as in a checkpoint's config.json):
    mtp without an MTP layer is NoMTPLayers naming the field, the model and the checkpoint; ngram needs no weights."""
    with pytest.raises(NoMTPLayers) as e:
        resolve_model(parse_spec(tiny(speculative={"method": "mtp", "tokens": 2})))
    assert e.value.reason == "NoMTPLayers"
    for needle in ("spec.speculative.method=mtp", "preset 'tiny'", "pvc weights:/ckpt/tiny", "no MTP layer", "ngram"):
        assert needle in str(e.value), str(e.value)
    assert resolve_model(parse_spec(tiny(speculative={"method": "ngram", "tokens": 2}))).n_mtp_layers == 0

    # an inline config with an MTP layer: accepted; without: refused, naming the config and the checkpoint
    assert resolve_model(parse_spec(_with_mtp_config(tiny(speculative={"method": "mtp", "tokens": 3})))).n_mtp_layers
    with pytest.raises(NoMTPLayers, match=r"spec\.model\.config \('tiny'\), checkpoint /opt/expertmesh/checkpoints"):
        resolve_model(parse_spec(_with_mtp_config(tiny(speculative={"method": "mtp", "tokens": 3}), layers=0)))

    # a Hugging Face kimi_k3 config: its num_nextn_predict_layers decides
    k3 = {**tiny(speculative={"method": "mtp", "tokens": 2}), "model": {"checkpoint": {"uri": "hf://org/k3-tiny"}}}
    k3["model"]["config"] = _kimi_k3(1)
    assert resolve_model(parse_spec(k3)).n_mtp_layers == 1
    k3["model"]["config"] = _kimi_k3(0)
    with pytest.raises(NoMTPLayers, match=r"checkpoint hf://org/k3-tiny\) has no MTP layer"):
        resolve_model(parse_spec(k3))


# ------------------------------------------------------------------------------------------------ the CRD
def _crd_schema() -> dict:
    return crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize(
    "speculative, ok",
    [
        (None, True),
        ({"method": "mtp", "tokens": 1}, True),
        ({"method": "ngram", "tokens": 8}, True),
        ({"method": "eagle", "tokens": 2}, False),
        ({"method": "ngram", "tokens": 0}, False),
        ({"method": "ngram", "tokens": 9}, False),
        ({"method": "ngram", "tokens": "2"}, False),
        ({"tokens": 2}, False),
        ({"method": "ngram"}, False),
    ],
)
def test_the_crd_accepts_and_refuses_what_the_spec_does(speculative, ok):
    """The API server's view (the generated CRD's OpenAPI v3 schema, draft-4 semantics) agrees with the operator's."""
    spec = tiny() if speculative is None else tiny(speculative=speculative)
    body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "kimi"}, "spec": spec}
    errors = list(jsonschema.Draft4Validator(_crd_schema()).iter_errors(body))
    assert (not errors) == ok, [e.message for e in errors]
    if ok:
        parse_spec(spec)
    else:
        assert all(list(e.path)[:2] == ["spec", "speculative"] for e in errors), [list(e.path) for e in errors]
        with pytest.raises(SpecError, match=r"spec\.speculative"):
            parse_spec(spec)
    committed = crd.DEFAULT_PATH.read_text()
    assert "speculative:" in committed and committed == crd.render()  # regenerated with the field


# ------------------------------------------------------------------------------------------------ rendering
@pytest.mark.parametrize("method, tokens", [("ngram", 4), ("mtp", 2)])
def test_the_flags_are_on_the_router_and_every_attention_pod_only(method, tokens):
    """Both attention pools (prefill and decode) and the router get the same flags; the expert pods none."""
    raw = tiny(speculative={"method": method, "tokens": tokens}, prefillWorkers={"replicas": 1, "gpusPerPod": 0})
    spec = parse_spec(_with_mtp_config(raw) if method == "mtp" else raw)
    cfg = resolve_model(spec)
    args = _args(build_children("kimi", NS, spec, cfg, plan_for(spec, cfg)))
    speculating = (router_name("kimi"), attention_name("kimi"), prefill_name("kimi"))
    assert sorted(args) == sorted([*speculating, expert_name("kimi")])
    for name in speculating:
        assert (_flag(args[name], "--speculative-method"), _flag(args[name], "--speculative-tokens")) == (
            method,
            str(tokens),
        ), name
    assert not any(f in " ".join(args[expert_name("kimi")]) for f in SPECULATIVE_FLAGS)


def test_no_speculative_flags_when_absent_and_the_children_are_unchanged(tiny_plan):
    spec, cfg, plan = tiny_plan
    args = _args(build_children("kimi", NS, spec, cfg, plan))
    assert not any(f in a for a in args.values() for f in SPECULATIVE_FLAGS)


def test_kv_holds_the_drafted_positions():
    """Each running sequence may hold K drafted positions past its last token: S = ceil((context + K) / blockSize)."""
    assert pool_kv(MIXED, max_context=64, block_size=16).blocks == 4
    assert pool_kv(MIXED, max_context=64, block_size=16, speculative_tokens=1).blocks == 5
    assert pool_kv(DECODE, max_context=60, block_size=16, speculative_tokens=4).blocks == 4  # 64: still 4 pages
    assert pool_kv(PREFILL, max_context=64, block_size=16, speculative_tokens=8).blocks == 2 * 5
    with pytest.raises(ValueError, match="speculative_tokens"):
        pool_kv(MIXED, max_context=64, block_size=16, speculative_tokens=-1)
    spec = parse_spec(tiny(kv={"maxContext": 64, "blockSize": 16}, speculative={"method": "ngram", "tokens": 3}))
    cfg = resolve_model(spec)
    by = by_kind_and_name(build_children("kimi", NS, spec, cfg, plan_for(spec, cfg)))
    att = by[("StatefulSet", attention_name("kimi"))]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert _flag(att, "--kv-blocks") == "5"  # ceil((64 + 3) / 16)


# ------------------------------------------------------------------------------------------------ Kopf, for real
@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_the_operator_refuses_mtp_without_mtp_layers_then_deploys_ngram():
    async with operator() as c:
        await c.create_moe("kimi", {**tiny_spec(), "speculative": {"method": "mtp", "tokens": 3}})
        await eventually(lambda: c.status("kimi").get("phase") == "Failed", what="refused")
        cond = c.condition("kimi", "PlacementReady")
        assert (cond["status"], cond["reason"]) == ("False", "NoMTPLayers"), cond
        assert "spec.speculative.method=mtp" in cond["message"] and "pvc weights:/tiny" in cond["message"]
        assert "spec.speculative.method=mtp" in c.status("kimi")["message"]
        await asyncio.sleep(0.5)  # a retrying handler would write within this
        assert c.get("apps/v1/statefulsets", attention_name("kimi")) is None
        assert c.get("apps/v1/deployments", router_name("kimi")) is None

        # a bad value (the API server would refuse it; the operator does too, for resources made before the bound)
        await c.patch_moe("kimi", {"spec": {"speculative": {"method": "ngram", "tokens": 0}}})
        await eventually(lambda: c.status("kimi").get("observedGeneration") == 2, what="generation 2 handled")
        cond = c.condition("kimi", "PlacementReady")
        assert cond["reason"] == "InvalidSpec" and "spec.speculative.tokens" in cond["message"], cond

        # ngram needs no weights: deployed, the flags on the router and the attention pods, none on the experts
        await c.patch_moe("kimi", {"spec": {"speculative": {"method": "ngram", "tokens": 4}}})
        await eventually(lambda: c.status("kimi").get("phase") == "Deploying", what="Deploying", timeout=30)
        assert c.condition("kimi", "PlacementReady")["reason"] == "Planned"
        assert (c.router_arg("kimi", "--speculative-method"), c.router_arg("kimi", "--speculative-tokens")) == (
            "ngram",
            "4",
        )
        att = c.get("apps/v1/statefulsets", attention_name("kimi"))["spec"]["template"]["spec"]["containers"][0]
        assert (_flag(att["args"], "--speculative-method"), _flag(att["args"], "--speculative-tokens")) == (
            "ngram",
            "4",
        )
        exp = c.get("apps/v1/statefulsets", expert_name("kimi"))["spec"]["template"]["spec"]["containers"][0]
        assert not any(f in " ".join(exp["command"] + exp.get("args", [])) for f in SPECULATIVE_FLAGS)

        # speculation off again: the flags go (the router and attention pods roll)
        await c.patch_moe("kimi", {"spec": {"speculative": None}})
        await eventually(lambda: c.router_arg("kimi", "--speculative-method") is None, what="flags removed")


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_the_operator_deploys_mtp_for_a_model_with_an_mtp_layer():
    async with operator() as c:
        await c.create_moe("kimi", _with_mtp_config({**tiny_spec(), "speculative": {"method": "mtp", "tokens": 2}}))
        await eventually(lambda: c.status("kimi").get("phase") == "Deploying", what="Deploying", timeout=30)
        assert c.router_arg("kimi", "--speculative-method") == "mtp"
        assert c.router_arg("kimi", "--speculative-tokens") == "2"
