"""Prefixes private to their key (issue #51): a prompt one API key cached is never a hit — `cached_tokens`, the
latency — for another key, on every surface; `--prefix-cache-scope shared` shares them; `cache_salt` and
`prompt_cache_key` scope them further; Anthropic refuses cache_salt, naming it. In process: the router's HTTP app
over an engine with one attention and two expert workers on the shared tiny checkpoint, with two API keys."""

import argparse
import uuid

import anthropic
import grpc
import httpx
import openai
import pytest

from expertmesh.entry.cluster import free_port
from expertmesh.entry.local import build_local_engine
from expertmesh.protos import router_pb2, router_pb2_grpc, sampling_pb2
from expertmesh.router.engine_config import EngineConfig
from expertmesh.router.grpc_service import serve_router_grpc
from expertmesh.router.http import build_app, serve_http
from expertmesh.router.kv import KVManager, WorkerKV, prefix_hashes
from expertmesh.router.prefix_scope import PrefixScope
from expertmesh.router.server import add_arguments, read_api_keys
from expertmesh.wire.sampling_params import SamplingParams

KEYS = ("sk-tenant-a", "sk-tenant-b")


def deployment(ckpt, scope: str):
    engine = build_local_engine(ckpt, attention_workers=1, expert_workers=2, prefix_cache_scope=scope)
    port = free_port()
    srv, thread = serve_http(build_app(engine, api_key=KEYS), "127.0.0.1", port)
    return engine, srv, thread, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def keyed_stack(tiny_checkpoint):
    """The default: each key its own prefixes. HTTP and the gRPC router service over one engine."""
    engine, srv, thread, url = deployment(tiny_checkpoint, "key")
    grpc_port = free_port()
    grpc_server = serve_router_grpc(engine, "127.0.0.1", grpc_port, api_key=KEYS)
    yield url, f"127.0.0.1:{grpc_port}"
    grpc_server.stop(None)
    srv.should_exit = True
    thread.join(timeout=10)
    engine.close()


@pytest.fixture(scope="module")
def keyed(keyed_stack):
    return keyed_stack[0]


@pytest.fixture(scope="module")
def shared(tiny_checkpoint):
    """`--prefix-cache-scope shared`."""
    engine, srv, thread, url = deployment(tiny_checkpoint, "shared")
    yield url
    srv.should_exit = True
    thread.join(timeout=10)
    engine.close()


def secret() -> str:
    """A prompt no other test sends, from its first prefix-cache chunk on, several chunks long."""
    return f"{uuid.uuid4().hex} is the vault code; never tell anyone what it is, whatever they say."


def oai(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def chat_cached(url: str, key: str, prompt: str, **extra) -> int:
    r = oai(url, key).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": prompt}],
        max_completion_tokens=1,
        temperature=0,
        reasoning_effort="none",
        extra_body=extra or None,
    )
    return r.usage.prompt_tokens_details.cached_tokens


def completion_cached(url: str, key: str, prompt: str, **extra) -> int:
    r = oai(url, key).completions.create(
        model="tiny", prompt=prompt, max_tokens=1, temperature=0, extra_body=extra or None
    )
    return r.usage.prompt_tokens_details.cached_tokens


def responses_cached(url: str, key: str, prompt: str, **extra) -> int:
    r = oai(url, key).responses.create(
        model="tiny", input=prompt, max_output_tokens=1, store=False, extra_body=extra or None
    )
    return r.usage.input_tokens_details.cached_tokens


def messages_cached(url: str, key: str, prompt: str) -> int:
    claude = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)
    msg = claude.messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": prompt}])
    return msg.usage.cache_read_input_tokens


SURFACES = {
    "chat": chat_cached,
    "completions": completion_cached,
    "responses": responses_cached,
    "messages": messages_cached,
}


@pytest.mark.parametrize("surface", sorted(SURFACES))
def test_a_second_key_never_hits_the_first_keys_prefix(keyed, surface):
    cached = SURFACES[surface]
    prompt = secret()
    assert cached(keyed, KEYS[0], prompt) == 0
    assert cached(keyed, KEYS[0], prompt) > 0  # the same key: its own prefix
    assert cached(keyed, KEYS[1], prompt) == 0  # another key: nothing of it
    assert cached(keyed, KEYS[1], prompt) > 0  # ... until it sent the prompt itself
    assert cached(keyed, KEYS[0], prompt) > 0


def test_shared_scope_shares_between_keys(shared):
    prompt = secret()
    assert chat_cached(shared, KEYS[0], prompt) == 0
    assert chat_cached(shared, KEYS[1], prompt) > 0


@pytest.mark.parametrize("url_of", ["keyed", "shared"])
def test_cache_salt_separates_whatever_the_scope(url_of, request):
    url = request.getfixturevalue(url_of)
    prompt = secret()
    assert chat_cached(url, KEYS[0], prompt, cache_salt="salt-one") == 0
    assert chat_cached(url, KEYS[0], prompt, cache_salt="salt-one") > 0
    assert chat_cached(url, KEYS[0], prompt, cache_salt="salt-two") == 0
    assert chat_cached(url, KEYS[0], prompt) == 0  # no salt: not the salted entries
    other = chat_cached(url, KEYS[1], prompt, cache_salt="salt-one")
    assert (other > 0) == (url_of == "shared")  # the same salt under another key: a hit only where keys share
    for cached in (completion_cached, responses_cached):
        prompt = secret()
        assert cached(url, KEYS[0], prompt, cache_salt="salt-one") == 0
        assert cached(url, KEYS[0], prompt, cache_salt="salt-one") > 0
        assert cached(url, KEYS[0], prompt) == 0


def test_prompt_cache_key_is_honoured_as_a_scope(keyed):
    prompt = secret()
    assert chat_cached(keyed, KEYS[0], prompt, prompt_cache_key="user-1") == 0
    assert chat_cached(keyed, KEYS[0], prompt, prompt_cache_key="user-1") > 0
    assert chat_cached(keyed, KEYS[0], prompt, prompt_cache_key="user-2") == 0
    prompt = secret()
    assert responses_cached(keyed, KEYS[0], prompt, prompt_cache_key="user-1") == 0
    assert responses_cached(keyed, KEYS[0], prompt, prompt_cache_key="user-1") > 0
    assert responses_cached(keyed, KEYS[0], prompt) == 0


def test_cache_salt_must_be_a_string_and_anthropic_refuses_it(keyed):
    headers = {"authorization": f"Bearer {KEYS[0]}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "cache_salt": ""}
    r = httpx.post(keyed + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    claude = anthropic.Anthropic(base_url=keyed, api_key=KEYS[0], max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model="tiny", max_tokens=1, messages=[{"role": "user", "content": "hi"}], extra_body={"cache_salt": "x"}
        )
    assert e.value.body["type"] == "error" and "cache_salt" in e.value.body["error"]["message"]
    r = httpx.post(
        keyed + "/v1/completions", json={"model": "tiny", "prompt": "hi"}, headers={"authorization": "Bearer no"}
    )
    assert r.status_code == 401  # neither key: refused as before


def test_the_flags(tmp_path):
    """`--prefix-cache-scope` (default key) reaches the engine's config; `--api-key-file` holds one key a line."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    base = ["--checkpoint", "-", "--plan", "-", "--attention", "-", "--experts", "-"]
    assert EngineConfig.from_args(p.parse_args(base)).prefix_cache_scope == "key"
    assert (
        EngineConfig.from_args(p.parse_args([*base, "--prefix-cache-scope", "shared"])).prefix_cache_scope == "shared"
    )
    with pytest.raises(SystemExit):
        p.parse_args([*base, "--prefix-cache-scope", "everyone"])
    keys = tmp_path / "keys"
    keys.write_text("sk-one\n\n  sk-two  \nsk-one\n")
    assert read_api_keys(str(keys)) == ("sk-one", "sk-two")
    keys.write_text("\n \n")
    with pytest.raises(ValueError, match="--api-key-file .* holds no key"):
        read_api_keys(str(keys))


def test_scoped_keys_agree_across_replicas_and_tiers_but_not_across_scopes():
    """Router replicas sharing a salt learn each other's prefixes from the workers' listings (any tier): within
    one scope they hit, in another they do not."""
    tokens = list(range(40))
    a, b = PrefixScope("sk-a").digest(), PrefixScope("sk-b").digest()
    here, there = (KVManager([WorkerKV(0, 16, 64, 64)], chunk=16, salt=b"replicas") for _ in range(2))
    keys = [key for _, key in prefix_hashes(tokens, 16, b"replicas", a)]
    assert not set(keys) & {key for _, key in prefix_hashes(tokens, 16, b"replicas", b)}
    assert not set(keys) & {key for _, key in prefix_hashes(tokens, 16, b"replicas")}  # nor the shared scope
    for n, key in enumerate(keys):
        here.record_prefix(0, key, 16 * (n + 1))
    there.learn(0, [(keys[0], 16, "device"), (keys[1], 32, "disk")])  # what the worker lists
    assert there.find_prefix(tokens, a) == (0, keys[1], 32) == here.find_prefix(tokens, a)
    assert there.find_prefix(tokens, b) is None and there.find_prefix(tokens) is None
    assert PrefixScope("sk-a").digest("shared") == b"" == PrefixScope().digest()
    assert PrefixScope("sk-a", cache_salt="s").digest("shared") == PrefixScope("sk-b", cache_salt="s").digest("shared")


def test_the_hand_off_keeps_the_scope(tiny_checkpoint):
    """A prompt prefilled in the prefill pool and handed to a decode worker: its prefixes are its scope's."""
    engine = build_local_engine(tiny_checkpoint, prefill_chunk=16, prefill_workers=1)
    try:
        prompt = [(7 * i + 3) % 250 for i in range(70)]

        def cached(tenant: str) -> int:
            req = engine.submit(prompt, SamplingParams(max_tokens=3), scope=PrefixScope(tenant))
            return req.wait(60).cached_tokens

        assert cached("sk-a") == 0 and cached("sk-a") > 0
        assert engine.stats.cached_tokens > 0 and cached("sk-b") == 0 and cached("sk-b") > 0
    finally:
        engine.close()


def test_grpc_generate_is_scoped_to_its_key(keyed_stack):
    _, target = keyed_stack
    prompt = secret()

    def cached(key: str) -> int:
        with grpc.insecure_channel(target) as ch:
            events = list(
                router_pb2_grpc.RouterStub(ch).Generate(
                    router_pb2.GenerateRequest(text=prompt, params=sampling_pb2.SamplingParams(max_tokens=1)),
                    metadata=[("x-api-key", key)],
                    timeout=60,
                )
            )
        return events[-1].finish.usage.cached_tokens

    assert cached(KEYS[0]) == 0
    assert cached(KEYS[0]) > 0  # its own key hits
    assert cached(KEYS[1]) == 0  # the other key does not
