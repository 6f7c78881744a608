"""The one-sentence encoder as a pure function of its weights, and its weight list.

:func:`encode_one` is what :class:`~qkv.apps.embed_one.OneSentenceProgram` exports and compiles
with AOTInductor: the mean-pooled, unit-length embedding of one sentence (no padding, so no
attention mask and no packing), its token count N dynamic. :func:`_laid_out` makes its weight
list from a :class:`~qkv.models.bert.BertEncoder`'s tensors (the query, key and value
projections of each layer packed into one matrix; column-major copies of the matrices for the
program that reads them as inputs, see :mod:`qkv.apps.embed_one`).

Shapes: N tokens of the sentence, D embedding width, H heads, Dh head width, F feed-forward
width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.apps.pooling import l2_normalize
from qkv.models.weight_copies import column_major_copies

__all__ = ["PER_LAYER", "OnePlan", "encode_one"]

PER_LAYER = 12
"""Tensors per layer in the weight list (see :meth:`OneSentenceProgram.weights`)."""


@dataclass(frozen=True)
class OnePlan:
    """The sizes :func:`encode_one` needs besides the weights.

    Attributes:
        layers: encoder layers.
        heads: H.
        width: D.
        eps: every LayerNorm's epsilon.
        scale: the attention score multiplier.
        activation: ``"gelu"`` (erf form) or ``"relu"``.
        frozen: the weights are the program's constants (packed by inductor's freezing): each
            product is ``F.linear``, its bias inside the product.
    """

    layers: int
    heads: int
    width: int
    eps: float
    scale: float
    activation: str
    frozen: bool = False


def _linear(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``x @ weight.t() + bias``, the bias added outside the product (see the module docstring)."""
    return (torch.mm(x, weight.t())[None] + bias)[0]  # [N, out]


def encode_one(weights: Sequence[Tensor], ids: Tensor, types: Tensor, plan: OnePlan) -> Tensor:
    """The mean-pooled, unit-length embedding of one sentence, as a pure function of the weights.

    Args:
        weights: :meth:`OneSentenceProgram.weights`.
        ids: ``[N]`` token ids, all real (no padding).
        types: ``[N]`` token type ids.
        plan: the sizes.

    Returns:
        ``[1, D]``.
    """
    N, D, H = ids.shape[0], plan.width, plan.heads
    linear = F.linear if plan.frozen else _linear
    word, position, token_type, norm_w, norm_b = weights[:5]
    x = F.embedding(ids, word) + position[:N] + F.embedding(types, token_type)  # [N, D]
    x = F.layer_norm(x, (D,), norm_w, norm_b, plan.eps)  # [N, D]
    for i in range(plan.layers):
        qkv_w, qkv_b, out_w, out_b, n1_w, n1_b, fc1_w, fc1_b, fc2_w, fc2_b, n2_w, n2_b = weights[
            5 + PER_LAYER * i : 5 + PER_LAYER * (i + 1)
        ]
        qkv = linear(x, qkv_w, qkv_b).view(N, 3, H, D // H).permute(1, 2, 0, 3)  # [3, H, N, Dh]
        o = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], scale=plan.scale)  # [H, N, Dh]
        o = o.transpose(0, 1).reshape(N, D)  # [N, D]
        x = F.layer_norm(x + linear(o, out_w, out_b), (D,), n1_w, n1_b, plan.eps)  # [N, D]
        h = linear(x, fc1_w, fc1_b)  # [N, F]
        h = F.gelu(h) if plan.activation == "gelu" else F.relu(h)  # [N, F]
        x = F.layer_norm(x + linear(h, fc2_w, fc2_b), (D,), n2_w, n2_b, plan.eps)  # [N, D]
    return l2_normalize(x.mean(dim=0, keepdim=True))  # [1, D]


class _Exported(nn.Module):
    """:func:`encode_one` as a module with flat tensor inputs, for ``torch.export``."""

    def __init__(self, plan: OnePlan) -> None:
        super().__init__()
        self.plan = plan

    def forward(self, ids: Tensor, types: Tensor, *weights: Tensor) -> Tensor:
        return encode_one(weights, ids[0], types[0], self.plan)  # [1, D]


class _Frozen(nn.Module):
    """:func:`encode_one` with the weights as the module's buffers (constants of the exported
    program, which freezing packs)."""

    def __init__(self, plan: OnePlan, weights: Sequence[Tensor]) -> None:
        super().__init__()
        self.plan = plan
        self.count = len(weights)
        for i, w in enumerate(weights):
            self.register_buffer(f"w{i}", w)

    def forward(self, ids: Tensor, types: Tensor) -> Tensor:
        weights = [cast(Tensor, getattr(self, f"w{i}")) for i in range(self.count)]
        return encode_one(weights, ids[0], types[0], self.plan)  # [1, D]


def _laid_out(sources: list[Tensor], *, column_major: bool) -> list[Tensor]:
    """:meth:`OneSentenceProgram.weights` from :meth:`OneSentenceProgram._sources` (with
    ``column_major=False``: the matrices as they are, for freezing to pack)."""
    out = [t.detach() for t in sources[:5]]
    matrices: dict[str, Tensor] = {}
    per_layer = (len(sources) - 5) // 16
    for i in range(per_layer):
        q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b, n1_w, n1_b, f1_w, f1_b, f2_w, f2_b, n2_w, n2_b = (
            t.detach() for t in sources[5 + 16 * i : 5 + 16 * (i + 1)]
        )
        matrices |= {
            f"{i}.qkv": torch.cat([q_w, k_w, v_w]),  # [3D, D]
            f"{i}.out": o_w,  # [D, D]
            f"{i}.fc1": f1_w,  # [F, D]
            f"{i}.fc2": f2_w,  # [D, F]
        }
        out += [matrices[f"{i}.qkv"], torch.cat([q_b, k_b, v_b]), o_w, o_b, n1_w, n1_b]
        out += [f1_w, f1_b, f2_w, f2_b, n2_w, n2_b]
    if not column_major:
        return out
    copies = column_major_copies(matrices)
    for i in range(per_layer):
        base = 5 + PER_LAYER * i
        out[base], out[base + 2] = copies[f"{i}.qkv"], copies[f"{i}.out"]
        out[base + 6], out[base + 8] = copies[f"{i}.fc1"], copies[f"{i}.fc2"]
    return out
