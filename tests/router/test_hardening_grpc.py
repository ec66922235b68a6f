"""Router hardening round 2 (#33, finding 3) on the gRPC API of the shared deployment: request ids are bounded,
invalid UTF-8 is INVALID_ARGUMENT, and clients that never read do not take the API down. Each test failed on the
main it was written against."""

from __future__ import annotations

import time

import pytest
from support.api_deployment import API_KEY


def grpc_stub(c, *options):
    import grpc

    from expertmesh.protos import router_pb2_grpc

    # a connection of its own (channels of one process share connections unless told not to)
    channel = grpc.insecure_channel(
        f"127.0.0.1:{c.grpc_port}", options=[("grpc.use_local_subchannel_pool", 1), *options]
    )
    return channel, router_pb2_grpc.RouterStub(channel)


AUTH = (("authorization", f"Bearer {API_KEY}"),)


def test_grpc_request_id_is_bounded_and_invalid_utf8_is_invalid_argument(api_deployment):
    """#3: a 1 MiB request_id with max_tokens 64 gave a 68 MB response (it is echoed in every event); a string
    field with invalid UTF-8 was not INVALID_ARGUMENT."""
    import grpc

    from expertmesh.protos import router_pb2, sampling_pb2

    c = api_deployment.cluster
    channel, stub = grpc_stub(c)
    params = sampling_pb2.SamplingParams(max_tokens=2)
    for rid in ("r" * 129, "é" * 65, "x" * 2**20):
        with pytest.raises(grpc.RpcError) as e:
            list(
                stub.Generate(
                    router_pb2.GenerateRequest(text="hi", request_id=rid, params=params), metadata=AUTH, timeout=30
                )
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.value.details()
    events = list(
        stub.Generate(
            router_pb2.GenerateRequest(text="hi", request_id="r" * 128, params=params), metadata=AUTH, timeout=30
        )
    )
    assert events[0].request_id == "r" * 128
    raw = router_pb2.GenerateRequest(text="hi", params=params).SerializeToString().replace(b"hi", b"h\xff")
    generate = channel.unary_stream("/expertmesh.v1.Router/Generate")
    with pytest.raises(grpc.RpcError) as e:
        list(generate(raw, metadata=AUTH, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in e.value.details(), e.value
    channel.close()


def test_grpc_clients_that_never_read_do_not_take_the_api_down(api_deployment):
    """#3: 500 streams on one connection that are never read held the 32-thread pool: the public gRPC API was
    unavailable for ≥ 90 s. Now one connection gets at most 16 streams at once, a stream whose client stops reading
    is cancelled after the write deadline (3 s here), and another client is served meanwhile."""

    from expertmesh.protos import router_pb2, sampling_pb2

    c = api_deployment.cluster
    # a client that reads nothing and offers a 1 KB window: the server's writes block at once
    bad_channel, bad = grpc_stub(c, ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024))
    hog = router_pb2.GenerateRequest(
        text="Tell me everything. " * 8,
        request_id="h" * 128,
        return_text=True,
        params=sampling_pb2.SamplingParams(max_tokens=3000, temperature=1.0, seed=1),
    )
    calls = [bad.Generate(hog, metadata=AUTH) for _ in range(500)]  # started, never read
    try:
        time.sleep(3)
        channel, stub = grpc_stub(c)
        start = time.monotonic()
        assert stub.ListModels(router_pb2.ListModelsRequest(), metadata=AUTH, timeout=10).models
        listed = time.monotonic() - start
        events = list(
            stub.Generate(
                router_pb2.GenerateRequest(text="hi", params=sampling_pb2.SamplingParams(max_tokens=4)),
                metadata=AUTH,
                timeout=60,
            )
        )
        generated = time.monotonic() - start
        assert events[-1].finish.usage.completion_tokens == 4
        print(f"beside 500 unread streams: ListModels {listed:.2f} s, a 4-token Generate {generated:.2f} s")
        assert listed < 2, listed
        deadline = time.monotonic() + 60  # the stalled streams are cut off by the write deadline
        while time.monotonic() < deadline and not any("read nothing" in line for line in c.router.lines):
            time.sleep(0.5)
        assert any("read nothing" in line for line in c.router.lines)
        channel.close()
    finally:
        for call in calls:
            call.cancel()
        bad_channel.close()
