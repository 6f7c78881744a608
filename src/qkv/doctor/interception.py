"""How the doctor sees attention calls in any model, and leaves nothing behind.

Three mechanisms, each installed only while a watch is active and each a no-op on a thread with
no watch:

* a :class:`~torch.overrides.TorchFunctionMode` per watch (PyTorch's own interception, per
  thread) sees ``F.scaled_dot_product_attention``, ``F.multi_head_attention_forward``,
  :func:`qkv.attention` and flex attention's operator. A mode is popped while the function it
  intercepted runs, so it sees the outermost attention call only, never the kernels inside;
* global module hooks keep the stack of modules being run (for module paths), read the model's
  padding from its forward's ``attention_mask`` keyword, and run ``nn.MultiheadAttention`` and
  the ``nn.TransformerEncoder*`` layers with the watch's modes set aside, so that PyTorch's
  inference fast path (which any active mode disables) runs as it would unwatched: outputs stay
  bit-identical. Their calls are read from the module's arguments instead;
* ``transformers``' ``AttentionInterface.get_interface`` returns a wrapped function while a
  watch is active, so every implementation (``eager``, ``sdpa``, ``flex_attention``, ``qkv``,
  functions registered by users) is seen with its module. A kernel call made inside it (SDPA in
  ``sdpa``, ``qkv.attention`` in ``qkv``) is judged as what was really computed; a function that
  calls no kernel (``eager``) is judged from its own arguments. For a ``transformers`` model
  whose every attention goes through it, the watch is *scoped*: its mode is entered only inside
  these functions and no module hook runs, so the rest of the model pays nothing per torch call.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from qkv.doctor.calls import (
    AttentionCall,
    from_hf_function,
    from_mha,
)
from qkv.doctor.function_reads import READERS

__all__ = ["WatchMode", "install", "uninstall"]


class _Counts(Protocol):
    calls: int


class Watch(Protocol):
    """What the interception needs of a :class:`qkv.doctor.watch` block (it imports this
    module, so it is named here by what it does)."""

    scoped: bool
    mode: WatchMode

    @property
    def report(self) -> _Counts: ...

    def observe(
        self, make: Callable[[], AttentionCall], module: nn.Module | None, site: str
    ) -> None: ...


_MODULE_MHA_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)
# PyTorch's own classes with an inference fast path that any active mode disables (exact types:
# a subclass may compute otherwise, so its inner calls stay visible)
_SUSPENDING = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)
_QKV_DIR = os.path.dirname(os.path.dirname(__file__))
_SKIP_DIRS = (
    os.path.dirname(torch.__file__),
    os.path.dirname(__file__),  # the doctor
    os.path.join(_QKV_DIR, "functional.py"),  # qkv.attention's own dispatch
    os.path.join(_QKV_DIR, "integrations"),
    "<eval_with_key>",  # code torch.compile / fx generated
)


class _Local(threading.local):
    def __init__(self) -> None:
        self.watches: list[Watch] = []
        self.modules: list[nn.Module] = []
        self.frames: list[_Frame] = []
        self.suspended: list[list[TorchFunctionMode]] = []
        self.mha_seen: dict[int, int] = {}
        self.layer_marks: list[int] = []


_local = _Local()
_lock = threading.Lock()
_installed = 0
_handles: list[RemovableHandle] = []
_hf_original: list[tuple[Any, Callable[..., Any]]] = []


@dataclass
class _Frame:
    """A ``transformers`` attention function being run: kernel calls inside are its."""

    module: nn.Module
    implementation: str
    query_shape: tuple[int, ...] | None = None
    kernel_seen: bool = False


def _unpack_gqa(call: AttentionCall, frame: _Frame | None) -> AttentionCall:
    """Undo ``transformers``' GQA packing of one decode query (``[B, H, 1, Dh]`` passed to
    SDPA as ``[B, Hkv, H / Hkv, Dh]``, with a mask shared by every head and row), so rows are
    positions again."""
    shape = None if frame is None else frame.query_shape
    q = call.query
    if shape is None or tuple(q.shape) == shape or len(shape) != 4 or shape[2] != 1:
        return call
    if q.numel() != math.prod(shape):
        return call
    for m in (call.blocked, call.additive, call.bias):
        if m is not None and (m.shape[1] != 1 or m.shape[2] != 1):
            return call  # a mask per head or row: not the packing of one query
    call.query = q.reshape(shape)  # [B, H, 1, Dh]
    if call.output is not None:
        call.output = call.output.reshape(shape[0], shape[1], 1, -1)  # [B, H, 1, Dv]
    return call


def call_site() -> str:
    """``file:line`` of the code that made the attention call (torch and the doctor skipped)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP_DIRS):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def current_module() -> nn.Module | None:
    """The module whose attention this call is: an open ``transformers`` frame's, else the
    innermost module being run."""
    if _local.frames:
        return _local.frames[-1].module
    return _local.modules[-1] if _local.modules else None


# ---------------------------------------------------------------- the torch function mode


class WatchMode(TorchFunctionMode):
    """One watch's view of the torch functions: passes every call through unchanged and hands
    the attention calls to the watch afterwards."""

    def __init__(self, watch: Watch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_dynamo_compiling():
            return func(*args, **kwargs)  # traced code is not watched (see watch())
        reader = READERS.get(func)
        if reader is None:
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        assert reader is not None
        _mark_kernel()
        frame = _local.frames[-1] if _local.frames else None
        self.watch.observe(
            lambda: _unpack_gqa(reader(func, args, kwargs, out), frame),
            current_module(),
            call_site(),
        )
        return out


def _mark_kernel() -> None:
    if _local.frames:
        _local.frames[-1].kernel_seen = True


def _observe(make: Callable[[], AttentionCall], module: nn.Module | None, site: str) -> None:
    _mark_kernel()
    for w in _local.watches:
        w.observe(make, module, site)


# ---------------------------------------------------------------- module hooks


def _pre_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
    if not _local.watches or all(w.scoped for w in _local.watches):
        return  # no watch here, or only watches that see attention inside transformers' frames
    _local.modules.append(module)
    if type(module) in _SUSPENDING:
        _local.suspended.append(_pop_watch_modes())
        if type(module) is nn.TransformerEncoderLayer:
            _local.layer_marks.append(_local.mha_seen.get(id(module.self_attn), 0))


def _post_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    if not _local.watches or not _local.modules or _local.modules[-1] is not module:
        return
    try:
        if type(module) in _SUSPENDING:
            for mode in reversed(_local.suspended.pop()):
                torch._C._push_on_torch_function_stack(mode)
            if type(module) is nn.MultiheadAttention:
                _observe_mha_module(module, module, args, kwargs, out)
            elif type(module) is nn.TransformerEncoderLayer:
                mark = _local.layer_marks.pop()
                if _local.mha_seen.get(id(module.self_attn), 0) == mark:
                    _observe_fused_layer(module, args, kwargs, out)
    finally:
        _local.modules.pop()


def _pop_watch_modes() -> list[TorchFunctionMode]:
    """Take the watches' modes off the top of this thread's mode stack (fast paths run)."""
    popped: list[TorchFunctionMode] = []
    while torch._C._len_torch_function_stack() > 0:
        top = torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1)
        if not isinstance(top, WatchMode):
            break
        popped.append(torch._C._pop_torch_function_stack())
    return popped


def _mha_kwargs(module: nn.MultiheadAttention, bound: dict[str, Any]) -> dict[str, Any]:
    same = module._qkv_same_embed_dim
    return {
        "query": bound["query"],
        "key": bound["key"],
        "num_heads": module.num_heads,
        "in_proj_weight": module.in_proj_weight if same else None,
        "in_proj_bias": module.in_proj_bias,
        "q_proj_weight": None if same else module.q_proj_weight,
        "k_proj_weight": None if same else module.k_proj_weight,
        "bias_k": module.bias_k,
        "add_zero_attn": module.add_zero_attn,
        "key_padding_mask": bound.get("key_padding_mask"),
        "attn_mask": bound.get("attn_mask"),
    }


def _observe_mha_module(
    owner: nn.Module,
    module: nn.MultiheadAttention,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out: Any,
) -> None:
    _local.mha_seen[id(module)] = _local.mha_seen.get(id(module), 0) + 1
    bound = _MODULE_MHA_SIGNATURE.bind(module, *args, **kwargs).arguments
    with torch.no_grad():
        mha_kwargs = _mha_kwargs(module, bound)
    _observe(
        lambda: from_mha(
            (), mha_kwargs, out, api="nn.MultiheadAttention", batch_first=module.batch_first
        ),
        owner if owner is not module else module,
        call_site(),
    )


def _observe_fused_layer(
    layer: nn.TransformerEncoderLayer, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
) -> None:
    """A TransformerEncoderLayer that took PyTorch's fused path: its self-attention, re-read."""
    sig = inspect.signature(type(layer).forward)
    bound = sig.bind(layer, *args, **kwargs).arguments
    src = bound["src"]
    if getattr(src, "is_nested", False):
        for w in _local.watches:  # nested tensors carry no padding and no mask: nothing to judge
            w.report.calls += 1
        return
    with torch.no_grad():
        x = layer.norm1(src) if layer.norm_first else src
    call_kwargs = {
        "key_padding_mask": bound.get("src_key_padding_mask"),
        "attn_mask": bound.get("src_mask"),
    }
    _observe_mha_module(layer, layer.self_attn, (x, x, x), call_kwargs, (out, None))


# ---------------------------------------------------------------- transformers


def _wrap_hf(implementation: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def watched_attention(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not _local.watches:
            return fn(module, *args, **kwargs)
        query = args[0] if args else kwargs.get("query")
        shape = tuple(query.shape) if isinstance(query, torch.Tensor) else None
        frame = _Frame(module, implementation, shape)
        _local.frames.append(frame)
        try:
            with contextlib.ExitStack() as modes:  # scoped watches see torch calls only here
                for w in _local.watches:
                    if w.scoped:
                        modes.enter_context(w.mode)
                out = fn(module, *args, **kwargs)
        finally:
            _local.frames.pop()
        if not frame.kernel_seen:
            site = call_site()
            _observe(
                lambda: from_hf_function(implementation, module, args, kwargs, out), module, site
            )
        return out

    watched_attention.__wrapped__ = fn  # type: ignore[attr-defined]
    return watched_attention


def _install_hf() -> None:
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if modeling_utils is None:
        return  # no transformers model exists in this process: nothing to wrap
    AttentionInterface = modeling_utils.AttentionInterface

    original = AttentionInterface.get_interface

    def get_interface(self: Any, attn_implementation: str, default: Callable[..., Any]) -> Any:
        fn = original(self, attn_implementation, default)
        if not _local.watches:
            return fn
        name = "eager" if fn is default else str(attn_implementation)
        return _wrap_hf(name, fn)

    AttentionInterface.get_interface = get_interface
    _hf_original.append((AttentionInterface, original))


def install() -> None:
    """Install the hooks and the ``transformers`` wrapper (reference counted, thread-safe)."""
    global _installed
    with _lock:
        _installed += 1
        if _installed > 1:
            return
        _handles.append(nn.modules.module.register_module_forward_pre_hook(_pre_hook))
        _handles.append(
            nn.modules.module.register_module_forward_hook(
                _post_hook, with_kwargs=True, always_call=True
            )
        )
        _install_hf()


def uninstall() -> None:
    """Remove what :func:`install` put in place once the last watch ends."""
    global _installed
    with _lock:
        _installed -= 1
        if _installed > 0:
            return
        while _handles:
            handle = _handles.pop()
            handle.remove()
            # torch 2.13's handle forgets the with_kwargs flag of a global forward hook; a stale
            # flag makes torch.compile warn of global hooks long after the watch ended.
            nn.modules.module._global_forward_hooks_with_kwargs.pop(handle.id, None)
        while _hf_original:
            cls, original = _hf_original.pop()
            cls.get_interface = original


def push_watch(watch: Watch) -> None:
    """Make ``watch`` active on this thread."""
    _local.watches.append(watch)


def pop_watch(watch: Watch) -> None:
    """End ``watch`` on this thread (it must be the innermost)."""
    if not _local.watches or _local.watches[-1] is not watch:
        raise RuntimeError("qkv.doctor.watch blocks must end in the order they started")
    _local.watches.pop()
    if not _local.watches:
        _local.modules.clear()
        _local.frames.clear()
        _local.mha_seen.clear()
