"""The two RoPE layouts against independent formulas, and wired through a whole model.

``half_split`` pairs ``(x[i], x[i + Dh/2])`` (Hugging Face Llama); ``interleaved`` pairs
``(x[2i], x[2i + 1])`` (GPT-J, Meta's original Llama, whose code multiplies complex numbers).
"""

import pytest
import torch

from qkv.models import DecoderOnlyConfig, DecoderOnlyLM
from qkv.nn.positional import ROPE_LAYOUTS, RotaryEmbedding, apply_rotary, rotary_cos_sin

Dh, T, BASE = 8, 6, 500.0


def _angles(positions: torch.Tensor) -> torch.Tensor:
    inv_freq = torch.tensor([BASE ** (-2 * i / Dh) for i in range(Dh // 2)], dtype=torch.float64)
    return positions.double()[:, None] * inv_freq  # [T, Dh/2]


def _half_split_loop(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The rotation written pair by pair, in float64."""
    out = torch.empty_like(x)
    theta = _angles(positions)  # [T, Dh/2]
    h = Dh // 2
    for i in range(h):
        c, s = torch.cos(theta[:, i]), torch.sin(theta[:, i])  # [T]
        a, b = x[..., i], x[..., i + h]
        out[..., i] = a * c - b * s
        out[..., i + h] = a * s + b * c
    return out


def _meta_complex(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Meta's original ``apply_rotary_emb``: consecutive pairs as complex numbers times
    ``exp(i * theta)``."""
    freqs_cis = torch.polar(torch.ones_like(_angles(positions)), _angles(positions))  # [T, Dh/2]
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], Dh // 2, 2).contiguous())
    return torch.view_as_real(xc * freqs_cis).flatten(-2)  # [B, H, T, Dh]


@pytest.fixture
def x() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(2, 3, T, Dh, dtype=torch.float64)  # [B, H, T, Dh]


@pytest.mark.parametrize("offset", [0, 5])
def test_half_split_matches_the_pairwise_formula(x: torch.Tensor, offset: int) -> None:
    positions = torch.arange(offset, offset + T)
    cos, sin = rotary_cos_sin(positions, Dh, base=BASE, layout="half_split")
    assert cos.shape == (T, Dh)
    torch.testing.assert_close(
        apply_rotary(x, cos.double(), sin.double()), _half_split_loop(x, positions)
    )


@pytest.mark.parametrize("offset", [0, 5])
def test_interleaved_matches_metas_complex_formula(x: torch.Tensor, offset: int) -> None:
    positions = torch.arange(offset, offset + T)
    cos, sin = rotary_cos_sin(positions, Dh, base=BASE, layout="interleaved")
    assert cos.shape == (T, Dh // 2)
    torch.testing.assert_close(
        apply_rotary(x, cos.double(), sin.double()), _meta_complex(x, positions)
    )


def _rotate(x: torch.Tensor, layout: str) -> torch.Tensor:
    cos, sin = rotary_cos_sin(torch.arange(T), Dh, base=BASE, layout=layout)  # type: ignore[arg-type]
    return apply_rotary(x, cos.double(), sin.double())


def test_the_layouts_differ_by_a_permutation_of_the_head_dims(x: torch.Tensor) -> None:
    perm = torch.cat([torch.arange(0, Dh, 2), torch.arange(1, Dh, 2)])  # evens, then odds
    inter = _rotate(x, "interleaved")
    torch.testing.assert_close(inter[..., perm], _rotate(x[..., perm], "half_split"))
    assert not torch.allclose(inter, _rotate(x, "half_split"))


def test_rotary_embedding_slices_the_layouts_tables() -> None:
    rope = RotaryEmbedding(Dh, 16, base=BASE, layout="interleaved")
    cos, sin = rope(3, offset=4)
    expected = rotary_cos_sin(torch.arange(4, 7), Dh, base=BASE, layout="interleaved")
    torch.testing.assert_close((cos, sin), expected, atol=0, rtol=0)


def test_bad_layout_and_table_width_are_named() -> None:
    with pytest.raises(ValueError, match=r"rope layout.*'meta'"):
        rotary_cos_sin(torch.arange(3), Dh, layout="meta")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="width 3 do not fit head width 8"):
        apply_rotary(torch.zeros(1, 1, 2, Dh), torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"rope_layout must be one of.*'meta'"):
        DecoderOnlyConfig(10, rope_layout="meta")  # type: ignore[arg-type]


def _lm(layout: str) -> DecoderOnlyLM:
    torch.manual_seed(3)
    cfg = DecoderOnlyConfig(
        40, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, dim_feedforward=48,
        dropout=0.0, max_positions=32, rope_theta=BASE, rope_layout=layout,  # type: ignore[arg-type]
    )  # fmt: skip
    return DecoderOnlyLM(cfg).eval()


@torch.no_grad()
def test_an_interleaved_model_equals_a_half_split_one_with_permuted_query_key_rows() -> None:
    """The permutation Hugging Face applies to Meta's Llama weights: within each head, rows
    ``(2i, 2i + 1)`` go to ``(i, i + Dh/2)``. The same logits show the layout reaches every
    layer, in the full forward pass and in cached decoding."""
    inter, half = _lm("interleaved"), _lm("half_split")
    assert inter.config.to_dict()["rope_layout"] == "interleaved"
    assert DecoderOnlyConfig.from_dict(inter.config.to_dict()) == inter.config
    hd = inter.config.head_dim
    state = inter.state_dict()
    for name, w in state.items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            heads = w.shape[0] // hd
            rows = w.reshape(heads, hd // 2, 2, *w.shape[1:]).transpose(1, 2)
            state[name] = rows.reshape(w.shape)
    half.load_state_dict(state)
    ids = torch.randint(0, 40, (2, 11))
    full = inter(ids)  # [B, T, V]
    torch.testing.assert_close(half(ids), full)
    assert not torch.allclose(_lm("half_split")(ids), full, atol=1e-3)  # the layout matters
    cache = inter.new_cache(11)
    step = [inter(ids[:, :7], kv_cache=cache)[:, -1]]
    step += [inter(ids[:, t : t + 1], kv_cache=cache)[:, -1] for t in range(7, 11)]
    torch.testing.assert_close(torch.stack(step, 1), full[:, 6:])


def test_both_layouts_are_named() -> None:
    assert ROPE_LAYOUTS == ("half_split", "interleaved")
