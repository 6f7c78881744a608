"""``qkv.doctor.watch``: inspect every attention call made inside a ``with`` block.

    with qkv.doctor.watch(model) as report:
        model(input_ids, attention_mask=attention_mask)
    print(report)          # a table of findings
    assert report.ok       # no error and no warning

The model runs exactly as it would unwatched (outputs bit-identical); the doctor reads each call's
arguments and output after it returned, judges it (:mod:`qkv.doctor.judge`), and, for the
modules named by ``capture``, recomputes their weights exactly in row blocks.

Shapes: B batch, H heads, T queries, S keys, L the model's input length.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import Tensor, nn

from qkv.doctor.calls import AttentionCall
from qkv.doctor.findings import Finding
from qkv.doctor.interception import WatchMode, install, pop_watch, push_watch, uninstall
from qkv.doctor.judge import Padding, judge
from qkv.doctor.report import Captured, Report
from qkv.doctor.weights import row_blocks

__all__ = ["Watch", "watch"]


def _all_attention_through_transformers(model: nn.Module | None) -> bool:
    """Whether every attention call of ``model`` goes through ``transformers``' attention
    interface: a ``transformers`` model whose classes all dispatch through
    ``ALL_ATTENTION_FUNCTIONS`` (``transformers``' own check of its modeling code) and that holds
    no ``nn.MultiheadAttention``. Such a watch enters its mode only inside those functions."""
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if model is None or modeling_utils is None:
        return False
    pretrained = modeling_utils.PreTrainedModel
    if not isinstance(model, pretrained):
        return False
    for m in model.modules():
        if isinstance(m, nn.MultiheadAttention | nn.TransformerEncoderLayer):
            return False
        check = getattr(type(m), "_can_set_attn_implementation", None)
        if isinstance(m, pretrained) and (check is None or not check()):
            return False
    return True


def _live_tokens(value: Any, name: str) -> Tensor | None:
    """A model's 2-D padding argument as ``[B, L]`` bool, True = a real token."""
    if not isinstance(value, Tensor) or value.dim() != 2:
        return None
    if name == "padding_mask":  # qkv's convention: True = padding
        return ~value.bool()
    return value != 0  # Hugging Face: 1 = keep


class Watch:
    """The state of one watch: what it knows of the model, and what it found.

    Built by :func:`watch`; not meant to be made directly.
    """

    def __init__(
        self,
        model: nn.Module | None,
        capture: str | None,
        heads: Sequence[int] | None,
        samples: Sequence[int],
    ) -> None:
        self.model = model
        self.names: dict[int, str] = {}
        if model is not None:
            root = type(model).__name__
            self.names = {id(m): (n or root) for n, m in model.named_modules()}
        self.capture = None if capture is None else re.compile(capture)
        self.heads = None if heads is None else tuple(int(h) for h in heads)
        self.samples = tuple(int(b) for b in samples)
        self.report = Report()
        self._keys: dict[tuple[str, str], int] = {}
        self._capture_count: dict[str, int] = {}
        self._padding: list[Tensor | None] = []
        self._padding_cache: dict[tuple[Any, ...], tuple[Tensor, Padding]] = {}
        self.mode = WatchMode(self)
        self.scoped = _all_attention_through_transformers(model)

    # ---------------------------------------------------------------- padding from the model

    def padding_sources(self) -> list[nn.Module]:
        """The modules whose forward's ``attention_mask`` describes the keys of its calls."""
        model = self.model
        if model is None:
            return []
        config = getattr(model, "config", None)
        if getattr(config, "is_encoder_decoder", False) and hasattr(model, "get_encoder"):
            get_encoder = cast(Callable[[], nn.Module], model.get_encoder)
            return [get_encoder()]  # the model's attention_mask is the encoder's
        return [model]

    def hook_padding(self, module: nn.Module) -> list[Any]:
        """Read the padding from ``module``'s forward arguments while it runs."""
        try:
            sig = inspect.signature(module.forward)
        except (TypeError, ValueError):
            return []

        def pre(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            try:
                bound = sig.bind_partial(*args, **kwargs).arguments
            except TypeError:
                bound = kwargs
            live = _live_tokens(bound.get("attention_mask"), "attention_mask")
            if live is None:
                live = _live_tokens(bound.get("padding_mask"), "padding_mask")
            self._padding.append(live)

        def post(mod: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
            if self._padding:
                self._padding.pop()

        return [
            module.register_forward_pre_hook(pre, with_kwargs=True),
            module.register_forward_hook(post, with_kwargs=True, always_call=True),
        ]

    def padding_for(self, call: AttentionCall) -> Padding | None:
        """Which queries and keys of ``call`` are real tokens, when the model said so."""
        if not self._padding or self._padding[-1] is None:
            return None
        live = self._padding[-1]  # [B, L]
        assert live is not None
        B, T, S = call.query.shape[0], call.query.shape[2], call.key.shape[2]
        L = live.shape[1]
        if live.shape[0] != B or T > L or S < L:
            return None
        key = (id(live), T, S, call.query.device)
        cached = self._padding_cache.get(key)
        if cached is None or cached[0] is not live:  # every layer of a forward shares one
            on = live.to(call.query.device)
            extra = on.new_ones(B, S - L)  # keys past the mask (empty cache slots): no claim
            pad = Padding(live_queries=on[:, L - T :], live_keys=torch.cat([on, extra], 1))
            self._padding_cache = {key: (live, pad)}
            return pad
        return cached[1]

    # ---------------------------------------------------------------- observing calls

    def where(self, module: nn.Module | None, site: str, api: str) -> tuple[str, str]:
        """(the module path, "path (file:line)"); the API's name when no module is known."""
        path = api if module is None else self.names.get(id(module), type(module).__name__)
        return path, f"{path} ({site})"

    def observe(
        self, make: Callable[[], AttentionCall], module: nn.Module | None, site: str
    ) -> None:
        """Read, judge and (maybe) capture one call; never raises into the model."""
        self.report.calls += 1
        try:
            with torch.no_grad():
                call = make()
                path, where = self.where(module, site, call.api)
                hints = ("hint", path) not in self._keys
                verdicts = judge(call, self.padding_for(call), hints=hints)
                if self.capture is not None and self.capture.search(path):
                    self._capture(path, call)
        except Exception as err:  # the model must run on whatever the doctor cannot read
            self.report.unread.append(f"{site}: {type(err).__name__}: {err}")
            return
        kinds: set[str] = set()
        for v in verdicts:  # most severe first: one finding per kind and call
            if v.kind in kinds:
                continue
            kinds.add(v.kind)
            key = (v.kind, path)
            if key in self._keys:
                i = self._keys[key]
                old = self.report.findings[i]
                self.report.findings[i] = Finding(
                    old.kind, old.severity, old.where, old.message, old.evidence, old.count + 1
                )
                continue
            self._keys[key] = len(self.report.findings)
            self.report.findings.append(Finding(v.kind, v.severity, where, v.message, v.evidence))

    def _capture(self, path: str, call: AttentionCall) -> None:
        B, H, T = call.query.shape[0], call.query.shape[1], call.query.shape[2]
        S = call.key.shape[2]
        samples = tuple(b for b in self.samples if b < B)
        heads = self.heads if self.heads is not None else tuple(range(H))
        heads = tuple(h for h in heads if h < H)
        out = torch.empty(len(samples), len(heads), T, S, dtype=torch.float32)  # kept weights
        for i, b in enumerate(samples):
            for j, h in enumerate(heads):  # one head at a time: a block is ROW_BLOCK x S
                for r0, r1 in row_blocks(T):
                    w = call.weights(b, r0, r1, heads=slice(h, h + 1))  # [1, rows, S]
                    out[i, j, r0:r1] = w[0].float().cpu()
            if call.output is not None and call.output.is_floating_point():
                bad = ~torch.isfinite(call.output[b]).all(-1).all(0)  # [T]
                out[i, :, bad.cpu()] = float("nan")
        n = self._capture_count.get(path, 0)
        self._capture_count[path] = n + 1
        self.report.captured.append(Captured(path, n, call.api, samples, heads, out))

    def finish(self) -> None:
        """Order the findings, most severe first."""
        order = {"error": 0, "warning": 1, "hint": 2}
        self.report.findings.sort(key=lambda f: order[f.severity])


@contextmanager
def watch(
    model: nn.Module | None = None,
    *,
    capture: str | None = None,
    heads: Sequence[int] | None = None,
    samples: Sequence[int] = (0,),
) -> Iterator[Report]:
    """Inspect every attention call made inside the ``with`` block, in any code.

    Seen: ``F.scaled_dot_product_attention``, ``F.multi_head_attention_forward`` (so
    ``nn.MultiheadAttention`` and the ``nn.Transformer*`` layers), flex attention,
    :func:`qkv.attention`, and every ``transformers`` attention implementation. Nothing is
    patched after the block; each thread has its own watches; watches nest (an outer one sees
    what the inner one sees). Calls made inside ``torch.compile``'d code are not seen (flex
    attention's own compilation excepted).

    Args:
        model: the model being run, for module paths and padding: its forward's
            ``attention_mask`` keyword (Hugging Face, 1 = token, 0 = padding; for an
            encoder-decoder model the encoder's) or ``padding_mask`` (qkv, True = padding) says
            which queries and keys are real. Without it, findings that need the padding
            (``padding_leak``) are not looked for, and names are class names.
        capture: a regular expression of module paths whose weights to record (``re.search``).
        heads: the query heads to record (default all).
        samples: the batch rows to record (default the first).

    Yields:
        The :class:`~qkv.doctor.report.Report`, filled as calls happen.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``capture`` not a string.
        ValueError: ``capture`` is not a valid regular expression, or negative heads/samples.
    """
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    if capture is not None and not isinstance(capture, str):
        raise TypeError(f"capture must be a regular expression string, got {capture!r}")
    if capture is not None:
        try:
            re.compile(capture)
        except re.error as err:
            raise ValueError(
                f"capture={capture!r} is not a valid regular expression: {err}"
            ) from err
    for name, values in (("heads", heads), ("samples", samples)):
        if values is not None and any(int(v) < 0 for v in values):
            raise ValueError(f"{name} must be non-negative indices, got {list(values)}")
    w = Watch(model, capture, heads, samples)
    handles: list[Any] = []
    install()
    push_watch(w)
    try:
        for m in w.padding_sources():
            handles.extend(w.hook_padding(m))
        with contextlib.nullcontext() if w.scoped else w.mode:
            yield w.report
    finally:
        for h in handles:
            h.remove()
        pop_watch(w)
        uninstall()
        w.finish()
