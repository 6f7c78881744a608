"""A Transformer whose decoder starts from the pad token (Marian, T5): bos_id == pad_id is
allowed, and the masks stay right (the start token is never padding, later pad tokens are)."""

import torch

from qkv.models import Transformer, TransformerConfig


def _model() -> Transformer:
    torch.manual_seed(0)
    cfg = TransformerConfig(
        20, 20, d_model=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=2,
        dim_feedforward=32, dropout=0.0, max_positions=16, pad_id=0, bos_id=0, eos_id=1,
    )  # fmt: skip
    return Transformer(cfg).eval()


def test_the_start_token_is_not_padding_and_later_pads_are() -> None:
    model = _model()
    src = torch.tensor([[5, 6, 7, 0], [8, 9, 10, 11]])
    tgt = torch.tensor([[0, 4, 5, 0], [0, 6, 7, 8]])  # start token, then a padded row
    explicit = torch.tensor([[False, False, False, True], [False] * 4])
    with torch.no_grad():
        want = model(src, tgt, tgt_padding_mask=explicit)
        got = model(src, tgt)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        alone = model(src, tgt[:, :1])  # the start token alone: attended, not a masked row
        torch.testing.assert_close(alone, want[:, :1], atol=1e-5, rtol=1.3e-6)
        out = model.generate(src, 6)
    assert out[:, 0].tolist() == [0, 0] and out.shape[1] > 1
    memory = model.encode(src)
    cache = model.new_cache()
    steps = []
    with torch.no_grad():
        for t in range(3):  # cached decoding gives the teacher-forced logits
            steps.append(model.decode(tgt[:, t : t + 1], memory, src == 0, kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, 1), want[:, :3], atol=1e-5, rtol=1.3e-6)


def test_bart_style_options_change_the_state_dict_keys_only_when_set() -> None:
    base = TransformerConfig(
        20, 20, d_model=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
        dim_feedforward=32, positional="learned",
    )  # fmt: skip
    keys = set(Transformer(base).state_dict())
    bart = TransformerConfig.from_dict(
        {**base.to_dict(), "embed_norm": True, "final_norm": False, "share_positions": False,
         "head_bias": True, "scale_embeddings": False}
    )  # fmt: skip
    model = Transformer(bart)
    added = set(model.state_dict()) - keys
    removed = keys - set(model.state_dict())
    assert removed == {f"{s}.norm.{p}" for s in ("encoder", "decoder") for p in ("weight", "bias")}
    assert added == {
        "tgt_positional.embedding.weight", "lm_head.bias",
        *(f"{s}_embed_norm.{p}" for s in ("src", "tgt") for p in ("weight", "bias")),
    }  # fmt: skip
    assert model.embed_scale == 1.0
