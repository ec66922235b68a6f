import pytest
import torch

from expertmesh.chat.tokenizer import VOCAB_SIZE, ByteTokenizer
from expertmesh.model.sampling import Sampler
from expertmesh.wire.sampling_params import SamplingParams


def test_byte_round_trip_and_specials():
    tok = ByteTokenizer()
    text = "héllo, wörld ✓ <|eos|>"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.decode(ids) == text  # special-token text stays plain bytes
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id]) == text
    assert tok.decode([tok.think_start_id], skip_special=False) == "<|think|>"
    assert len({tok.eos_id, tok.bos_id, tok.think_end_id, tok.tool_call_start_id}) == 4
    assert all(256 <= i < VOCAB_SIZE for i in tok.id_to_special)
    assert tok.decode([104, VOCAB_SIZE, 105]) == "hi"  # ids past the vocabulary (padded rows) decode to nothing


def test_greedy_picks_argmax_lowest_on_ties():
    s = Sampler(SamplingParams(temperature=0.0))
    logits = torch.tensor([0.1, 3.0, 3.0, -1.0])
    assert s.sample(logits) == 1


def test_seeded_sampling_is_reproducible_and_respects_top_k_top_p():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.8, top_k=5, seed=42)
    a = [Sampler(params).sample(logits) for _ in range(3)]
    s1, s2 = Sampler(params), Sampler(params)
    seq1 = [s1.sample(logits) for _ in range(50)]
    seq2 = [s2.sample(logits) for _ in range(50)]
    assert seq1 == seq2 and len(set(a)) == 1
    allowed = set(torch.topk(logits, 5).indices.tolist())
    assert set(seq1) <= allowed and len(set(seq1)) > 1
    # top_p tiny → only the single most likely token survives
    s = Sampler(SamplingParams(temperature=1.0, top_p=1e-6, seed=0))
    assert {s.sample(logits) for _ in range(20)} == {int(torch.argmax(logits))}


@pytest.mark.parametrize(
    "field, value, needle", [("temperature", -1.0, "temperature"), ("top_p", 0.0, "top_p"), ("top_k", -2, "top_k")]
)
def test_bad_sampling_params(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        Sampler(SamplingParams(**{field: value}))


def test_logit_bias_and_penalties_follow_openais_formula():
    """logit[t] + bias[t] − presence·[count[t] > 0] − frequency·count[t] (OpenAI's definition), before greedy or
    temperature; min_p keeps the tokens within min_p of the top probability."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(40, generator=g)
    params = SamplingParams(
        temperature=0.0, presence_penalty=0.7, frequency_penalty=1.3, logit_bias=((2, 5.0), (9, -100.0))
    )
    s = Sampler(params)
    for t in [4, 4, 11, 4]:
        s.observe(t)
    want = logits.clone()
    want[2] += 5.0
    want[9] -= 100.0
    for t, n in {4: 3, 11: 1}.items():
        want[t] -= 0.7 + 1.3 * n
    assert torch.allclose(s._adjusted(logits), want)
    assert s.sample(logits) == int(torch.argmax(want))
    top = int(torch.argmax(logits))
    strict = Sampler(SamplingParams(temperature=1.0, min_p=1.0, seed=1))
    assert {strict.sample(logits) for _ in range(20)} == {top}
    forced = Sampler(SamplingParams(temperature=0.0, logit_bias=((7, 100.0),)))
    assert forced.sample(logits) == 7


@pytest.mark.parametrize(
    "field, value",
    [
        ("min_p", 1.5),
        ("min_p", float("nan")),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("logit_bias", ((3, 101.0),)),
    ],
)
def test_new_sampling_fields_are_range_checked(field, value):
    with pytest.raises(ValueError, match=field):
        Sampler(SamplingParams(**{field: value}))


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324])
def test_tiny_temperature_samples_the_argmax(temperature):
    """Found by the HTTP fuzzer: logits / 1e-300 overflowed to inf and softmax gave NaN (a 500)."""
    logits = torch.randn(64, generator=torch.Generator().manual_seed(2))
    s = Sampler(SamplingParams(temperature=temperature, seed=0))
    assert {s.sample(logits) for _ in range(5)} == {int(torch.argmax(logits))}
