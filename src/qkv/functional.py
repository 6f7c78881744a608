"""Scaled dot-product attention: validation, the tutorial-form function, and the dispatcher.

Shapes (one alphabet everywhere): B batch, H query heads, Hkv key/value heads, T query length,
S key length, Dh query/key width, Dv value width.

:func:`attention` dispatches to backends that all compute the same thing (fully masked rows give
0 with finite gradients, float16/bfloat16 computed in float32, GQA, ``T != S``, bottom-right
``is_causal``, dropout, ``attn_bias``) and differ in speed, memory and whether they return
weights: ``"reference"`` (explicit, returns weights), ``"fused"`` (PyTorch SDPA),
``"blockwise"`` (online softmax, skips fully masked tiles), ``"flex"`` (compiled
``flex_attention``; forward only on CPU; ``"auto"`` uses it only inside
:func:`qkv.allow_compile`); ``"auto"`` chooses by the rules of :mod:`qkv.backends.plan`.
:func:`plan` takes the same arguments and returns the :class:`Plan` a call would run (which
backend, the pieces or tiles, and why, as records); :func:`explain_backend` says it in words.

Causal alignment: ``is_causal`` is **bottom-right aligned** like every causal mask in qkv: query
``i`` sits at absolute position ``i + S - T``, which is what a KV cache needs and equals
PyTorch's top-left ``is_causal`` when ``T == S``. For top-left with ``T != S`` pass
``mask=Causal(align="top_left")``.

Masks follow qkv's one convention (see :mod:`qkv.masks`): a bool tensor broadcastable to
``[B, H, T, S]``, **True = this key may NOT be attended**. A query row whose keys are all
blocked gets weights 0 and output 0, with finite gradients.

Precision: float16 / bfloat16 inputs are cast to float32 before the dot product, float64 stays
float64, any enclosing autocast is disabled, and results come back in the input dtype. A
float32 or bfloat16 call whose scores overflow float32 (finite ``|q| · |k|`` beyond about 1e19,
which gave NaN) is computed again in float64, eagerly: :func:`attention` returns no NaN that
its finite inputs do not explain.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any, Literal, ParamSpec, cast

import torch
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function

from qkv._checks import check_positive_int, check_probability
from qkv._deprecation import renamed_keyword
from qkv.backends.call import Call, fit_of
from qkv.backends.explain import explain
from qkv.backends.plan import Plan, make_plan
from qkv.backends.reference import reference_attention
from qkv.backends.run import overflowed, run_in_float64, run_plan
from qkv.backends.shared import planned, values_checked
from qkv.masks import StructuredMask
from qkv.masks.validate import as_4d, validate_mask

Backend = Literal["auto", "reference", "fused", "blockwise", "flex"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "fused", "blockwise", "flex")

__all__ = [
    "BACKENDS",
    "Backend",
    "Plan",
    "attention",
    "explain_backend",
    "plan",
    "scaled_dot_product_attention",
    "validate_mask",
    "validate_qkv",
]


def _shape(x: Tensor) -> tuple[int, ...]:
    return tuple(x.shape)


def validate_qkv(query: object, key: object, value: object, *, allow_gqa: bool) -> None:
    """Check Q/K/V for :func:`attention`; raise a clear error on the first problem.

    Args:
        query: expected ``[B, H, T, Dh]``.
        key: expected ``[B, Hkv, S, Dh]``.
        value: expected ``[B, Hkv, S, Dv]``.
        allow_gqa: accept ``Hkv`` dividing ``H``; otherwise ``Hkv`` must equal ``H``.

    Raises:
        TypeError: not tensors, not floating point, dtypes differ.
        ValueError: not 4-D, zero-sized, devices differ, batch/head/width/length mismatch.
    """
    names = ("query", "key", "value")
    tensors = (query, key, value)
    for name, t in zip(names, tensors, strict=True):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    q, k, v = tensors
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    layouts = ("[B, H, T, Dh]", "[B, H, S, Dh]", "[B, H, S, Dv]")
    for name, t, layout in zip(names, (q, k, v), layouts, strict=True):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D {layout}, got shape {_shape(t)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got dtype {t.dtype}")
        if t.numel() == 0:
            raise ValueError(f"{name} has a zero-sized dimension: shape {_shape(t)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"query, key and value must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"query, key and value must be on one device, got {q.device}, {k.device}, {v.device}"
        )
    B, H, _, Dh = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(
            f"batch sizes differ: query B={B}, key B={k.shape[0]}, value B={v.shape[0]}"
        )
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"key has {k.shape[1]} heads but value has {v.shape[1]}")
    Hkv = k.shape[1]
    if allow_gqa:
        if H % Hkv != 0:
            raise ValueError(
                f"query heads H={H} must be a multiple of key/value heads Hkv={Hkv} "
                "(grouped-query attention)"
            )
    elif Hkv != H:
        raise ValueError(f"head counts differ: query H={H}, key/value H={Hkv}")
    if k.shape[3] != Dh:
        raise ValueError(
            f"query and key widths differ: query Dh={Dh}, key Dh={k.shape[3]} "
            f"(shapes {_shape(q)} and {_shape(k)})"
        )
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"key and value lengths differ: key S={k.shape[2]}, value S={v.shape[2]}")


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    blocked_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    training: bool = False,
) -> tuple[Tensor, Tensor]:
    """softmax(Q Kᵀ / √Dh, blocked keys removed) V, returning the weights too.

    Args:
        query: ``[B, H, T, Dh]``.
        key: ``[B, H, S, Dh]``.
        value: ``[B, H, S, Dv]``.
        blocked_mask: bool, broadcastable to ``[B, H, T, S]``, True = this key may NOT be
            attended. Applied before the softmax.
        dropout_p: dropout on the weights after the softmax, in ``[0, 1]``.
        training: apply dropout only when True.

    Returns:
        ``(output [B, H, T, Dv], weights [B, H, T, S])`` in the input dtype. Weights are those
        multiplied with V; rows with every key blocked are 0 in both.

    Raises:
        TypeError: non-tensors, non-floating inputs, mismatched dtypes, a non-bool mask.
        ValueError: wrong ranks, zero-sized dims, mismatched devices or dims, a mask that is on
            another device or does not broadcast, a bare ``[B, S]`` padding mask, a bad dropout_p.
    """
    validate_qkv(query, key, value, allow_gqa=False)
    p = check_probability("dropout_p", dropout_p)
    B, H, T, Dh = query.shape
    S = key.shape[2]
    if blocked_mask is not None:
        validate_mask(blocked_mask, B, H, T, S, query.device)
    return reference_attention(
        query, key, value, blocked_mask, None, 1.0 / math.sqrt(Dh), p, training
    )


def _check_attn_bias(attn_bias: object, B: int, H: int, T: int, S: int) -> None:
    if not isinstance(attn_bias, Tensor) or not attn_bias.is_floating_point():
        got = attn_bias.dtype if isinstance(attn_bias, Tensor) else type(attn_bias).__name__
        raise TypeError(
            f"attn_bias must be a floating-point tensor broadcastable to [B, H, T, S], got {got}"
        )
    try:
        ok = torch.broadcast_shapes(attn_bias.shape, (B, H, T, S)) == (B, H, T, S)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"attn_bias of shape {_shape(attn_bias)} is not broadcastable to {[B, H, T, S]}"
        )


def _check_scale(scale: object) -> float:
    """A finite positive score multiplier (bools, NaN, 0, negatives and inf refused: inf turns
    every score into +-inf and the softmax into NaN)."""
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise TypeError(f"scale must be a float or None, got {scale!r} ({type(scale).__name__})")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite positive number (or None), got {scale}")
    return float(scale)


def _validate(args: dict[str, Any], stacklevel: int = 3) -> Call:
    """Validate the arguments of one :func:`attention` call.

    The one place :func:`attention`, :func:`plan` and :func:`explain_backend` read a call.

    Args:
        args: every parameter of :func:`attention` by name, defaults applied.
        stacklevel: where the deprecation warning of ``bias=`` points (the user's call).

    Returns:
        The validated call: masks and biases 4-D, the scale resolved.

    Raises:
        TypeError / ValueError: the input errors listed in :func:`attention`.
    """
    query, key, value, mask = args["query"], args["key"], args["value"], args["mask"]
    attn_bias, bias, backend = args["attn_bias"], args["bias"], args["backend"]
    block_q, block_k, scale = args["block_q"], args["block_k"], args["scale"]
    hint = "the score tensor added before the softmax"
    attn_bias = renamed_keyword(
        "bias", bias, "attn_bias", attn_bias, hint=hint, stacklevel=stacklevel
    )
    validate_qkv(query, key, value, allow_gqa=True)
    p = check_probability("dropout_p", args["dropout_p"])
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if block_q is not None:
        check_positive_int("block_q", block_q)
    if block_k is not None:
        check_positive_int("block_k", block_k)
    B, H, T, Dh = query.shape
    S = key.shape[2]
    if isinstance(mask, StructuredMask):
        mask.validate(B, H, T, S, query.device)
    elif mask is not None:
        # Every backend sees 4-D masks and biases: a 1-D [S] one is [1, 1, 1, S].
        mask = as_4d(validate_mask(mask, B, H, T, S, query.device))  # [B|1, H|1, T|1, S]
    if attn_bias is not None:
        _check_attn_bias(attn_bias, B, H, T, S)
        attn_bias = as_4d(attn_bias)  # [B|1, H|1, T|1, S|1]
    scale = 1.0 / math.sqrt(Dh) if scale is None else _check_scale(scale)
    training = args["training"]
    is_causal, need_weights = args["is_causal"], args["need_weights"]
    return Call(
        query, key, value, mask, attn_bias, is_causal, scale, need_weights, p, training,
        backend, block_q, block_k,
    )  # fmt: skip


def _check_fit(plan: object, call: Call) -> Plan:
    """``plan`` if it was made for this call (see :class:`~qkv.backends.plan.Fit`).

    Raises:
        TypeError: ``plan`` is not a :class:`Plan`.
        ValueError: it was made for other shapes, dtype, device, mask or options.
    """
    if not isinstance(plan, Plan) or plan.fit is None:
        raise TypeError(f"plan must be a Plan from qkv.plan(), got {type(plan).__name__}")
    fit = fit_of(call)
    if fit != plan.fit:
        diff = [
            "mask: planned for another mask (the same rule object, or a tensor of the same "
            "memory, shape and version)"
            if name == "mask"
            else f"{name}: planned {getattr(plan.fit, name)!r}, got {getattr(fit, name)!r}"
            for name in fit.__dataclass_fields__
            if getattr(fit, name) != getattr(plan.fit, name)
        ]
        raise ValueError(
            "the plan was made for another call (plan again with qkv.plan): " + "; ".join(diff)
        )
    return plan


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    mask: Tensor | StructuredMask | None = None,
    attn_bias: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    need_weights: bool = False,
    dropout_p: float = 0.0,
    training: bool = False,
    backend: Backend = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
    bias: Tensor | None = None,
    plan: Plan | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Attention with keyword options: the entry point the modules use (the backends and the
    causal alignment: see the module; :func:`plan` and :func:`explain_backend` take the same
    arguments).

    Args:
        query: ``[B, H, T, Dh]``.
        key: ``[B, Hkv, S, Dh]``; ``H`` a multiple of ``Hkv`` (grouped-query attention).
        value: ``[B, Hkv, S, Dv]``.
        mask: bool broadcastable to ``[B, H, T, S]``, True = blocked, or a rule of
            :mod:`qkv.masks` (``Causal``, ``Padding``, ``Documents``, ... and their ``|``).
        attn_bias: float broadcastable to ``[B, H, T, S]`` added to the scores (e.g. ALiBi).
        is_causal: also block future keys, bottom-right aligned (see the module).
        scale: score multiplier; default ``1 / sqrt(Dh)``.
        need_weights: also return the ``[B, H, T, S]`` weights (reference backend).
        dropout_p: dropout on the weights, in ``[0, 1]``, used only when ``training``.
        training: apply dropout.
        backend: ``"auto"``, ``"reference"``, ``"fused"``, ``"blockwise"`` or ``"flex"``.
        block_q, block_k: blockwise tile height and width (need not divide T, S); default 256
            and 512, or a sliding window's width (:func:`qkv.backends.tiles.default_blocks`).
        bias: deprecated alias of ``attn_bias`` (warns; kept for one release).
        plan: a plan from :func:`qkv.plan` for these very inputs, run without planning again.

    Returns:
        ``(output [B, H, T, Dv], weights [B, H, T, S] or None)``.

    Raises:
        TypeError: as :func:`scaled_dot_product_attention`; an ``attn_bias`` not float, a scale
            or block size of the wrong type, both ``attn_bias`` and ``bias``, a non-Plan plan.
        ValueError: as :func:`scaled_dot_product_attention`; an ``attn_bias`` that does not
            broadcast, an unknown backend, a bad scale or block size, a structured mask that
            does not fit (a ``Dense`` part is never cropped), ``need_weights`` with the fused
            or blockwise backend, a ``plan`` made for another call.
    """
    arguments = dict(locals())  # nothing else is bound yet: exactly this call's arguments
    if has_torch_function((query, key, value)):
        return _dispatched(arguments)
    call = _validate(arguments)
    chosen = planned(call) if plan is None else _check_fit(plan, call)
    out, weights = run_plan(call, chosen)
    if values_checked() and overflowed(call, out):
        out, weights = run_in_float64(call, chosen)
    return out, weights


def _dispatched(arguments: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
    """:func:`attention`'s call handed to the ``TorchFunctionMode`` or tensor subclass that
    sees it (:mod:`qkv.doctor` sees it as it sees ``F.scaled_dot_product_attention``)."""
    qkv = (arguments["query"], arguments["key"], arguments["value"])
    options = {k: v for k, v in arguments.items() if k not in ("query", "key", "value")}
    result: tuple[Tensor, Tensor | None] = handle_torch_function(attention, qkv, *qkv, **options)
    return result


_P = ParamSpec("_P")


def _takes_arguments_of(
    f: Callable[_P, object],
) -> Callable[[Callable[..., Any]], Callable[_P, Any]]:
    """Give the decorated function ``f``'s parameters (for type checkers and ``inspect``)."""
    params = inspect.signature(f).parameters.values()

    def decorate(g: Callable[..., Any]) -> Callable[_P, Any]:
        sig = inspect.signature(g).replace(parameters=list(params))
        cast(Any, g).__signature__ = sig
        return g

    return decorate


_ATTENTION_SIGNATURE = inspect.signature(attention)


def _bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Call, Plan | None]:
    """The validated call of :func:`attention`'s arguments, and the plan it was given."""
    bound = _ATTENTION_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    call = _validate(bound.arguments, stacklevel=4)
    given = bound.arguments["plan"]
    return call, None if given is None else _check_fit(given, call)


@_takes_arguments_of(attention)
def plan(*args: Any, **kwargs: Any) -> Plan:
    """The :class:`Plan` :func:`attention` would run for these arguments, computing nothing.

    Takes exactly the arguments of :func:`attention` (one signature) and validates them in the
    same place. The plan says which backend runs the call (``.backend``), what it cuts the work
    into (``.pieces``: SDPA calls; ``.tiles``: blockwise tiles) and why (``.reasons``: records
    of the rule, the quantity measured, the threshold and the
    :class:`~qkv.backends.policy.Policy` field). Pass it back as ``attention(..., plan=p)``
    to run it for inputs of the same fit without planning again.

    Returns:
        The plan.

    Raises:
        TypeError / ValueError: the input errors of :func:`attention`, and the backend asked
            for cannot serve the call (weights from fused, blockwise or flex; flex with a
            bias, dropout or a CPU gradient).
    """
    call, given = _bind(args, kwargs)
    return make_plan(call, fit_of(call)) if given is None else given


@_takes_arguments_of(attention)
def explain_backend(*args: Any, **kwargs: Any) -> str:
    """Say in one sentence which backend :func:`attention` would use for these arguments and why.

    Takes exactly the arguments of :func:`attention` (one signature) and plans them as
    :func:`plan` does, computing nothing: the sentence renders the plan's reasons (or, with
    ``plan=``, that plan's). If the requested backend cannot serve the call, the sentence says
    so (``attention`` raises).

    Returns:
        e.g. ``"blockwise: Causal(align='bottom_right'): 28 of 64 tiles (44%) fully masked, and
        blockwise skips them"``.

    Raises:
        TypeError / ValueError: the input errors of :func:`attention`.
    """
    call, given = _bind(args, kwargs)
    if given is not None:
        return explain(given)
    try:
        chosen = make_plan(call)
    except ValueError as err:  # the backend asked for cannot serve the call
        return f"no backend: {err} (attention() raises ValueError)"
    return explain(chosen)
