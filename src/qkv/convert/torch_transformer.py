"""``nn.Transformer`` (and its encoder / decoder layers) <-> qkv weight conversion.

The parts map one to one; only the names and PyTorch's packed ``in_proj_weight`` differ
(handled by :mod:`qkv.convert.torch_mha`):

===============================  ===============================
``nn.TransformerEncoderLayer``   :class:`qkv.nn.EncoderLayer`
===============================  ===============================
``self_attn``                    ``self_attn``
``multihead_attn`` (decoder)     ``cross_attn``
``linear1`` / ``linear2``        ``ffn.fc1`` / ``ffn.fc2``
``norm1..3``                     ``norm1..3``
``nn.Transformer.encoder.norm``  ``EncoderDecoder.encoder.norm``
===============================  ===============================

A converted module keeps the source's ``batch_first`` and takes the source's call: the same
signature, positional order, mask senses and (no) implicit causal mask, so it is a drop-in.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from qkv.convert.torch_mha import from_torch_mha, to_torch_mha
from qkv.models.transformer import Transformer
from qkv.nn.feed_forward import FeedForward
from qkv.nn.layers import DecoderLayer, EncoderLayer
from qkv.nn.multihead import MultiHeadAttention
from qkv.nn.stacks import Decoder, Encoder, EncoderDecoder

__all__ = [
    "from_torch_decoder_layer",
    "from_torch_encoder_layer",
    "from_torch_transformer",
    "to_torch_decoder_layer",
    "to_torch_encoder_layer",
    "to_torch_transformer",
]

TorchLayer = nn.TransformerEncoderLayer | nn.TransformerDecoderLayer
QkvLayer = EncoderLayer | DecoderLayer


def _activation_name(layer: TorchLayer) -> str:
    act = layer.activation
    if act is F.relu or isinstance(act, nn.ReLU):
        return "relu"
    if act is F.gelu or (isinstance(act, nn.GELU) and act.approximate == "none"):
        return "gelu"
    raise ValueError(f"only relu and exact gelu activations convert, got {act!r}")


def _copy_linear(dst: nn.Linear | nn.LayerNorm, src: nn.Linear | nn.LayerNorm) -> None:
    """Copy weight and bias (a missing source bias becomes zeros); LayerNorms alike."""
    assert dst.weight is not None and src.weight is not None
    dst.weight.copy_(src.weight)
    if dst.bias is not None:
        if src.bias is None:
            dst.bias.zero_()
        else:
            dst.bias.copy_(src.bias)


def _copy_norm(dst: nn.Module, src: nn.Module) -> None:
    if not isinstance(dst, nn.LayerNorm) or not isinstance(src, nn.LayerNorm):
        raise ValueError(
            f"only LayerNorm converts between nn.Transformer and qkv, got {type(src).__name__} "
            f"-> {type(dst).__name__}"
        )
    _copy_linear(dst, src)


def _layer_kwargs(layer: TorchLayer) -> dict[str, Any]:
    w = layer.linear1.weight
    return {
        "d_model": layer.self_attn.embed_dim,
        "num_heads": layer.self_attn.num_heads,
        "dim_feedforward": layer.linear1.out_features,
        "dropout": layer.dropout.p,
        "activation": _activation_name(layer),
        "norm_first": layer.norm_first,
        "layer_norm_eps": layer.norm1.eps,
        "bias": layer.linear1.bias is not None,
        "batch_first": layer.self_attn.batch_first,
        "device": w.device,
        "dtype": w.dtype,
    }


# (PyTorch attribute, qkv attribute) of every part of a layer; the decoder adds its cross-attention.
_ENCODER_PARTS: tuple[tuple[str, str], ...] = (
    ("self_attn", "self_attn"),
    ("linear1", "ffn.fc1"),
    ("linear2", "ffn.fc2"),
    ("norm1", "norm1"),
    ("norm2", "norm2"),
)
_DECODER_PARTS = (*_ENCODER_PARTS, ("multihead_attn", "cross_attn"), ("norm3", "norm3"))
_PARTS: dict[type[nn.Module], tuple[tuple[str, str], ...]] = {
    nn.TransformerEncoderLayer: _ENCODER_PARTS,
    nn.TransformerDecoderLayer: _DECODER_PARTS,
    EncoderLayer: _ENCODER_PARTS,
    DecoderLayer: _DECODER_PARTS,
}
_L = TypeVar("_L", bound=nn.Module)


def _copy_part(dst: nn.Module, src: nn.Module) -> None:
    if isinstance(src, nn.MultiheadAttention):
        dst.load_state_dict(from_torch_mha(src).state_dict())
    elif isinstance(src, MultiHeadAttention):
        dst.load_state_dict(to_torch_mha(src).state_dict())
    elif isinstance(src, nn.Linear):
        assert isinstance(dst, nn.Linear)
        _copy_linear(dst, src)
    else:
        _copy_norm(dst, src)


def _convert_layer(layer: nn.Module, out: _L, to_torch: bool) -> _L:
    """Copy every part of ``layer`` into ``out`` (built with the same sizes), by the table."""
    with torch.no_grad():
        for torch_name, qkv_name in _PARTS[type(out)]:
            src_name, dst_name = (qkv_name, torch_name) if to_torch else (torch_name, qkv_name)
            _copy_part(out.get_submodule(dst_name), layer.get_submodule(src_name))
    return out.train(layer.training)


def _from_torch(layer: object, torch_cls: type[nn.Module], qkv_cls: type[_L]) -> _L:
    if not isinstance(layer, torch_cls):
        raise TypeError(f"expected nn.{torch_cls.__name__}, got {type(layer).__name__}")
    assert isinstance(layer, TorchLayer)
    return _convert_layer(layer, qkv_cls(**_layer_kwargs(layer)), to_torch=False)


def _to_torch(layer: object, qkv_cls: type[nn.Module], torch_cls: type[_L]) -> _L:
    if not isinstance(layer, qkv_cls):
        raise TypeError(f"expected qkv.nn.{qkv_cls.__name__}, got {type(layer).__name__}")
    assert isinstance(layer, QkvLayer)
    return _convert_layer(layer, torch_cls(**_check_exportable(layer)), to_torch=True)


def from_torch_encoder_layer(layer: nn.TransformerEncoderLayer) -> EncoderLayer:
    """A qkv :class:`EncoderLayer` holding copies of ``layer``'s weights (same training mode).

    Raises:
        TypeError: not an ``nn.TransformerEncoderLayer``.
        ValueError: an activation other than relu / exact gelu.
    """
    return _from_torch(layer, nn.TransformerEncoderLayer, EncoderLayer)


def from_torch_decoder_layer(layer: nn.TransformerDecoderLayer) -> DecoderLayer:
    """A qkv :class:`DecoderLayer` holding copies of ``layer``'s weights (same training mode).

    Raises:
        TypeError: not an ``nn.TransformerDecoderLayer``.
        ValueError: an activation other than relu / exact gelu.
    """
    return _from_torch(layer, nn.TransformerDecoderLayer, DecoderLayer)


def from_torch_transformer(module: nn.Transformer) -> EncoderDecoder:
    """A qkv :class:`EncoderDecoder` holding copies of ``module``'s weights.

    Call it as ``module``: the same signature, masks and ``batch_first``; it gives the same
    outputs (tested in eval mode to float32 atol 1e-5). To put the weights into a full
    :class:`qkv.Transformer`, ``model.encoder.load_state_dict(body.encoder.state_dict())`` (and
    the same for the decoder).

    Raises:
        TypeError: not an ``nn.Transformer``.
        ValueError: a custom encoder/decoder or an unsupported activation.
    """
    if not isinstance(module, nn.Transformer):
        raise TypeError(f"expected nn.Transformer, got {type(module).__name__}")
    enc, dec = module.encoder, module.decoder
    if not isinstance(enc, nn.TransformerEncoder) or not isinstance(dec, nn.TransformerDecoder):
        raise ValueError("custom_encoder / custom_decoder modules do not convert")
    enc_layers = [from_torch_encoder_layer(layer) for layer in enc.layers]
    dec_layers = [from_torch_decoder_layer(layer) for layer in dec.layers]

    def norm(src: nn.Module | None) -> nn.Module | None:
        if src is None:
            return None
        if not isinstance(src, nn.LayerNorm):
            raise ValueError(f"only LayerNorm final norms convert, got {type(src).__name__}")
        dst = nn.LayerNorm(
            src.normalized_shape, eps=src.eps, device=src.weight.device, dtype=src.weight.dtype
        )
        with torch.no_grad():
            _copy_norm(dst, src)
        return dst

    out = EncoderDecoder(Encoder(enc_layers, norm(enc.norm)), Decoder(dec_layers, norm(dec.norm)))
    return out.train(module.training)


def _check_exportable(layer: QkvLayer) -> dict[str, Any]:
    attn = layer.self_attn
    if attn.num_kv_heads != attn.num_heads:
        raise ValueError(
            f"nn.Transformer has no grouped-query attention: num_kv_heads={attn.num_kv_heads} "
            f"!= num_heads={attn.num_heads}"
        )
    ffn: FeedForward = layer.ffn
    if ffn.activation not in ("relu", "gelu"):
        raise ValueError(f"nn.Transformer has no {ffn.activation!r} feed-forward")
    if not isinstance(layer.norm1, nn.LayerNorm):
        raise ValueError(f"nn.Transformer has LayerNorm only, got {type(layer.norm1).__name__}")
    w = ffn.fc1.weight
    return {
        "d_model": attn.embed_dim,
        "nhead": attn.num_heads,
        "dim_feedforward": ffn.fc1.out_features,
        "dropout": layer.dropout1.p,
        "activation": ffn.activation,
        "layer_norm_eps": layer.norm1.eps,
        "batch_first": attn.batch_first,
        "norm_first": layer.norm_first,
        "bias": ffn.fc1.bias is not None,
        "device": w.device,
        "dtype": w.dtype,
    }


def to_torch_encoder_layer(layer: EncoderLayer) -> nn.TransformerEncoderLayer:
    """An ``nn.TransformerEncoderLayer`` (``layer``'s ``batch_first``) with copies of its weights.

    Raises:
        TypeError: not a qkv :class:`EncoderLayer`.
        ValueError: GQA, SwiGLU or RMSNorm, which PyTorch's layer cannot express.
    """
    return _to_torch(layer, EncoderLayer, nn.TransformerEncoderLayer)


def to_torch_decoder_layer(layer: DecoderLayer) -> nn.TransformerDecoderLayer:
    """An ``nn.TransformerDecoderLayer`` (``layer``'s ``batch_first``) with copies of its weights.

    Raises:
        TypeError: not a qkv :class:`DecoderLayer`.
        ValueError: GQA, SwiGLU or RMSNorm, which PyTorch's layer cannot express.
    """
    return _to_torch(layer, DecoderLayer, nn.TransformerDecoderLayer)


def to_torch_transformer(module: EncoderDecoder | Transformer) -> nn.Transformer:
    """An ``nn.Transformer`` (the layers' ``batch_first``) with copies of the encoder/decoder
    weights.

    A full :class:`qkv.Transformer` exports its body (embeddings, positions and head have no
    place in ``nn.Transformer``).

    Raises:
        TypeError: neither an :class:`EncoderDecoder` nor a :class:`qkv.Transformer`.
        ValueError: no layers, or GQA / SwiGLU / RMSNorm.
    """
    if not isinstance(module, EncoderDecoder | Transformer):
        raise TypeError(f"expected qkv EncoderDecoder or Transformer, got {type(module).__name__}")
    enc, dec = module.encoder, module.decoder
    if len(enc.layers) == 0 or len(dec.layers) == 0:
        raise ValueError("nn.Transformer needs at least one encoder and one decoder layer")
    first = enc.layers[0]
    assert isinstance(first, EncoderLayer)
    kw = _check_exportable(first)
    out = nn.Transformer(
        kw["d_model"],
        kw["nhead"],
        len(enc.layers),
        len(dec.layers),
        kw["dim_feedforward"],
        kw["dropout"],
        kw["activation"],
        layer_norm_eps=kw["layer_norm_eps"],
        batch_first=kw["batch_first"],
        norm_first=kw["norm_first"],
        bias=kw["bias"],
        device=kw["device"],
        dtype=kw["dtype"],
    )
    with torch.no_grad():
        for dst, src in zip(out.encoder.layers, enc.layers, strict=True):
            assert isinstance(src, EncoderLayer)
            dst.load_state_dict(to_torch_encoder_layer(src).state_dict())
        for dst, src in zip(out.decoder.layers, dec.layers, strict=True):
            assert isinstance(src, DecoderLayer)
            dst.load_state_dict(to_torch_decoder_layer(src).state_dict())
        for torch_stack, qkv_stack in ((out.encoder, enc), (out.decoder, dec)):
            if qkv_stack.norm is None:
                torch_stack.norm = None
            else:
                _copy_norm(torch_stack.norm, qkv_stack.norm)
    return out.train(module.training)
