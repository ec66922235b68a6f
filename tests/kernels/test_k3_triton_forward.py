"""The tiny Kimi K3 forward with every Triton kernel forced, against the PyTorch reference (issue #54, item 5).

`EXPERTMESH_KERNEL_BACKEND=triton` under `TRITON_INTERPRET=1` on CPU tensors runs, op for op, what a GPU runs: the
KDA chunked and recurrent kernels, the paged MLA / DSA decode kernels (indexer, sparse attention), the MXFP4 MoE
kernels — so the first GPU runs code that has already executed. The same forward under the torch backend (the
reference paths) gives the expected log-probs; `record_triton_launches` shows which kernels ran, and each Triton
kernel the project has for the model's layers (`triton_kernels()`) must have run at least once.

The checkpoints are tests/support/k3_checkpoint.py's (MXFP4 experts): plain K3 (its full-attention layers dense
MLA) and the K3+DSA twin (DeepSeek-V3.2's indexer on them). A short prompt (prefill: the chunked KDA form), then
one decode step (the recurrent form, the paged decode kernels). The DSA prompt is longer than index_topk so the
indexer's selection decides the decode. MXFP4 dequantisation (`dequantize_mxfp4`) is not on the forward path (the
MoE kernels decode MXFP4 in registers): it runs here on the loaded model's expert weights.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels (conftest sets it too)

import pytest  # noqa: E402
import torch  # noqa: E402
from support.k3_checkpoint import INDEXER, write_k3_checkpoint  # noqa: E402

from expertmesh.checkpoint.loader import Checkpoint  # noqa: E402
from expertmesh.kernels.backend import record_triton_launches, triton_kernels, use_backend  # noqa: E402
from expertmesh.kernels.mxfp4 import dequantize_mxfp4  # noqa: E402

pytestmark = pytest.mark.triton

# fp32 both ways; the kernels sum in another order than the reference (up to 1.1e-4 seen); a wrong kernel is O(1) off
LOGPROB_ATOL = 1e-3
INDEXER_KERNEL = "dsa.triton_dsa._paged_indexer_kernel"
VARIANTS = {
    # name: (with_indexer, prompt length, kernels not for this model's layers)
    "k3": (False, 4, {INDEXER_KERNEL: "its full-attention layers are dense MLA: no indexer"}),
    "k3dsa": (True, INDEXER["index_topk"] + 2, {}),
}


@pytest.fixture(scope="module")
def k3_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("k3triton")
    return {
        name: write_k3_checkpoint(root / name, experts="mxfp4", with_indexer=indexed)
        for name, (indexed, _, _) in VARIANTS.items()
    }


def prefill_then_decode(model, prompt: list[int]) -> torch.Tensor:
    """Log-probs [len(prompt) + 1, V]: the prompt in one step, then one decode step of its greedy token."""
    cache = model.new_cache()
    with torch.no_grad():
        first = model.step(prompt, cache)
        second = model.step([int(first[-1].argmax())], cache)
    return torch.cat([first, second]).float().log_softmax(-1)


def expert_weights(model):
    for layer in model.layers:
        if layer.is_moe:
            e = layer.moe.experts
            yield (e.gate_up_blocks, e.gate_up_scales)
            yield (e.down_blocks, e.down_scales)


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_k3_forward_runs_every_triton_kernel_and_matches_the_reference(k3_dirs, variant, monkeypatch):
    pytest.importorskip("triton")
    _, length, not_used = VARIANTS[variant]
    model = Checkpoint(k3_dirs[variant]).load_model()  # fp32
    prompt = [(37 * i + 11) % 300 for i in range(length)]
    with use_backend("torch"):
        want = prefill_then_decode(model, prompt)
        want_weights = [dequantize_mxfp4(b, s, torch.float32) for b, s in expert_weights(model)]
    monkeypatch.setenv("EXPERTMESH_KERNEL_BACKEND", "triton")
    with record_triton_launches() as launched:
        got = prefill_then_decode(model, prompt)
        got_weights = [dequantize_mxfp4(b, s, torch.float32) for b, s in expert_weights(model)]

    delta = (got - want).abs().max().item()
    print(f"\n{variant}: Triton kernels run (launches): " + ", ".join(f"{k} ×{n}" for k, n in sorted(launched.items())))
    print(f"{variant}: max |Δ log-prob| vs the torch backend = {delta:.2e} over {got.shape[0]} positions")
    expected = set(triton_kernels()) - set(not_used)
    missing = sorted(expected - set(launched))
    assert not missing, f"{variant}: these Triton kernels never ran: {missing}"
    assert set(launched) <= set(triton_kernels()), launched  # nothing launched that the listing does not know
    torch.testing.assert_close(got, want, rtol=0, atol=LOGPROB_ATOL)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for g, w in zip(got_weights, want_weights, strict=True):
        assert torch.equal(g, w)  # MXFP4 decoding is exact


def test_the_kernel_listing_names_every_launched_kernel():
    """`triton_kernels()` finds the kernels launched in kernels/*/triton_*.py and not the @triton.jit helpers they
    call (a helper is never launched on its own)."""
    pytest.importorskip("triton")
    names = triton_kernels()
    assert {
        "kda.triton_kda._chunk_state_kernel",
        "kda.triton_kda._decayed_grams_kernel",
        "kda.triton_kda._fused_recurrent_kda_kernel",
        INDEXER_KERNEL,
        "dsa.triton_dsa._paged_sparse_mla_kernel",
        "moe.triton_moe._gate_up_act_kernel",
        "moe.triton_moe._down_kernel",
        "mxfp4.triton_mxfp4._dequant_kernel",
    } <= set(names)
    assert not any(n.endswith(("._dot", "._tanh", "._sigmoid", ".e2m1_value", "._decode_plane")) for n in names)


def test_launches_are_counted_only_where_a_kernel_runs():
    """The counter sees the Triton kernel the dispatcher launched, and nothing under the torch backend."""
    pytest.importorskip("triton")
    blocks = torch.randint(0, 256, (4, 16), dtype=torch.uint8)
    scales = torch.full((4, 1), 127, dtype=torch.uint8)
    with use_backend("torch"), record_triton_launches() as launched:
        want = dequantize_mxfp4(blocks, scales, torch.float32)
    assert not launched
    with use_backend("triton"), record_triton_launches() as launched:
        got = dequantize_mxfp4(blocks, scales, torch.float32)
    assert launched == {"mxfp4.triton_mxfp4._dequant_kernel": 1} and torch.equal(got, want)
