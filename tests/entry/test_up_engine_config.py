"""`expertmesh up` builds the router's EngineConfig from the command line it will give the router before it starts
any process: a combination the engine refuses fails `up` at once, naming the flag."""

import argparse

import pytest

from expertmesh.entry.up import add_arguments, router_engine_config, router_options, run_up


def up_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--checkpoint", "/nonexistent", "--expert-workers", "2", *argv])


def test_the_engine_config_is_what_the_router_will_parse():
    args = up_args("--prefill-chunk", "32", "--prefill-tokens", "64", "--", "--max-queue-wait", "9")
    config = router_engine_config(args, router_options(args.router_options))
    assert (config.prefill_chunk, config.prefill_tokens, config.transport) == (32, 64, "collective")
    assert config.max_queue_wait == 9 and config.call_timeout == 30.0 * 3  # --call-timeout over 2 expert workers


@pytest.mark.parametrize(
    "argv, named",
    [
        (("--prefill-chunk", "64", "--prefill-tokens", "100"), "--prefill-tokens 100 is not a multiple"),
        (("--", "--prefix-salt-file", "/nonexistent/salt"), "--prefix-salt-file /nonexistent/salt"),
    ],
)
def test_a_config_the_engine_refuses_fails_up_before_anything_starts(argv, named, capsys, monkeypatch):
    import expertmesh.entry.up as up

    monkeypatch.setattr(up, "LocalCluster", None)  # never reached
    assert run_up(up_args(*argv)) == 2
    assert named in capsys.readouterr().err
