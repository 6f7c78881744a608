"""What an examination changes on a model, each undone on leaving its ``with`` block.

:func:`qkv.doctor.examine` runs the model in eval mode, in float64 (the reference its tolerances
come from) and with every parameter requiring a gradient (to see every gradient); the model comes
back as it was: the same training flags, the same dtype per tensor, the same ``requires_grad``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["cast_floating", "evaluating", "floating_dtype", "parameters_of", "requiring_grad"]


def parameters_of(modules: Sequence[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """Every parameter of ``modules`` once (tied weights count once), with its name."""
    seen: set[int] = set()
    out: list[tuple[str, nn.Parameter]] = []
    for i, m in enumerate(modules):
        prefix = "" if len(modules) == 1 else f"[{i}]."
        for name, p in m.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((prefix + name, p))
    return out


def floating_dtype(modules: Sequence[nn.Module]) -> torch.dtype | None:
    """The dtype of the first floating parameter (or buffer) of ``modules``, or None."""
    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            if t.is_floating_point():
                return t.dtype
    return None


@contextmanager
def evaluating(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Every module in eval mode (no dropout); each module's own flag restored afterwards."""
    flags = [(m, m.training) for root in modules for m in root.modules()]
    try:
        for root in modules:
            root.eval()
        yield
    finally:
        for m, flag in flags:
            m.training = flag


@contextmanager
def cast_floating(modules: Sequence[nn.Module], dtype: torch.dtype) -> Iterator[None]:
    """Floating parameters and buffers in ``dtype``, in place (the ``Parameter`` objects are
    kept, so optimizers and tied weights still see them); each tensor's own dtype restored.

    float32 -> float64 -> float32 (and bfloat16 / float16 the same way) is exact, so the model
    comes back bit for bit.
    """
    tensors: list[tuple[torch.Tensor, torch.dtype]] = []
    seen: set[int] = set()
    for root in modules:
        for t in [*root.parameters(), *root.buffers()]:
            if t.is_floating_point() and id(t) not in seen:
                seen.add(id(t))
                tensors.append((t, t.dtype))
    try:
        for t, _ in tensors:
            t.data = t.data.to(dtype)
        yield
    finally:
        for t, old in tensors:
            t.data = t.data.to(old)


@contextmanager
def requiring_grad(modules: Sequence[nn.Module]) -> Iterator[list[tuple[str, nn.Parameter]]]:
    """Every floating parameter requires a gradient; yields them with their names.

    Gradients are then taken with ``torch.autograd.grad``, which leaves ``.grad`` alone.
    """
    params = [(n, p) for n, p in parameters_of(modules) if p.is_floating_point()]
    flags = [p.requires_grad for _, p in params]
    try:
        for _, p in params:
            p.requires_grad_(True)
        yield params
    finally:
        for (_, p), flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)
