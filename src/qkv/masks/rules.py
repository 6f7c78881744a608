"""Mask rules: masks described by a rule instead of a ``[T, S]`` tensor.

Every rule here means the same thing as a bool tensor in qkv's one convention (True = this key
may NOT be attended; see :mod:`qkv.masks`), and :meth:`StructuredMask.materialize` builds that
tensor in the rule's own broadcast shape (``Padding`` ``[B, 1, 1, S]``, ``Causal`` ``[1, 1, T,
S]``, never a full ``[B, H, T, S]``). The tensor builders of :mod:`qkv.masks.builders` are thin
calls of these rules. The blockwise backend never materializes a rule: for each
:class:`~qkv.masks.tiles.Tile` :meth:`StructuredMask.tile` says "nothing blocked"
(:data:`FULL`), "everything blocked" (:data:`EMPTY`, the tile is skipped), or gives the tile's
own ``[*, *, bq, bk]`` mask, from index arithmetic (causal, sliding window), lengths (padding),
per-tile min/max (document ids), or by evaluating a predicate on the tile's index grid only
(``mask_mod``, as in PyTorch's FlexAttention).

Combine rules with ``|`` (a key is blocked if any rule blocks it), e.g.
``Causal() | Padding(lengths)``; a bool tensor joins with ``|`` as a :class:`Dense` part. The
base class and the combinators (:class:`StructuredMask`, :class:`AnyOf`, :class:`Dense`) are in
:mod:`qkv.masks.combine` and importable from here.

Alignment of ``Causal`` and ``SlidingWindow``: bottom-right by default, ``align="top_left"`` or an
explicit ``offset`` (not both); see :mod:`qkv.masks.tiles`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from qkv._checks import check_positive_int
from qkv.masks.combine import AnyOf, Dense, StructuredMask, by_value, classify, parts_of
from qkv.masks.tiles import EMPTY, FULL, Align, Tile, TileMask, query_offset, resolve_alignment
from qkv.masks.validate import as_4d

__all__ = [
    "AnyOf",
    "Causal",
    "Dense",
    "Documents",
    "MaskMod",
    "ModFn",
    "Padding",
    "SlidingWindow",
    "StructuredMask",
    "Union",
    "parts_of",
]


def _position_repr(align: Align | None, offset: int | None) -> str:
    return f"offset={offset}" if offset is not None else f"align={align!r}"


class SlidingWindow(StructuredMask):
    """Query at position ``p`` sees keys ``p - window + 1 .. p`` (``window=None``: all ``<= p``).

    Args:
        window: keys each query may see, itself included (``>= 1``), or None for plain causal.
        align: ``"bottom_right"`` (the default) or ``"top_left"``; see :mod:`qkv.masks.tiles`.
        offset: absolute position of query 0, instead of ``align``.

    Raises:
        ValueError: ``window < 1``, an unknown ``align``, or ``offset`` with ``align``.
        TypeError: a ``window`` or ``offset`` that is not an int.
    """

    def __init__(
        self, window: int | None, *, align: Align | None = None, offset: int | None = None
    ) -> None:
        self.window = None if window is None else check_positive_int("window", window)
        self.align, self.offset = resolve_alignment(align, offset)

    def __repr__(self) -> str:
        where = _position_repr(self.align, self.offset)
        return f"{type(self).__name__}(window={self.window}, {where})"

    def tile(self, tile: Tile) -> TileMask:
        off = query_offset(tile.T, tile.S, self.align, self.offset)
        # delta = query position - key position; allowed iff 0 <= delta < window.
        lo = tile.q0 + off - (tile.k1 - 1)  # smallest delta in the tile
        hi = tile.q1 - 1 + off - tile.k0  # largest delta in the tile
        w = self.window
        if hi < 0 or (w is not None and lo >= w):
            return EMPTY
        if lo >= 0 and (w is None or hi < w):
            return FULL
        delta = tile.q_index()[:, None] + off - tile.k_index()[None, :]  # [bq, bk]
        blocked = delta < 0  # [bq, bk]
        if w is not None:
            blocked = blocked | (delta >= w)  # [bq, bk]
        return blocked[None, None]  # [1, 1, bq, bk]


class Causal(SlidingWindow):
    """Causal mask: query at position ``p`` may not see keys after ``p``.

    Args:
        align: ``"bottom_right"`` (the default, as ``qkv.attention(is_causal=True)``) or
            ``"top_left"`` (as PyTorch SDPA's ``is_causal``).
        offset: absolute position of query 0 (number of cached keys), instead of ``align``.

    Raises:
        ValueError: an unknown ``align``, or ``offset`` with ``align``.
        TypeError: an ``offset`` that is not an int.
    """

    def __init__(self, *, align: Align | None = None, offset: int | None = None) -> None:
        super().__init__(None, align=align, offset=offset)

    def __repr__(self) -> str:
        return f"Causal({_position_repr(self.align, self.offset)})"


def _check_int_tensor(name: str, x: object, dims: int) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {x.dtype}")
    if x.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(x.shape)}")
    return x


def _check_padding_input(x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"lengths_or_is_pad must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype == torch.bool:
        if x.dim() != 2:
            raise ValueError(
                f"a bool padding mask must be [B, S] (True = padding), got shape {tuple(x.shape)}"
            )
        return x
    if x.is_floating_point() or x.is_complex():
        raise TypeError(
            f"lengths must be an integer tensor [B], got {x.dtype}; for an additive float mask "
            "use qkv.masks.from_additive"
        )
    if x.dim() != 1:
        raise TypeError(
            f"integer padding input must be lengths [B], got shape {tuple(x.shape)}; "
            "a Hugging Face attention_mask [B, S] (1 = keep) goes through qkv.masks.from_hf"
        )
    return x


class Padding(StructuredMask):
    """Key padding, given by lengths or by a bool ``is_pad`` tensor (the same two forms as
    :func:`qkv.masks.padding_mask`).

    Args:
        lengths_or_is_pad: an integer tensor ``[B]`` of valid key lengths, each in ``[0, S]``
            (in sample ``b`` keys ``>= lengths[b]`` are blocked), or a bool tensor ``[B, S]``
            with True at padding positions (the ``key_padding_mask`` sense of
            ``nn.MultiheadAttention``).

    Raises:
        TypeError: not a tensor; a float tensor; an integer tensor that is not 1-D (a Hugging
            Face ``attention_mask`` goes through :func:`qkv.masks.from_hf`).
        ValueError: a bool tensor that is not 2-D.
    """

    def __init__(self, lengths_or_is_pad: Tensor) -> None:
        x = _check_padding_input(lengths_or_is_pad)
        self.is_pad: Tensor | None = x if x.dtype == torch.bool else None
        self.lengths: Tensor | None = None if x.dtype == torch.bool else x
        self._min = int(x.min()) if self.lengths is not None and x.numel() else 0
        self._max = int(x.max()) if self.lengths is not None and x.numel() else 0

    def __repr__(self) -> str:
        if self.lengths is not None:
            return f"Padding(lengths={self.lengths.tolist()})"
        assert self.is_pad is not None
        return f"Padding(is_pad {list(self.is_pad.shape)})"

    def _tensor(self) -> Tensor:
        x = self.lengths if self.lengths is not None else self.is_pad
        assert x is not None
        return x

    def validate(self, B: int, H: int, T: int, S: int, device: torch.device) -> None:
        x = self._tensor()
        what = "lengths" if self.lengths is not None else "is_pad"
        if x.shape[0] != B:
            raise ValueError(f"Padding {what} has B={x.shape[0]}, expected B={B}")
        if self.is_pad is not None and self.is_pad.shape[1] != S:
            raise ValueError(f"Padding is_pad has S={self.is_pad.shape[1]}, expected S={S}")
        if self.lengths is not None and (self._min < 0 or self._max > S):
            raise ValueError(f"Padding lengths must lie in [0, S={S}], got {x.tolist()}")
        if x.device != device:
            raise ValueError(f"Padding {what} is on {x.device}, query on {device}")

    def mask_shape(self, B: int, H: int, T: int, S: int) -> tuple[int, int, int, int]:
        return B, 1, 1, S

    def materialize(
        self, B: int, H: int, T: int, S: int, device: torch.device | None = None
    ) -> Tensor:
        """As :meth:`StructuredMask.materialize`, ``[B, 1, 1, S]``, but with tensor ops only:
        models build their padding masks here in every forward, so no tile is classified (that
        reads the mask on the host and cannot be traced)."""
        dev = torch.device("cpu") if device is None else device
        self.validate(B, H, T, S, dev)
        if self.is_pad is not None:
            return self.is_pad[:, None, None, :]  # [B, 1, 1, S]
        assert self.lengths is not None
        blocked = torch.arange(S, device=dev)[None, :] >= self.lengths[:, None]  # [B, S]
        return blocked[:, None, None, :]  # [B, 1, 1, S]

    def tile(self, tile: Tile) -> TileMask:
        if self.is_pad is not None:
            blocked = self.is_pad[:, tile.k0 : tile.k1]  # [B, bk]
            if by_value():
                if bool(blocked.all()):
                    return EMPTY
                if not bool(blocked.any()):
                    return FULL
        else:
            assert self.lengths is not None
            if tile.k0 >= self._max:
                return EMPTY
            if tile.k1 <= self._min:
                return FULL
            blocked = tile.k_index()[None, :] >= self.lengths[:, None]  # [B, bk]
        return blocked[:, None, None, :]  # [B, 1, 1, bk]


class Documents(StructuredMask):
    """Packed sequences: a query may only see keys of its own document.

    Args:
        q_ids: integer tensor ``[B, T]``, the document id of each query.
        kv_ids: integer tensor ``[B, S]``; default ``q_ids`` (self-attention). Ids must be
            non-decreasing along the sequence for tiles to be skipped by min/max; any ids are
            correct, unsorted ones just skip fewer tiles.

    Raises:
        TypeError: ids that are not integer tensors.
        ValueError: ids that are not 2-D.
    """

    def __init__(self, q_ids: Tensor, kv_ids: Tensor | None = None) -> None:
        self.q_ids = _check_int_tensor("q_ids", q_ids, 2)
        self.kv_ids = self.q_ids if kv_ids is None else _check_int_tensor("kv_ids", kv_ids, 2)

    def __repr__(self) -> str:
        return f"Documents(q_ids {list(self.q_ids.shape)}, kv_ids {list(self.kv_ids.shape)})"

    def validate(self, B: int, H: int, T: int, S: int, device: torch.device) -> None:
        for name, ids, L in (("q_ids", self.q_ids, T), ("kv_ids", self.kv_ids, S)):
            if tuple(ids.shape) != (B, L):
                raise ValueError(
                    f"Documents {name} must be [B, L] = {[B, L]}, got {list(ids.shape)}"
                )
            if ids.device != device:
                raise ValueError(f"Documents {name} is on {ids.device}, query on {device}")

    def mask_shape(self, B: int, H: int, T: int, S: int) -> tuple[int, int, int, int]:
        return B, 1, T, S

    def tile(self, tile: Tile) -> TileMask:
        qd = self.q_ids[:, tile.q0 : tile.q1]  # [B, bq]
        kd = self.kv_ids[:, tile.k0 : tile.k1]  # [B, bk]
        if by_value():
            q_lo, q_hi = qd.amin(dim=1), qd.amax(dim=1)  # [B]
            k_lo, k_hi = kd.amin(dim=1), kd.amax(dim=1)  # [B]
            if bool(((q_hi < k_lo) | (k_hi < q_lo)).all()):
                return EMPTY
            if bool(((q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)).all()):
                return FULL
        blocked = qd[:, :, None] != kd[:, None, :]  # [B, bq, bk]
        return blocked[:, None]  # [B, 1, bq, bk]


ModFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


class MaskMod(StructuredMask):
    """An arbitrary predicate ``mask_mod(b, h, q_idx, kv_idx)``, as in PyTorch FlexAttention.

    **Sense**: like FlexAttention, ``mask_mod`` returns True where the query MAY attend the key;
    this class converts it to qkv's convention (True = blocked) at this edge.

    The predicate gets broadcastable integer tensors ``b [B, 1, 1, 1]``, ``h [1, H, 1, 1]``,
    ``q_idx [1, 1, bq, 1]``, ``kv_idx [1, 1, 1, bk]`` and must return a bool tensor that
    broadcasts to ``[B, H, bq, bk]`` (write it with tensor ops, e.g. ``q_idx >= kv_idx``). It is
    only ever evaluated on one tile's index grid, so the blockwise backend costs O(block²)
    memory for it.

    Args:
        mask_mod: the predicate, True = may attend.
        name: shown in explanations; default the function's ``__name__``.

    Raises:
        TypeError: ``mask_mod`` is not callable, or returns something other than a bool tensor.
        ValueError: (when a tile is asked for) it returns a tensor that does not broadcast to
            the tile, e.g. a fixed ``[T, S]`` tensor instead of one computed from the indices.
    """

    def __init__(self, mask_mod: ModFn, *, name: str | None = None) -> None:
        if not callable(mask_mod):
            raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
        self.mask_mod = mask_mod
        self.name = name or getattr(mask_mod, "__name__", "mask_mod")

    def __repr__(self) -> str:
        return f"MaskMod({self.name})"

    def tile(self, tile: Tile) -> TileMask:
        dev = tile.device
        b = torch.arange(tile.B, device=dev)[:, None, None, None]  # [B, 1, 1, 1]
        h = torch.arange(tile.H, device=dev)[None, :, None, None]  # [1, H, 1, 1]
        q_idx = tile.q_index()[None, None, :, None]  # [1, 1, bq, 1]
        kv_idx = tile.k_index()[None, None, None, :]  # [1, 1, 1, bk]
        keep = self.mask_mod(b, h, q_idx, kv_idx)
        if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
            got = keep.dtype if isinstance(keep, Tensor) else type(keep).__name__
            raise TypeError(f"mask_mod {self.name} must return a bool tensor, got {got}")
        bq, bk = tile.q1 - tile.q0, tile.k1 - tile.k0
        grid = (tile.B, tile.H, bq, bk)
        try:
            fits = keep.dim() <= 4 and torch.broadcast_shapes(keep.shape, grid) == grid
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(
                f"mask_mod {self.name} returned shape {tuple(keep.shape)}, which does not "
                f"broadcast to the tile's [B, H, bq, bk] = {list(grid)}: compute it from the "
                "index tensors it is given (e.g. q_idx >= kv_idx), not as a fixed-shape tensor"
            )
        blocked = as_4d(~keep)  # [B|1, H|1, bq|1, bk|1]
        return classify(blocked.expand(blocked.shape[0], blocked.shape[1], bq, bk))


Union = AnyOf
"""Deprecated alias of :class:`AnyOf` (it shadowed ``typing.Union``); kept for one release."""
