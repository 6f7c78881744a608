"""Positions: why they matter (permutation test), and each scheme against its formula."""

import math

import pytest
import torch

from qkv import Transformer, TransformerConfig
from qkv.nn.positional import (
    ALiBi,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    alibi_bias,
    alibi_slopes,
    apply_rotary,
    rotary_cos_sin,
    sinusoidal_table,
)

POSITIONALS = ["sinusoidal", "learned", "rotary", "alibi"]


def _encoder(positional: str) -> Transformer:
    cfg = TransformerConfig(
        src_vocab_size=20, tgt_vocab_size=20, d_model=16, num_heads=4, num_encoder_layers=2,
        num_decoder_layers=1, dim_feedforward=32, dropout=0.0, positional=positional,
    )  # fmt: skip
    return Transformer(cfg).eval()


@torch.no_grad()
def test_without_positions_permuting_tokens_permutes_the_output() -> None:
    model = _encoder("none")
    src = torch.randint(3, 20, (2, 9))
    perm = torch.randperm(9)
    torch.testing.assert_close(model.encode(src[:, perm]), model.encode(src)[:, perm])


@pytest.mark.parametrize("positional", POSITIONALS)
@torch.no_grad()
def test_with_positions_permuting_tokens_changes_the_output(positional: str) -> None:
    model = _encoder(positional)
    if positional == "learned":  # trained tables are far from zero; make the test meaningful
        torch.nn.init.normal_(model.positional.embedding.weight)  # type: ignore[union-attr]
    src = torch.arange(3, 12)[None]  # distinct tokens
    perm = torch.roll(torch.arange(9), 1)
    diff = (model.encode(src[:, perm]) - model.encode(src)[:, perm]).abs().max()
    assert diff > 1e-2


def test_sinusoidal_table_matches_the_formula() -> None:
    L, D = 50, 12
    table = sinusoidal_table(L, D)
    for p in (0, 1, 7, 49):
        for i in range(D // 2):
            angle = p / 10000 ** (2 * i / D)
            assert table[p, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[p, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    enc = SinusoidalPositionalEncoding(D, L)
    x = torch.zeros(1, 5, D)
    torch.testing.assert_close(enc(x, offset=3)[0], table[3:8])
    assert "table" not in enc.state_dict()
    with pytest.raises(ValueError, match="max_positions"):
        enc(torch.zeros(1, 5, D), offset=46)


def test_rotary_scores_depend_on_relative_position_only() -> None:
    Dh = 8
    q, k = (
        torch.randn(1, 1, 1, Dh, dtype=torch.float64),
        torch.randn(1, 1, 1, Dh, dtype=torch.float64),
    )

    def score(i: int, j: int) -> float:
        ci, si = rotary_cos_sin(torch.tensor([i]), Dh)
        cj, sj = rotary_cos_sin(torch.tensor([j]), Dh)
        qi = apply_rotary(q, ci.double(), si.double())
        kj = apply_rotary(k, cj.double(), sj.double())
        return float((qi * kj).sum())

    assert score(5, 2) == pytest.approx(score(13, 10), abs=1e-6)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)
    # a rotation keeps the norm, and position 0 is the identity
    c, s = rotary_cos_sin(torch.arange(6), Dh)
    x = torch.randn(2, 3, 6, Dh)
    torch.testing.assert_close(apply_rotary(x, c, s).norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(apply_rotary(x, c, s)[:, :, 0], x[:, :, 0])
    rope = RotaryEmbedding(Dh, 16)
    cos, sin = rope(3, offset=4)
    expected_cos, expected_sin = rotary_cos_sin(torch.arange(4, 7), Dh)
    torch.testing.assert_close(cos, expected_cos, atol=0, rtol=0)
    torch.testing.assert_close(sin, expected_sin, atol=0, rtol=0)
    with pytest.raises(ValueError, match="even"):
        rotary_cos_sin(torch.arange(3), 7)


def test_alibi_slopes_and_bias() -> None:
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    # not a power of two: the 4 slopes of H=4, then every other slope of H=8
    expected6 = [2.0 ** (-2 * (i + 1)) for i in range(4)] + [2.0**-1, 2.0**-3]
    torch.testing.assert_close(alibi_slopes(6), torch.tensor(expected6))
    slopes = alibi_slopes(2)
    bias = alibi_bias(slopes, 2, 4, causal=True)  # queries at positions 2, 3
    assert bias.shape == (1, 2, 2, 4)
    expected = -slopes[:, None, None] * torch.tensor([[2.0, 1, 0, 0], [3, 2, 1, 0]])
    torch.testing.assert_close(bias[0], expected)
    sym = ALiBi(2)(3, 3, causal=False)
    torch.testing.assert_close(sym, sym.transpose(-1, -2))
    with pytest.raises(ValueError, match="S >= "):
        alibi_bias(slopes, 4, 2, causal=True)
