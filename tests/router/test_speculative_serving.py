"""Speculative decoding through the serving data path (#52): the router's engine over attention workers that
verify drafts (worker/speculation.py), in process (expertmesh/entry/local.py). Greedy output — tokens, log-probs,
finish reasons — is the same with and without speculation: the MTP drafter on tiny random K3 and K3+DSA checkpoints
with an MTP layer and on models/k3-tiny, 16 streams at once, the n-gram drafter, an oracle drafter whose drafts are
accepted (stop token, max_tokens and a forced rejection at every draft position inside accepted runs), and chat
requests with thinking, a JSON schema, tool_choice, stop strings and n=2 over HTTP with the official client. A
router and workers that disagree on K refuse to start; a worker asked for MTP drafts on a checkpoint without an MTP
layer refuses naming the flag."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from support.k3_checkpoint import write_k3_checkpoint
from support.paths import REPO

from expertmesh.chat.load import load_chat
from expertmesh.chat.thinking import ThinkingBudgets
from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.entry.cluster import free_port
from expertmesh.entry.local import build_local_engine
from expertmesh.router.engine import Engine
from expertmesh.router.engine_config import EngineConfig
from expertmesh.router.http import build_app, serve_http
from expertmesh.wire.sampling_params import SamplingParams
from expertmesh.wire.worker_api import WorkerError
from expertmesh.worker import cli as worker_cli
from expertmesh.worker.attention import AttentionWorker

PROMPTS = [[5, 17, 42, 99, 17, 42, 7, 3, 250, 61, 17, 42], [9, 8, 7, 6, 5, 4, 3], [300, 301, 302, 300, 301]]
GREEDY = SamplingParams(max_tokens=24, logprobs=2)


class OracleDrafter:
    """Drafts the plain run's own continuation of the context (a known sequence it starts, else one its last 8
    tokens occur in), with a wrong token at draft position `wrong_at` (None: never)."""

    def __init__(self, vocab: int):
        self.known: list[list[int]] = []
        self.vocab, self.wrong_at = vocab, None

    def propose(self, k, context):
        follow = None
        for seq in self.known:
            if len(seq) > len(context) and seq[: len(context)] == context:
                follow = seq[len(context) : len(context) + k]
                break
        if follow is None:
            tail = context[-8:]
            for seq in self.known:
                at = next((i for i in range(len(seq) - len(tail)) if seq[i : i + len(tail)] == tail), None)
                if at is not None:
                    follow = seq[at + len(tail) : at + len(tail) + k]
                    break
        drafts = list(follow or [])
        if self.wrong_at is not None and self.wrong_at < len(drafts):
            drafts[self.wrong_at] = (drafts[self.wrong_at] + 1) % self.vocab
        return drafts, [None] * len(drafts)


def oracle_hook(oracle: OracleDrafter):
    def hook(spec) -> None:
        spec.layer, spec.ngram = None, oracle  # the oracle drafts in place of the MTP layer

    return hook


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("specserve")
    return {
        "k3": write_k3_checkpoint(root / "k3", mtp=True),
        "k3-dsa": write_k3_checkpoint(root / "dsa", mtp=True, with_indexer=True),
        "k3-tiny": REPO / "models" / "k3-tiny",
    }


@pytest.fixture(scope="module")
def engines(ckpts):
    made: dict = {}

    def get(name: str, k: int = 0, method: str = "mtp", **kw) -> Engine:
        key = (name, k, method, tuple(sorted(kw)))
        if key not in made:
            made[key] = build_local_engine(
                str(ckpts[name]), speculative_tokens=k, speculative_method=method if k else "", max_waiting=64, **kw
            )
        return made[key]

    yield get
    for e in made.values():
        e.close()


def run(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY):
    r = engine.generate(prompt, params, timeout=300)
    return r.output, [(lp.token, lp.logprob, lp.top) for lp in r.logprobs], r.finish_reason


@pytest.mark.parametrize("name", ["k3", "k3-dsa", "k3-tiny"])
def test_greedy_output_is_identical_with_mtp_speculation(engines, name):
    plain, spec = engines(name), engines(name, 3)
    for prompt in PROMPTS:
        assert run(spec, prompt) == run(plain, prompt)
    assert spec.stats.drafted > 0 and spec.stats.verify_steps > 0
    if name == "k3-tiny":  # the trained MTP head agrees with its model often enough to be accepted
        assert spec.stats.accepted > 0


def test_sixteen_concurrent_streams_match_plain(engines):
    plain, spec = engines("k3"), engines("k3", 2, speculative_max_batch=16)  # all 16 speculate
    before = spec.stats.verify_steps
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + i % 7)] for i in range(16)]
    alone = [run(plain, p, SamplingParams(max_tokens=20)) for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: run(spec, p, SamplingParams(max_tokens=20)), prompts))
    assert together == alone
    assert spec.stats.verify_steps > before


def test_ngram_drafter_is_exact_and_accepts_on_repetition(engines):
    plain, spec = engines("k3-tiny"), engines("k3-tiny", 3, "ngram")
    prompt = PROMPTS[0] * 3
    assert run(spec, prompt) == run(plain, prompt)
    assert spec.stats.drafted > 0


@pytest.fixture(scope="module")
def oracle(engines, ckpts):
    o = OracleDrafter(Checkpoint(ckpts["k3"]).cfg.vocab_size)
    return o, engines("k3", 3, drafter=oracle_hook(o))


@pytest.mark.parametrize("wrong_at", [None, 0, 1, 2])
def test_a_rejection_at_every_draft_position_keeps_the_output(engines, oracle, wrong_at):
    o, spec = oracle
    plain = engines("k3")
    refs = {tuple(p): run(plain, p) for p in PROMPTS}
    o.known = [list(p) + refs[tuple(p)][0] for p in PROMPTS]
    o.wrong_at = wrong_at
    before = spec.stats.accepted, dict(spec.stats.accepted_by_position)
    for p in PROMPTS:
        assert run(spec, p) == refs[tuple(p)]  # tokens, log-probs (target's), finish reason
    o.wrong_at = None
    accepted = spec.stats.accepted - before[0]
    assert (accepted > 0) == (wrong_at != 0)  # the drafts before the corrupted one were accepted
    if wrong_at is not None:  # never the corrupted position
        assert spec.stats.accepted_by_position.get(str(wrong_at), 0) == before[1].get(str(wrong_at), 0)


def test_boundaries_inside_accepted_runs_are_saved_and_hit(engines, oracle):
    """Accepted runs cross chunk boundaries mid-step (a 7-token prompt, 4 tokens a step: 15 -> 19 crosses 16, 31 ->
    35 crosses 32): the worker holds the state at the boundary (the verify's per-position KDA states,
    SequenceCache.kda_states_at) and the request's next step saves that prefix. A second turn — the first one's
    prompt and answer, then more — hits the deepest (32: KDA state and pages there) and answers as plain decoding
    does."""
    o, spec = oracle
    plain = engines("k3")
    params = SamplingParams(max_tokens=40, logprobs=2)
    prompt = PROMPTS[1]
    first = run(plain, prompt, params)
    o.known, o.wrong_at = [prompt + first[0]], None
    before = spec.stats.accepted
    assert run(spec, prompt, params) == first
    assert spec.stats.accepted - before >= 24  # all drafts accepted: every step keeps 4
    follow = prompt + first[0] + [11, 12, 13]
    o.known.append(follow + run(plain, follow, params)[0])
    r = spec.generate(follow, params, timeout=300)
    assert r.cached_tokens == 32
    assert (r.output, [(lp.token, lp.logprob, lp.top) for lp in r.logprobs], r.finish_reason) == run(
        plain, follow, params
    )


def test_stop_token_and_max_tokens_inside_an_accepted_run(engines, oracle):
    o, spec = oracle
    plain = engines("k3")
    prompt = PROMPTS[1]
    ref = run(plain, prompt, SamplingParams(max_tokens=24))[0]
    o.known = [prompt + ref]
    stop = ref[6]
    for params in (SamplingParams(max_tokens=24, stop_token_ids=(stop,)), SamplingParams(max_tokens=7)):
        before = spec.stats.accepted
        assert run(spec, prompt, params) == run(plain, prompt, params)
        assert spec.stats.accepted > before
    out, _, reason = run(spec, prompt, SamplingParams(max_tokens=24, stop_token_ids=(stop,)))
    assert out == ref[: ref.index(stop) + 1] and reason == "stop"
    assert len(run(spec, prompt, SamplingParams(max_tokens=7))[0]) == 7


# ------------------------------------------------------------------ chat over HTTP: thinking, grammars, tools
@pytest.fixture(scope="module")
def chat_pair(ckpts):
    d = ckpts["k3"]
    chat = load_chat(d, model_vocab_size=Checkpoint(d).cfg.vocab_size)
    o = OracleDrafter(Checkpoint(d).cfg.vocab_size)
    plain = build_local_engine(str(d), max_waiting=64)
    spec = build_local_engine(
        str(d), speculative_tokens=3, speculative_method="mtp", drafter=oracle_hook(o), max_waiting=64
    )
    seen = []
    submit = plain.submit

    def recording(*a, **kw):
        seen.append(submit(*a, **kw))
        return seen[-1]

    plain.submit = recording
    servers, clients = [], []
    for engine in (plain, spec):
        port = free_port()
        srv, thread = serve_http(
            build_app(engine, chat=chat, thinking_budgets=ThinkingBudgets(16, 24, 32)), "127.0.0.1", port
        )
        servers.append((srv, thread))
        clients.append(openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120))
    yield {"plain": clients[0], "spec": clients[1], "oracle": o, "seen": seen, "engines": (plain, spec)}
    for srv, thread in servers:
        srv.should_exit = True
        thread.join(timeout=10)
    plain.close()
    spec.close()


SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def both(pair, **body):
    """The plain answer, then the speculating one (its oracle knowing the plain run's tokens)."""
    plain = pair["plain"].chat.completions.create(model="k3", temperature=0, **body)
    pair["oracle"].known = [r.prompt + r.output for r in pair["seen"]]
    spec = pair["spec"].chat.completions.create(model="k3", temperature=0, **body)
    return plain, spec


def answers(r):
    return [
        (
            c.message.content,
            c.message.reasoning_content if hasattr(c.message, "reasoning_content") else None,
            [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []],
            c.finish_reason,
            [(e.token, e.logprob) for e in (c.logprobs.content if c.logprobs else [])],
        )
        for c in r.choices
    ] + [(r.usage.prompt_tokens, r.usage.completion_tokens)]


@pytest.mark.parametrize(
    "body",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
        {"tools": [TOOL], "tool_choice": "required"},
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        {"n": 2, "logprobs": True, "top_logprobs": 2},
    ],
    ids=["json_schema", "tool_required", "tool_named", "n2_logprobs"],
)
def test_chat_requests_answer_the_same(chat_pair, body):
    spec_engine = chat_pair["engines"][1]
    before = spec_engine.stats.accepted
    plain, spec = both(
        chat_pair,
        max_tokens=120,
        messages=[{"role": "user", "content": "Weather in Paris? Answer in JSON."}],
        extra_body={"thinking_budget": "low"},
        **body,
    )
    assert answers(spec) == answers(plain)
    assert spec_engine.stats.accepted > before  # accepted runs went through thinking's close and the grammar
    if "response_format" in body:
        json.loads(spec.choices[0].message.content)


def test_a_stop_string_inside_an_accepted_run(chat_pair):
    ask = dict(max_tokens=60, messages=[{"role": "user", "content": "Say words."}], reasoning_effort="none")
    text = chat_pair["plain"].chat.completions.create(model="k3", temperature=0, **ask).choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    plain, spec = both(chat_pair, stop=[stop], **ask)
    assert answers(spec) == answers(plain) and spec.choices[0].finish_reason == "stop"


# ------------------------------------------------------------------ refusals
def test_router_and_workers_disagreeing_on_k_refuse_to_start(ckpts):
    ckpt = Checkpoint(ckpts["k3"])
    from expertmesh.entry.cluster import make_placement
    from expertmesh.worker.expert import ExpertWorker

    placement = make_placement(ckpt.cfg, 1, 0)
    worker = AttentionWorker(ckpt, kv_blocks=64, speculative_method="ngram", speculative_tokens=2)
    experts = [ExpertWorker(ckpt, placement.experts_of(0))]
    for config in (EngineConfig(), EngineConfig(speculative_tokens=3, speculative_method="ngram")):
        with pytest.raises(ValueError, match="--speculative-tokens: attention worker 0 .* speculates with 2"):
            Engine(ckpt.cfg, [worker], experts, placement, config).start()


def test_mtp_on_a_checkpoint_without_mtp_is_refused_naming_the_flag(tmp_path, capsys):
    d = write_k3_checkpoint(tmp_path / "plain")
    with pytest.raises(WorkerError, match="--speculative-method mtp: the checkpoint .* has no MTP layer"):
        AttentionWorker(str(d), kv_blocks=16, speculative_method="mtp", speculative_tokens=2)
    argv = ["--role", "attention", "--checkpoint", str(d), "--device", "cpu", "--port", "0"]
    assert worker_cli.main([*argv, "--speculative-method", "mtp", "--speculative-tokens", "2"]) == 2
    assert "--speculative-method mtp: the checkpoint" in capsys.readouterr().err
