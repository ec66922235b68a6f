"""Greedy generation through a router's gRPC API (the byte tokenizer's EOS stops it), alone or several at once
with a fault injected mid-stream."""

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from expertmesh.chat.tokenizer import ByteTokenizer
from expertmesh.protos import router_pb2, router_pb2_grpc, sampling_pb2

EOS = ByteTokenizer().eos_id
PROMPTS = [[(7 * i + j) % 256 for j in range(5 + 3 * i)] for i in range(4)]
MAX_TOKENS = 40


def grpc_generate(address: str, prompt: list[int], max_tokens: int, **kw) -> tuple[list[int], router_pb2.Finish]:
    with grpc.insecure_channel(address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        req = router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=prompt),
            params=sampling_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=[EOS]),
            **kw,
        )
        tokens, finish = [], None
        for ev in stub.Generate(req, timeout=120):
            if ev.HasField("token"):
                tokens.append(ev.token.token_id)
            else:
                finish = ev.finish
        return tokens, finish


def stream(
    address: str,
    prompt: list[int],
    first: threading.Event | None = None,
    timeout: float = 60,
    grammar: str | None = None,
):
    """Greedy generation over gRPC (`grammar`: constrained decoding); sets `first` once a few tokens arrived.
    Returns (tokens, error)."""
    tokens = []
    try:
        with grpc.insecure_channel(address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            req = router_pb2.GenerateRequest(
                token_ids=router_pb2.TokenIds(ids=prompt),
                params=sampling_pb2.SamplingParams(
                    max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[EOS], grammar=grammar
                ),
            )
            for ev in stub.Generate(req, timeout=timeout):
                if ev.HasField("token"):
                    tokens.append(ev.token.token_id)
                    if first is not None and len(tokens) >= 3:
                        first.set()
        return tokens, None
    except grpc.RpcError as e:
        return tokens, e


def run_with_fault(address: str, fault, requests=None) -> list:
    """`requests` ((prompt, grammar) pairs, default PROMPTS unconstrained) streamed at once; `fault()` once each
    has a few tokens."""
    requests = requests or [(p, None) for p in PROMPTS]
    started = [threading.Event() for _ in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        futs = [pool.submit(stream, address, p, ev, grammar=g) for (p, g), ev in zip(requests, started)]
        assert all(ev.wait(60) for ev in started)
        fault()
        return [f.result(timeout=120) for f in futs]
