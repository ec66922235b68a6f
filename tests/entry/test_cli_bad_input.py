"""Malformed command lines, table-driven: each ends with a message naming what is wrong, never a traceback
(the HTTP and gRPC cases: tests/router/test_bad_input.py)."""

import shutil

import pytest

from expertmesh.entry.cli import main


@pytest.fixture(scope="module")
def ckpt_dir(tiny_checkpoint_dir):
    return tiny_checkpoint_dir  # the session's shared tiny checkpoint (tests/conftest.py)


# ----------------------------------------------------------------------------------------------- CLI
def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """(exit status, stderr) of `expertmesh ARGV`; argparse's SystemExit counts as the exit status."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    return code, capsys.readouterr().err


UNCAUGHT = (
    "an uncaught {} traceback instead of a one-line error naming {} and exit status 2 (expertmesh/entry/cli.py main "
    "catches only ValueError and FileNotFoundError)"
)
CLI_CASES = [
    pytest.param(["plan", "--preset", "nope", "--expert-pods", "2"], ["--preset", "'nope'"], id="plan-bad-preset"),
    pytest.param(
        ["plan", "--preset", "tiny", "--expert-pods", "two"], ["--expert-pods", "'two'"], id="plan-pods-not-int"
    ),
    pytest.param(["plan", "--preset", "tiny", "--expert-pods", "-1"], ["--expert-pods", "-1"], id="plan-negative-pods"),
    pytest.param(
        ["plan", "--preset", "tiny", "--expert-pods", "2", "--gpu-memory-gib", "-5"],
        ["--gpu-memory-gib", "-5"],
        id="plan-negative-memory",
    ),
    pytest.param(
        ["plan", "--preset", "tiny", "--expert-pods", "2", "--redundant-experts", "-1"],
        ["--redundant-experts"],
        id="plan-negative-redundant",
    ),
    pytest.param(
        ["plan", "--preset", "tiny", "--expert-pods", "2", "--loads", "{d}/nope.npy"],
        ["--loads", "nope.npy"],
        id="plan-missing-loads",
    ),
    pytest.param(
        ["plan", "--preset", "tiny", "--expert-pods", "2", "--loads", "{d}/config.json"],
        ["--loads"],
        id="plan-loads-wrong-shape",
    ),
    pytest.param(
        ["plan", "--preset", "tiny", "--expert-pods", "2", "--previous", "{d}/nope.json"],
        ["--previous", "nope.json"],
        id="plan-missing-previous",
    ),
    pytest.param(
        ["checkpoint", "inspect", "{d}/nope"], ["nope", "not a checkpoint directory"], id="inspect-missing-dir"
    ),
    pytest.param(
        ["checkpoint", "create", "--preset", "nope", "--out", "{d}/x"],
        ["unknown preset 'nope'"],
        id="create-bad-preset",
    ),
    pytest.param(["checkpoint", "create", "--out", "{d}/config.json"], ["config.json"], id="create-out-is-a-file"),
    pytest.param(
        ["checkpoint", "create", "--out", "{d}/ls0", "--layers-per-shard", "0"],
        ["--layers-per-shard"],
        id="create-zero-layers-per-shard",
    ),
    pytest.param(["model", "describe", "nope"], ["unknown preset 'nope'"], id="describe-bad-preset"),
    pytest.param(
        ["generate", "hi", "--checkpoint", "{d}/nope"],
        ["nope", "not a checkpoint directory"],
        id="generate-missing-checkpoint",
    ),
    pytest.param(
        ["generate", "hi", "--checkpoint", "{ck}", "--top-p", "5"], ["top_p=5.0"], id="generate-top-p-above-1"
    ),
    pytest.param(
        ["generate", "hi", "--checkpoint", "{ck}", "--max-tokens", "-1"],
        ["--max-tokens"],
        id="generate-negative-max-tokens",
    ),
    pytest.param(
        ["chat", "--url", "http://127.0.0.1:9", "--max-tokens", "2", "hi"], ["127.0.0.1:9"], id="chat-unreachable-url"
    ),
    pytest.param(["bogus"], ["invalid choice: 'bogus'"], id="unknown-command"),
]


@pytest.mark.parametrize("argv, needles", CLI_CASES)
def test_cli_bad_input(ckpt_dir, tmp_path, capsys, argv, needles):
    shutil.copy(ckpt_dir / "config.json", tmp_path / "config.json")
    argv = [a.format(d=tmp_path, ck=ckpt_dir) for a in argv]
    code, err = run_cli(argv, capsys)
    assert code != 0, f"exit status 0 for {argv}; stderr {err[-300:]!r}"
    last = err.strip().splitlines()[-1] if err.strip() else ""
    missing = [n for n in needles if n not in last]
    assert not missing, f"last stderr line {last!r} does not name {missing}"
