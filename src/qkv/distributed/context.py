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

import torch.distributed as dist
from torch import Tensor

from qkv.distributed.attention import context_parallel_attention, global_length
from qkv.distributed.layout import Layout, check_layout, group_rank
from qkv.distributed.plan import ContextPlan, plan_context
from qkv.masks import Causal, StructuredMask

__all__ = ["ContextParallel", "Scope", "active_scope", "context_parallel"]


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


@dataclass
class Scope:
    """One forward's context-parallel state: the setting and the plans made so far.

    Attributes:
        setting: the group and layout.
        lengths: global lengths per local length, learned once (one all-reduce).
        plans: one plan per mask rule and shapes (the rule is kept so its id stays unique).
    """

    setting: ContextParallel
    lengths: dict[int, int] = field(default_factory=dict)
    plans: dict[tuple[object, ...], tuple[StructuredMask | None, ContextPlan]] = field(
        default_factory=dict
    )

    def _global(self, *local: int) -> list[int]:
        missing = [n for n in local if n not in self.lengths]
        if missing:
            found = global_length(*missing, group=self.setting.group)
            self.lengths.update(zip(missing, found, strict=True))
        return [self.lengths[n] for n in local]

    def attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: StructuredMask | None,
        is_causal: bool,
        scale: float | None,
    ) -> Tensor:
        """One layer's call on its shards, planned once per rule and shapes.

        Raises:
            TypeError: a mask given as a tensor (its coordinates would be local: give the model
                global rules, which its forward does under context parallelism).
        """
        if mask is not None and not isinstance(mask, StructuredMask):
            raise TypeError(
                "under context parallelism a layer's mask must be a qkv rule in global "
                f"coordinates, got a {type(mask).__name__}; a model's forward builds such rules "
                "when given context_parallel="
            )
        B, H, T, _ = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        key = (id(mask), is_causal, B, H, Hkv, T, S)
        if key not in self.plans:
            n, m = self._global(T, S)
            rule = mask
            if is_causal:
                rule = Causal() if mask is None else mask | Causal()
            s = self.setting
            plan = plan_context(
                rule, batch=B, heads=H, kv_heads=Hkv, length=n, kv_length=m, world=s.world,
                rank=s.rank, layout=s.layout, device=q.device,
            )  # fmt: skip
            self.plans[key] = (mask, plan)
        plan = self.plans[key][1]
        return context_parallel_attention(
            q, k, v, plan.mask, scale=scale, group=self.setting.group, plan=plan
        )  # [B, H, T, Dv]


_active: ContextVar[Scope | None] = ContextVar("qkv_context_parallel", default=None)


def active_scope() -> Scope | None:
    """The innermost :func:`context_parallel` scope of this thread or task, or None."""
    return _active.get()


@contextlib.contextmanager
def context_parallel(setting: ContextParallel) -> Iterator[Scope]:
    """Route qkv layers' attention through context parallelism for the block's duration.

    Args:
        setting: the group and layout the sequence is cut in.

    Yields:
        The scope (its plans, for inspection).
    """
    scope = Scope(setting)
    token = _active.set(scope)
    try:
        yield scope
    finally:
        _active.reset(token)
