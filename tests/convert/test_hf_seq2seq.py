"""load_hf / save_hf on encoder–decoders against transformers: tiny random BART and Marian saved
with save_pretrained; teacher-forced logits within 1e-4 on padded sources, greedy and beam
outputs equal to transformers.generate (rows stopping at different steps)."""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from pathlib import Path

import pytest
import torch
import transformers as tr

from qkv.convert import load_hf, save_hf
from qkv.models import Transformer

TOL = {"atol": 1e-4, "rtol": 0.0}  # the bound on logits
V = 64
SIZES = {
    "vocab_size": V, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 48,
    "decoder_ffn_dim": 48, "max_position_embeddings": 40, "init_std": 0.1,
    "forced_eos_token_id": None,
}  # fmt: skip


def _randomise(model: tr.PreTrainedModel) -> tr.PreTrainedModel:
    """Norm weights near 1, biases away from 0 (zero-initialised ones would not test the map)."""
    with torch.no_grad():
        model.final_logits_bias.normal_(0, 0.1)
        for n, p in model.named_parameters():
            if ("layernorm" in n or "layer_norm" in n) and n.endswith("weight"):
                p.normal_(1, 0.1)
            elif n.endswith("bias"):
                p.normal_(0, 0.2)
    return model.eval()


def _bart(eos: int = 2) -> tr.PreTrainedModel:
    torch.manual_seed(0)
    cfg = tr.BartConfig(**SIZES, eos_token_id=eos, decoder_start_token_id=2)
    return _randomise(tr.BartForConditionalGeneration(cfg))


def _marian(eos: int = 0) -> tr.PreTrainedModel:
    torch.manual_seed(1)
    cfg = tr.MarianConfig(
        **{**SIZES, "init_std": 0.3}, pad_token_id=V - 1, decoder_start_token_id=V - 1,
        eos_token_id=eos, activation_function="swish", scale_embedding=True,
    )  # fmt: skip
    return _randomise(tr.MarianMTModel(cfg))


MODELS = {"bart": _bart, "marian": _marian}
STOP = {"bart": 0, "marian": 44}  # a token the free generation of a row produces, as eos


def _source(pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    src = torch.randint(3, V - 1, (3, 9), generator=g)
    am = torch.ones_like(src)
    for row, length in ((1, 6), (2, 4)):  # right-padded sources of different lengths
        src[row, length:] = pad
        am[row, length:] = 0
    return src, am


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_logits_match_transformers(kind: str, tmp_path: Path) -> None:
    ref = MODELS[kind]()
    ref.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    assert isinstance(ours, Transformer)
    c = ours.config
    src, am = _source(c.pad_id)
    tgt = torch.randint(3, V - 1, (3, 7))
    tgt[:, 0] = c.bos_id
    with torch.no_grad():
        want = ref(input_ids=src, attention_mask=am, decoder_input_ids=tgt).logits
        torch.testing.assert_close(ours(src, tgt), want, **TOL)
        cache, memory = ours.new_cache(), ours.encode(src)
        steps = [ours.decode(tgt[:, t : t + 1], memory, am == 0, kv_cache=cache) for t in range(7)]
        torch.testing.assert_close(torch.cat(steps, 1), want, **TOL)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_greedy_and_beam_equal_transformers_generate(kind: str, tmp_path: Path) -> None:
    ref = MODELS[kind](eos=STOP[kind])
    ref.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    assert isinstance(ours, Transformer)
    src, am = _source(ours.config.pad_id)
    for beams in (1, 3):
        with torch.no_grad():
            want = ref.generate(
                src, attention_mask=am, max_new_tokens=12, do_sample=False, num_beams=beams
            )
        got = ours.generate(src, 12, beam_size=beams)
        assert got.tolist() == want.tolist(), beams
        if beams == 1:  # greedy rows end at different steps
            stopped = (got[:, 1:] == STOP[kind]).any(dim=1).tolist()
            assert True in stopped and False in stopped, got


def test_save_hf_writes_bart_that_transformers_loads(tmp_path: Path) -> None:
    ref = _bart()
    ref.save_pretrained(tmp_path / "in")
    ours = load_hf(tmp_path / "in")
    assert isinstance(ours, Transformer)
    back = tr.BartForConditionalGeneration.from_pretrained(save_hf(ours, tmp_path / "out"))
    src, am = _source(ours.config.pad_id)
    tgt = torch.randint(3, V - 1, (3, 5))
    with torch.no_grad():
        torch.testing.assert_close(
            back.eval()(input_ids=src, attention_mask=am, decoder_input_ids=tgt).logits,
            ours(src, tgt),
            **TOL,
        )
    again = load_hf(tmp_path / "out")
    torch.testing.assert_close(again.state_dict(), ours.state_dict(), rtol=0, atol=0)


def test_unsupported_options_and_bad_shapes_are_named(tmp_path: Path) -> None:
    torch.manual_seed(0)
    odd = tr.BartConfig(**{**SIZES, "decoder_ffn_dim": 40})
    tr.BartForConditionalGeneration(odd).save_pretrained(tmp_path / "odd")
    with pytest.raises(ValueError, match="encoder_ffn_dim=48 != decoder_ffn_dim=40"):
        load_hf(tmp_path / "odd")
    _bart().save_pretrained(tmp_path / "b")
    cfg = (tmp_path / "b" / "config.json").read_text()
    (tmp_path / "b" / "config.json").write_text(cfg.replace('"d_model": 32', '"d_model": 16'))
    with pytest.raises(
        ValueError, match=r"shared.weight has shape \[64, 32\], expected \[64, 16\]"
    ):
        load_hf(tmp_path / "b")


def test_forced_bos_and_eos_as_transformers_generate(tmp_path: Path) -> None:
    """BART's default config forces eos (2) at the last step; a forced_bos_token_id in
    generation_config.json (which transformers reads before config.json) forces the first."""
    torch.manual_seed(0)
    sizes = {k: v for k, v in SIZES.items() if k != "forced_eos_token_id"}
    cfg = tr.BartConfig(**sizes, eos_token_id=0, decoder_start_token_id=2)
    assert cfg.forced_eos_token_id == 2
    _randomise(tr.BartForConditionalGeneration(cfg)).save_pretrained(tmp_path)
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**gen, "forced_bos_token_id": 7}))
    ref = tr.BartForConditionalGeneration.from_pretrained(tmp_path).eval()
    ours = load_hf(tmp_path)
    assert isinstance(ours, Transformer)
    assert (ours.config.forced_bos_id, ours.config.forced_eos_id) == (7, 2)
    src, am = _source(ours.config.pad_id)
    for beams in (1, 3):
        with torch.no_grad():
            want = ref.generate(
                src, attention_mask=am, max_new_tokens=6, do_sample=False, num_beams=beams
            )
        got = ours.generate(src, 6, beam_size=beams)
        assert got.tolist() == want.tolist(), beams
        assert (got[:, 1] == 7).all() and (got[:, -1] == 2).all(), got
