"""Kernel selection by what the CPU offers (kernels/cpu_features.py, kernels/cpu_isa.py): the probe on this CPU and
under EXPERTMESH_CPU_ISA; the portable linear path it forces against the fp32 reference and its batch invariance;
and a tiny bf16 model served as an AVX2-only CPU would run it (oneDNN and ATen capped in a subprocess: oneDNN
refuses bf16 prepacking there), against this CPU's fast path."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from expertmesh.kernels import batch_invariant as bi
from expertmesh.kernels import cpu_features, cpu_isa
from expertmesh.kernels.linear import cpu_kernel as ck

AVX2_BOX = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
CAP_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", cpu_features.ENV)
PORTABLE = f"portable ({bi.ROW_TILE}-row F.linear)"


def _reset():
    cpu_features.reset()
    cpu_isa.cpu_isa.cache_clear()


@pytest.fixture
def level(monkeypatch):
    """level(name): EXPERTMESH_CPU_ISA=name for the test, every cached choice made again (and again after)."""

    def force(name):
        monkeypatch.setenv(cpu_features.ENV, name)
        monkeypatch.setattr(ck, "_default", None)
        monkeypatch.setattr(ck, "_fast", None)
        _reset()

    yield force
    _reset()


def _bf16(gen, *shape):
    """Random bf16 with no zeros (|v| ≥ 2^-4): a zero input could hide a wrong product."""
    v = torch.randn(*shape, generator=gen)
    return torch.where(v.abs() < 2**-4, torch.full_like(v, 2**-4).copysign(v), v).bfloat16()


def _param(t):
    return torch.nn.Parameter(t, requires_grad=False)


@pytest.mark.skipif(any(os.environ.get(v) for v in CAP_VARS), reason="a cap is set for the whole run")
def test_the_probe_reports_this_cpu():
    _reset()
    has = torch.cpu.get_capabilities()
    isa = cpu_isa.cpu_isa()
    assert isa.caps == ()
    assert isa.avx2 == bool(has["avx2"])
    assert isa.avx512 == all(has[f"avx512_{x}"] for x in ("f", "bw", "vl", "dq"))
    assert isa.avx512_bf16 == bool(has["avx512_bf16"])
    assert isa.amx == bool(has["amx_tile"] and has["amx_bf16"])
    assert isa.avx_ne_convert == bool(has["avx_ne_convert"])
    assert isa.onednn_fp32_prepack  # every x86-64 CPU
    if isa.avx512 or isa.avx_ne_convert:  # oneDNN's own condition for bf16
        assert isa.onednn_bf16_prepack
    want_bf16 = f"row-invariant kernel {ck.default_isa()}" if ck.available() else "onednn-prepacked"
    assert isa.linear_bf16 == want_bf16
    line = isa.describe()
    print(line)
    assert f"linear bf16: {want_bf16}" in line and ("no-avx512 " not in line) == isa.avx512


def test_a_forced_level_caps_the_flags_and_an_unknown_one_is_refused(level):
    hardware = cpu_features._cpu_flags()
    level("avx2")
    f = cpu_features.features()
    assert (f.avx2, f.avx512, f.avx512_bf16, f.amx, f.avx_ne_convert) == (
        "avx2" in hardware,
        False,
        False,
        False,
        False,
    )
    assert "EXPERTMESH_CPU_ISA=avx2" in f.caps
    assert not cpu_features.onednn_prepacks(torch.bfloat16) and cpu_features.onednn_prepacks(torch.float32)
    kernel = ck.built() and "avx2" in hardware  # the linear kernel's AVX2 path; fp32 stays with oneDNN (no AVX-512)
    assert ck.available() == kernel and ck.default_isa() == ("avx2" if kernel else "portable")
    isa = cpu_isa.cpu_isa()
    assert (isa.linear_bf16, isa.linear_fp32) == (
        "row-invariant kernel avx2" if kernel else PORTABLE,
        "onednn-prepacked",
    )
    assert "[EXPERTMESH_CPU_ISA=avx2]" in isa.describe()
    level("portable")
    assert not cpu_features.onednn_prepacks(torch.float32)
    assert cpu_isa.cpu_isa().linear_fp32 == PORTABLE
    level("sse")
    with pytest.raises(ValueError, match="EXPERTMESH_CPU_ISA: expected one of portable, avx2, avx512, auto"):
        cpu_features.features()


def test_the_forced_portable_linear_matches_the_reference_and_rows_are_batch_invariant(level):
    """What a CPU without AVX2 runs for bf16 projections (no kernel fast path, no oneDNN bf16): F.linear on 16-row
    tiles. Within bf16 rounding of the fp32 reference and of this CPU's fast path (not its bits: another order),
    and each row's bits the same in any batch, at any position."""
    gen = torch.Generator().manual_seed(54)
    cases = [(64, 288), (1024, 96), (48, 40)]
    weights = {(k, n): _param(_bf16(gen, n, k)) for k, n in cases}
    inputs = {k: _bf16(gen, 40, k) for k, _ in cases}
    fast = {key: bi.linear(inputs[key[0]], w) for key, w in weights.items()}  # this CPU's own path
    level("portable")
    for (k, n), w in weights.items():
        w = _param(w.detach().clone())  # a fresh parameter: no copy cached under the fast path
        x = inputs[k]
        got = bi.linear(x, w)
        assert bi.packed_weight(w) is None and bi.kernel_weight(w) is None
        ref = x.float() @ w.float().T
        torch.testing.assert_close(got.float(), ref, rtol=1 / 128, atol=1e-5 * k)
        torch.testing.assert_close(got.float(), fast[(k, n)].float(), rtol=1 / 64, atol=2e-5 * k)
        alone = bi.linear(x[:1], w)[0]
        for m in (2, 5, 16, 17, 33):
            others = _bf16(gen, m, k)
            others[m // 2] = x[0]
            assert torch.equal(bi.linear(others, w)[m // 2], alone), (k, n, m)
        a, b = bi.linear_fused(x, [w, _param(w.detach()[: n // 2].clone())])
        assert torch.equal(a, got) and torch.equal(b, got[:, : n // 2])
    wb, xb = _bf16(gen, 4, 48, 80), _bf16(gen, 4, 1, 48)  # MLA's absorbed bmm: bmm_padded
    alone = bi.bmm(xb, wb)
    torch.testing.assert_close(alone.float(), xb.float() @ wb.float(), rtol=1 / 128, atol=1e-5 * 48)
    others = _bf16(gen, 4, 21, 48)
    others[:, 10] = xb[:, 0]
    assert torch.equal(bi.bmm(others, wb)[:, 10], alone[:, 0])


@pytest.mark.skipif(not (ck.built() and "avx2" in cpu_features._cpu_flags()), reason="no AVX2 or no kernel build")
def test_an_avx2_only_cpu_runs_the_kernel_s_avx2_path_with_the_portable_loop_s_bits(level):
    """Capped at AVX2 (an AVX2-only EPYC, where oneDNN refuses bf16), bf16 projections run the row-invariant kernel's
    AVX2 FMA path: the portable loop's bits for every projection, fused or not, and the bmm of MLA's absorbed
    attention, rows batch-invariant. (Checked here against the kernel's own portable loop, and that against the
    fp32 reference in tests/kernels/test_linear_cpu_kernel.py.)"""
    gen = torch.Generator().manual_seed(2054)
    level("avx2")
    assert ck.default_isa() == "avx2" and cpu_isa.cpu_isa().linear_bf16 == "row-invariant kernel avx2"
    for k, n in [(64, 288), (1024, 96), (47, 70)]:
        w, x = _param(_bf16(gen, n, k)), _bf16(gen, 9, k)
        got = bi.linear(x, w)
        assert bi.kernel_weight(w) is not None and bi.packed_weight(w) is None
        assert torch.equal(got, ck.linear(x, ck.pack_weight(w.detach()), n, k, isa="portable")), (k, n)
        torch.testing.assert_close(got.float(), x.float() @ w.float().T, rtol=1 / 128, atol=1e-5 * k)
        others = _bf16(gen, 21, k)
        others[13] = x[4]
        assert torch.equal(bi.linear(others, w)[13], got[4])
        a, b = bi.linear_fused(x, [w, _param(w.detach()[: n // 2].clone())])
        assert torch.equal(a, got) and torch.equal(b, got[:, : n // 2])
    wb, xb = _bf16(gen, 4, 48, 80), _bf16(gen, 4, 3, 48)
    assert torch.equal(bi.bmm(xb, wb), ck.bmm(xb, wb, isa="portable"))


GENERATE = textwrap.dedent(
    """
    import json, sys
    import torch
    from expertmesh.checkpoint.loader import Checkpoint
    from expertmesh.kernels import batch_invariant as bi
    from expertmesh.kernels.cpu_isa import cpu_isa
    from expertmesh.wire.sampling_params import SamplingParams
    from expertmesh.model.transformer import generate

    path, prompt, n, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    model = Checkpoint(path).load_model(dtype=torch.bfloat16)
    tokens = generate(model, prompt, SamplingParams(temperature=0.0, max_tokens=n)).tokens
    with torch.no_grad():
        logits = model.step(prompt + tokens, model.new_cache())
    torch.save(logits, out)
    bf16_packed = sum(1 for _, t in bi._packed.values() if t.dtype == torch.bfloat16)
    print(json.dumps({"isa": vars(cpu_isa()), "line": cpu_isa().describe(), "tokens": tokens,
                      "bf16_packed": bf16_packed, "kernel_packed": len(bi._kernel_packed) + len(bi._fused_packed)}))
    """
)


def test_a_tiny_bf16_model_runs_as_an_avx2_only_cpu_runs_it(tiny_checkpoint_dir, tmp_path):
    """oneDNN capped at AVX2 and ATen at avx2 (what an AVX2-only EPYC offers): oneDNN refuses to prepack bf16
    there, and before the portable path every projection raised. Now the probe says so, the linear kernel runs its
    AVX2 path (the portable loop's steps), and the model generates. Its logits agree with this CPU's fast path within
    bf16 rounding, and tokens are compared where the fast path's top two logits are apart by more than that: AMX and
    AVX512-BF16 sum in other orders or flush subnormals, and the contract does not promise their bits. Where this
    CPU's own path is the FMA one (AVX-512 without BF16), both sides take the same steps: logits and tokens must be
    bitwise the same."""
    prompt, n = [5, 17, 42, 9, 33, 61, 2], 6
    env = {k: v for k, v in os.environ.items() if k not in CAP_VARS} | AVX2_BOX | {"PYTHONSAFEPATH": "1"}
    done = subprocess.run(
        [sys.executable, "-c", GENERATE, str(tiny_checkpoint_dir), json.dumps(prompt), str(n), str(tmp_path / "l")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    print(got["line"])
    isa = got["isa"]
    assert not isa["avx512"] and not isa["avx512_bf16"] and not isa["amx"] and isa["aten"] == "AVX2"
    assert not isa["onednn_bf16_prepack"] and isa["onednn_fp32_prepack"]
    kernel = ck.built() and isa["avx2"]  # the row-invariant kernel's AVX2 path takes the bf16 projections
    assert isa["linear_bf16"] == ("row-invariant kernel avx2" if kernel else PORTABLE) and got["bf16_packed"] == 0
    assert (got["kernel_packed"] > 0) == kernel
    assert len(got["tokens"]) == n

    from expertmesh.checkpoint.loader import Checkpoint

    model = Checkpoint(tiny_checkpoint_dir).load_model(dtype=torch.bfloat16)
    with torch.no_grad():  # this CPU's fast path over the same tokens (a row's logits are its decode step's)
        fast_logits = model.step(prompt + got["tokens"], model.new_cache())
    logits = torch.load(tmp_path / "l")
    torch.testing.assert_close(logits.float(), fast_logits.float(), rtol=0.05, atol=0.05)
    at = fast_logits.float()[len(prompt) - 1 : -1]  # the positions that chose each generated token
    fast_tokens, top2 = at.argmax(-1).tolist(), at.topk(2).values
    clear = (top2[:, 0] - top2[:, 1] > 0.1).tolist()  # where the fast path's choice is clear of bf16 rounding
    first_close = clear.index(False) if False in clear else n
    assert got["tokens"][:first_close] == fast_tokens[:first_close]
    same = torch.equal(logits, fast_logits)
    print(f"greedy tokens: AVX2 box {got['tokens']}, fast path {fast_tokens}; logits bitwise the same: {same}")
    if kernel and ck.default_isa() in ("avx512", "avx2"):  # both sides take the portable loop's steps on FMAs
        assert same and got["tokens"] == fast_tokens
