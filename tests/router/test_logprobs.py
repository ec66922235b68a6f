"""Log-probabilities: prompt scoring (`prompt_logprobs`, `/v1/completions` echo + logprobs) and generated-token
logprobs, compared with one forward pass of the reference model over the whole text (log_softmax of its fp32
logits), through the engine in process and through the official openai client over HTTP."""

import random

import openai
import pytest
import torch

from expertmesh.chat.tokenizer import ByteTokenizer
from expertmesh.checkpoint.loader import Checkpoint, create_checkpoint
from expertmesh.entry.cluster import free_port
from expertmesh.entry.local import build_local_engine
from expertmesh.model.config import preset
from expertmesh.router.engine import RequestError
from expertmesh.router.http import build_app, serve_http
from expertmesh.wire.sampling_params import SamplingParams

CHUNK = 16
TOL = 1e-4  # fp32: chunked prefill + decode vs one whole-sequence forward


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return Checkpoint(create_checkpoint(preset("tiny"), tmp_path_factory.mktemp("lp") / "tiny", seed=3))


@pytest.fixture(scope="module")
def model(ckpt):
    return ckpt.load_model()


@pytest.fixture(scope="module")
def engine(ckpt):
    eng = build_local_engine(ckpt, attention_workers=1, expert_workers=2, prefill_chunk=CHUNK)
    yield eng
    eng.close()


def reference(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens) - 1, V]: row i is the distribution of token i + 1 given tokens[: i + 1]."""
    return torch.log_softmax(model.step(tokens[:-1], model.new_cache()).float(), dim=-1)


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def check_entry(entry, ref_row: torch.Tensor, token: int, n: int) -> None:
    assert entry.token == token
    assert abs(entry.logprob - float(ref_row[token])) < TOL
    top = torch.topk(ref_row, n)
    assert [t for t, _ in entry.top] == top.indices.tolist()
    assert max(abs(lp - float(v)) for (_, lp), v in zip(entry.top, top.values)) < TOL if n else entry.top == []


def test_prompt_and_generated_logprobs_match_one_forward_pass(engine, model):
    prompt = prompt_of(2 * CHUNK + 7, seed=1)  # three prefill chunks: pending rows cross them
    req = engine.generate(prompt, SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2))
    assert req.finish_reason == "length" and len(req.output) == 6
    ref = reference(model, prompt + req.output)
    assert sorted(req.prompt_logprobs) == list(range(1, len(prompt)))
    for pos, entry in req.prompt_logprobs.items():
        check_entry(entry, ref[pos - 1], prompt[pos], 2)
    assert len(req.logprobs) == len(req.output)
    for i, (entry, token) in enumerate(zip(req.logprobs, req.output)):
        check_entry(entry, ref[len(prompt) - 1 + i], token, 3)
        assert entry.top[0][0] == token  # greedy: the most likely token


def test_sampled_tokens_logprobs_are_the_models_not_the_samplers(engine, model):
    prompt = prompt_of(11, seed=2)
    params = SamplingParams(max_tokens=8, temperature=1.3, top_k=40, seed=5, logprobs=0)
    req = engine.generate(prompt, params)
    ref = reference(model, prompt + req.output)
    for i, (entry, token) in enumerate(zip(req.logprobs, req.output)):
        check_entry(entry, ref[len(prompt) - 1 + i], token, 0)
    assert req.prompt_logprobs == {}  # only what was asked for


def test_scoring_only_bypasses_the_prefix_cache(engine, model):
    prompt = prompt_of(3 * CHUNK + 2, seed=4)
    engine.generate(prompt, SamplingParams(max_tokens=2))  # leaves cached prefixes of this prompt
    assert engine.generate(prompt, SamplingParams(max_tokens=1)).cached_tokens > 0
    req = engine.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=1))
    assert (req.finish_reason, req.output, req.cached_tokens) == ("length", [], 0)
    ref = reference(model, prompt)
    assert sorted(req.prompt_logprobs) == list(range(1, len(prompt)))
    for pos, entry in req.prompt_logprobs.items():
        check_entry(entry, ref[pos - 1], prompt[pos], 1)


def test_forced_token_gets_the_logprob_of_what_was_fed(engine, model):
    prompt = prompt_of(9, seed=6)
    greedy = engine.generate(prompt, SamplingParams(max_tokens=1, logprobs=5))
    second = greedy.logprobs[0].top[1][0]  # force the runner-up, then a token outside the top
    ref = reference(model, prompt + [0])[-1]
    outside = int(torch.argsort(ref)[0])

    def force(req, token):
        return second if len(req.output) == 0 else outside

    req = engine.submit(prompt, SamplingParams(max_tokens=2, logprobs=5), token_filter=force).wait(60)
    assert req.output == [second, outside]
    assert req.logprobs[0].token == second and abs(req.logprobs[0].logprob - float(ref[second])) < TOL
    assert req.logprobs[1].token == outside and req.logprobs[1].logprob is None  # not among the top 5


@pytest.mark.parametrize(
    "params, field",
    [
        (SamplingParams(logprobs=21), "logprobs"),
        (SamplingParams(logprobs=-1), "logprobs"),
        (SamplingParams(prompt_logprobs=99), "prompt_logprobs"),
        (SamplingParams(max_tokens=0), "max_tokens"),
    ],
)
def test_bad_logprob_requests_name_the_field(engine, params, field):
    with pytest.raises(RequestError, match=f"^{field}="):
        engine.submit([1, 2, 3], params)


# ---------------------------------------------------------------------------------------------- HTTP
@pytest.fixture(scope="module")
def oai(engine):
    port = free_port()
    server, thread = serve_http(build_app(engine), "127.0.0.1", port)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
    server.should_exit = True
    thread.join(timeout=10)


def test_completions_echo_scores_the_prompt_like_vllm(oai, model):
    text = "The quick brown fox jumps over the lazy dog, twice."
    ids = ByteTokenizer().encode_prompt(text)
    out = oai.completions.create(model="tiny", prompt=text, echo=True, logprobs=2, max_tokens=0, temperature=0)
    choice = out.choices[0]
    assert choice.text == text and out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference(model, ids)
    got = torch.tensor(lp.token_logprobs[1:])
    want = ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert (got - want).abs().max() < TOL
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])  # top 2 plus the chosen token
    assert lp.text_offset == sorted(lp.text_offset) and "".join(lp.tokens[1:]) == text


def test_completions_logprobs_for_generated_tokens_stream_and_not(oai, engine, model):
    ids = [5] + prompt_of(20, seed=8)
    full = oai.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=4, temperature=0)
    plain = oai.completions.create(model="tiny", prompt=ids, logprobs=1, max_tokens=4, temperature=0)
    lp = full.choices[0].logprobs
    assert (
        len(lp.token_logprobs) == len(ids) + 4
        and lp.token_logprobs[len(ids) + 1 :] == plain.choices[0].logprobs.token_logprobs[1:]
    )
    assert full.choices[0].text.endswith(plain.choices[0].text)
    chunks = [
        c
        for c in oai.completions.create(model="tiny", prompt=ids, logprobs=1, max_tokens=4, temperature=0, stream=True)
        if c.choices
    ]
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == plain.choices[0].logprobs.token_logprobs
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    generated = engine.generate(ids, SamplingParams(max_tokens=4, stop_token_ids=(ByteTokenizer().eos_id,))).output
    ref = reference(model, ids + generated)
    want = [float(ref[len(ids) - 1 + i, t]) for i, t in enumerate(generated)]
    assert max(abs(a - b) for a, b in zip(plain.choices[0].logprobs.token_logprobs, want)) < TOL


@pytest.mark.parametrize(
    "extra, param", [({"logprobs": 21}, "logprobs"), ({"logprobs": -2}, "logprobs"), ({"max_tokens": 0}, "max_tokens")]
)
def test_completions_refuse_bad_logprobs(oai, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt="hi", **{"max_tokens": 2, **extra})
    assert e.value.body["param"] == param
