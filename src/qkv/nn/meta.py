"""Build modules on the meta device (shapes only, no memory) without their random init.

Loading a checkpoint first builds its model on the meta device to check the weights' keys and
shapes before any memory is allocated. ``torch.device("meta")`` alone would run each module's
initialization there too, and ``normal_`` on a meta tensor goes through a Python reference
that imports dynamo on first use: building one ``nn.Embedding`` on the meta device took 1.5 s
of a 3.3 s command (a 2-core EPYC), for values a meta tensor does not hold. :func:`on_meta`
skips it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["on_meta"]

_NORMAL = (Tensor.normal_, torch.nn.init.normal_)
"""Fill a tensor with normal samples in place: nothing to do on the meta device."""


class _NoMetaNormal(TorchFunctionMode):
    """``normal_`` (the method or ``nn.init``'s) on a meta tensor returns it untouched; every
    other call runs as it would."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """``func(*args, **kwargs)``, or the tensor itself for ``normal_`` on the meta device."""
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
        if func in _NORMAL and isinstance(target, Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Inside, modules and tensors are made on the meta device (``torch.device("meta")``) and
    ``normal_`` fills nothing there (the rest of each module's initialization still runs, on
    shapes only)."""
    with torch.device("meta"), _NoMetaNormal():
        yield
