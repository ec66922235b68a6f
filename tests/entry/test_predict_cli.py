"""`expertmesh predict`: the JSON others script against, the table, refusals naming the flag (exit 2)."""

import json

import pytest

from expertmesh.entry.cli import main

ARGS = [
    "predict",
    "--model",
    "kimi-k3",
    "--gpu",
    "b300",
    "--gpus",
    "8",
    "--tp",
    "8",
    "--input-len",
    "8192",
    "--output-len",
    "1024",
    "--concurrency",
    "16",
    "--weights",
    "mxfp4",
]


def test_json_has_the_promised_keys_and_echoes_the_inputs(capsys):
    assert main([*ARGS, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "prefill_tokens_per_s_per_gpu",
        "decode_tokens_per_s_per_gpu",
        "ttft_s",
        "tpot_ms",
        "bound",
        "kv_capacity_sequences",
        "prefill_tokens_per_s_per_node",
        "decode_tokens_per_s_per_node",
    ):
        assert key in out
    assert set(out["bound"]) == {"prefill", "decode"}
    assumed = out["assumed"]
    assert (assumed["model"], assumed["gpu"], assumed["gpus"], assumed["tp"]) == ("kimi-k3", "b300", 8, 8)
    assert (assumed["input_len"], assumed["output_len"], assumed["concurrency"], assumed["weights"]) == (
        8192,
        1024,
        16,
        "mxfp4",
    )
    assert out["decode_tokens_per_s_per_gpu"] > 0 and out["tpot_ms"] > 0


def test_phase_keeps_one_phase(capsys):
    assert main([*ARGS, "--json", "--phase", "decode"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "tpot_ms" in out and "ttft_s" not in out and "prefill_tokens_per_s_per_gpu" not in out
    assert list(out["bound"]) == ["decode"]


def test_table_for_people(capsys):
    assert main(ARGS) == 0
    text = capsys.readouterr().out
    assert "TPOT" in text and "decode bound by" in text and "assumed weights" in text


@pytest.mark.parametrize(
    ("change", "flag"),
    [
        (["--model", "gpt-2"], "--model"),
        (["--gpu", "v100"], "--gpu"),
        (["--ep", "3"], "--ep"),
        (["--weights", "fp6"], "--weights"),
        (["--prefill-gpus", "4"], "--decode-gpus"),
        (["--expert-imbalance", "0.5"], "--expert-imbalance"),
    ],
)
def test_refusals_name_the_flag(capsys, change, flag):
    args = list(ARGS)
    for i in range(0, len(change), 2):
        if change[i] in args:
            args[args.index(change[i]) + 1] = change[i + 1]
        else:
            args += change[i : i + 2]
    assert main(args) == 2
    assert flag in capsys.readouterr().err
