"""Run a model's attention context-parallel: a scope that routes each layer's call.

Inside ``with context_parallel(group, layout=...)``, every attention call of qkv's layers
(:class:`qkv.MultiHeadAttention` and what is built on it) runs
:func:`~qkv.distributed.context_parallel_attention` on the shards it is given, with its mask rule
read in global coordinates. A model's forward opens the scope (see
``DecoderOnlyLM.forward(..., context_parallel=...)``); the scope plans each distinct call once
(mask rule and shapes) and every layer reuses that plan, so one forward reads the rule's
tensors on the host once per distinct mask, not once per layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from qkv.distributed.attention import context_parallel_attention, global_length
from qkv.distributed.layout import Layout, check_layout, group_rank
from qkv.distributed.plan import ContextPlan, plan_context
from qkv.masks import FULL, Causal, StructuredMask, Tile, TileMask

__all__ = ["ContextParallel", "GlobalMask", "Scope", "active_scope", "context_parallel"]


@dataclass(frozen=True)
class ContextParallel:
    """Where a sequence is cut: the process group and the layout.

    Attributes:
        group: the ranks that share one sequence (None: the world).
        layout: ``"contiguous"`` or ``"zigzag"`` (balances causal work; the default).
    """

    group: dist.ProcessGroup | None = None
    layout: Layout = "zigzag"

    def __post_init__(self) -> None:
        check_layout(self.layout)

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return group_rank(self.group)[0]

    @property
    def world(self) -> int:
        """Ranks in the group."""
        return group_rank(self.group)[1]


class GlobalMask(StructuredMask):
    """A rule in global coordinates, with the lengths of the global grid it is read on.

    What a model passes its layers under context parallelism: each layer sees only its shards,
    so the mask says how long the whole sequences are (no collective needed to learn them), and
    one ``GlobalMask`` object shared by every layer is planned once.

    Args:
        rule: the rule (None: nothing blocked).
        length: global query length ``T``.
        kv_length: global key length ``S`` (default ``length``).
    """

    def __init__(
        self, rule: StructuredMask | None, length: int, kv_length: int | None = None
    ) -> None:
        self.rule = rule
        self.length = length
        self.kv_length = length if kv_length is None else kv_length

    def __repr__(self) -> str:
        return f"GlobalMask({self.rule!r}, T={self.length}, S={self.kv_length})"

    def validate(self, B: int, H: int, T: int, S: int, device: torch.device) -> None:
        if self.rule is not None:
            self.rule.validate(B, H, T, S, device)

    def tile(self, tile: Tile) -> TileMask:
        return FULL if self.rule is None else self.rule.tile(tile)


@dataclass
class Scope:
    """One forward's context-parallel state: the setting, the masks, the plans made so far.

    Attributes:
        setting: the group and layout.
        self_mask: the self-attention's mask in global coordinates.
        cross_mask: the cross-attention's (an encoder–decoder's decoder), or None.
        plans: one plan per mask and shapes, made on first use.
    """

    setting: ContextParallel
    self_mask: GlobalMask | None = None
    cross_mask: GlobalMask | None = None
    plans: dict[tuple[object, ...], ContextPlan] = field(default_factory=dict)

    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, *, cross: bool, is_causal: bool, scale: float | None
    ) -> Tensor:
        """One layer's call on its shards, planned once per mask and shapes.

        Args:
            q: this rank's queries ``[B, H, T_local, Dh]``.
            k: its keys ``[B, Hkv, S_local, Dh]``.
            v: its values ``[B, Hkv, S_local, Dv]``.
            cross: a cross-attention call (it runs ``cross_mask``, else ``self_mask``).
            is_causal: add a (global, bottom-right) causal rule.
            scale: the score scale, or None for ``1 / sqrt(Dh)``.

        Returns:
            This rank's output ``[B, H, T_local, Dv]``.

        Raises:
            ValueError: a cross-attention call in a scope without a cross mask.
        """
        mask = self.cross_mask if cross else self.self_mask
        if cross and mask is None:
            raise ValueError(
                "a cross-attention layer ran under context parallelism without a cross mask: "
                "the model's forward gives one (Transformer.forward(..., context_parallel=))"
            )
        B, H, T, _ = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        if mask is None:  # no mask given: learn the global lengths (one all-reduce a call)
            mask = GlobalMask(None, *global_length(T, S, group=self.setting.group))
        key = (id(mask), is_causal, B, H, Hkv, T, S)
        if key not in self.plans:
            rule = mask.rule
            if is_causal:
                rule = Causal() if rule is None else rule | Causal()
            s = self.setting
            self.plans[key] = plan_context(
                rule, batch=B, heads=H, kv_heads=Hkv, length=mask.length,
                kv_length=mask.kv_length, world=s.world, rank=s.rank, layout=s.layout,
                device=q.device,
            )  # fmt: skip
        plan = self.plans[key]
        return context_parallel_attention(
            q, k, v, plan.mask, scale=scale, group=self.setting.group, plan=plan
        )  # [B, H, T, Dv]


_active: ContextVar[Scope | None] = ContextVar("qkv_context_parallel", default=None)


def active_scope() -> Scope | None:
    """The innermost :func:`context_parallel` scope of this thread or task, or None."""
    return _active.get()


@contextlib.contextmanager
def context_parallel(
    setting: ContextParallel,
    self_mask: GlobalMask | None = None,
    cross_mask: GlobalMask | None = None,
) -> Iterator[Scope]:
    """Route qkv layers' attention through context parallelism for the block's duration.

    Args:
        setting: the group and layout the sequences are cut in.
        self_mask: the self-attention mask in global coordinates (None: nothing blocked but
            what a layer's ``is_causal`` adds; the lengths are then learned per call).
        cross_mask: the cross-attention mask (an encoder–decoder's decoder).

    Yields:
        The scope (its plans, for inspection).
    """
    scope = Scope(setting, self_mask, cross_mask)
    token = _active.set(scope)
    try:
        yield scope
    finally:
        _active.reset(token)
