"""A stack plans its attention once per forward: host syncs counted with a dispatch mode.

A host sync is what makes the CPU wait for an accelerator: reading a tensor's value
(``aten._local_scalar_dense``: ``.item()``, ``bool(t)``), copying it to the host
(``aten._to_copy`` to the CPU: ``.tolist()`` of a planner's read, see
:func:`qkv.backends.reads.host_list`), or an op whose output shape depends on values.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import qkv
from qkv.backends import plan as planning
from qkv.models.bert import BertConfig, BertEncoder

_DATA_DEPENDENT = {torch.ops.aten.nonzero.default, torch.ops.aten.unique_consecutive.default}


class CountSyncs(TorchDispatchMode):
    """Counts the ops of a block that would make the host wait for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        to_host = func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device(
            "cpu"
        )
        if func is torch.ops.aten._local_scalar_dense.default or to_host or func in _DATA_DEPENDENT:
            self.syncs.append(str(func))
        return func(*args, **kwargs)


def _model() -> qkv.DecoderOnlyLM:
    torch.manual_seed(0)
    config = qkv.DecoderOnlyConfig(
        vocab_size=50, d_model=32, num_heads=4, num_layers=4, max_positions=64
    )
    return qkv.DecoderOnlyLM(config).eval()


def _padding() -> torch.Tensor:
    pad = torch.zeros(2, 16, dtype=torch.bool)
    pad[1, 11:] = True  # [B, T]: the second row is 11 tokens long
    return pad


@pytest.mark.parametrize("grad", [False, True])
def test_a_forward_syncs_once_with_padding_and_never_without(grad: bool) -> None:
    model = _model()
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.set_grad_enabled(grad):
        with CountSyncs() as none:
            model(ids, validate=False)
        with CountSyncs() as padded:
            model(ids, _padding(), validate=False)
    assert none.syncs == []
    # The padding's live lengths, read once by the first layer's plan; 4 layers reuse it.
    assert padded.syncs == ["aten._to_copy.default"]


def test_the_layers_share_the_first_layers_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[planning.Plan] = []
    real = planning.make_plan

    def counting(*args: Any, **kwargs: Any) -> planning.Plan:
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(planning, "make_plan", counting)
    monkeypatch.setattr(qkv.backends.shared, "make_plan", counting)
    model = _model()
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        shared = model(ids, _padding())
        assert len(made) == 1 and made[0].pieces is not None  # 4 layers, one plan
        # the same logits as layers planning one by one
        monkeypatch.setattr(qkv.backends.shared, "_scope", _NoScope())
        made.clear()
        unshared = model(ids, _padding())
        assert len(made) == 4
    torch.testing.assert_close(shared, unshared, atol=0, rtol=0)


class _NoScope:
    """A stand-in for the scope variable that never holds a scope: every call plans."""

    def get(self) -> None:
        return None

    def set(self, value: object) -> object:
        return None

    def reset(self, token: object) -> None:
        return None


def test_validate_false_skips_only_the_overflow_look() -> None:
    """Issue 27's overflow retry still runs by default; validate=False (one scope) skips it."""
    q = torch.full((1, 1, 2, 4), 1e19)
    with torch.no_grad():
        out, _ = qkv.attention(q, q, q)
        assert torch.isfinite(out).all()
        with qkv.backends.shared.share_plans(validate=False), CountSyncs() as c:
            unchecked, _ = qkv.attention(q, q, q)
        assert c.syncs == [] and torch.isnan(unchecked).any()
        with qkv.backends.shared.share_plans(validate=False), qkv.backends.shared.share_plans():
            assert not qkv.backends.shared.values_checked()  # None keeps the outer setting
    with (
        pytest.raises(TypeError, match="validate must be a bool"),
        qkv.backends.shared.share_plans(validate=1),  # type: ignore[arg-type]
    ):
        pass


def test_a_bert_forward_syncs_once_with_padding_and_never_without() -> None:
    model = BertEncoder(BertConfig(50, 32, 4, 4, 64)).eval()
    ids = torch.randint(1, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with CountSyncs() as none:
            model(ids, validate=False)
        with CountSyncs() as padded:
            model(ids, (~_padding()).long(), validate=False)
        with CountSyncs() as qkv_spelling:
            model(ids, padding_mask=_padding(), validate=False)
    assert none.syncs == []
    # the padding's live lengths, read once by the first layer's plan; 4 layers reuse it
    assert padded.syncs == qkv_spelling.syncs == ["aten._to_copy.default"]


@pytest.mark.parametrize("layers", [1, 3])
def test_a_transformer_reads_each_padding_once_whatever_its_depth(layers: int) -> None:
    """pad_id always gives the Transformer padding masks (``ids == pad_id``; unchecked with
    ``validate=False``, so kept even where nothing is padding): one read for each attention
    kind that takes one (encoder self, cross, decoder self), and no overflow look."""
    torch.manual_seed(0)
    config = qkv.TransformerConfig(
        50, 50, d_model=32, num_heads=4, dim_feedforward=64, max_positions=64,
        num_encoder_layers=layers, num_decoder_layers=layers,
    )  # fmt: skip
    model = qkv.Transformer(config).eval()
    src = torch.randint(3, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    src[1, 11:] = config.pad_id
    tgt = torch.randint(3, 50, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with CountSyncs() as encode:
            memory = model.encode(src, validate=False)
        with CountSyncs() as decode:
            model.decode(tgt, memory, src == config.pad_id, validate=False)
        with CountSyncs() as forward:
            model(src, tgt, validate=False)
    assert encode.syncs == ["aten._to_copy.default"]
    assert decode.syncs == ["aten._to_copy.default"] * 2  # the cross- and the self-attention
    assert forward.syncs == encode.syncs + decode.syncs


@pytest.mark.parametrize("backend", ["reference", "fused", "blockwise", "auto"])
def test_inference_mode_masks_have_no_version_and_still_work(backend: str) -> None:
    # Tensors made under torch.inference_mode have no version counter; the plan's mask token
    # reads it, which raised "Inference tensors do not track version counter".
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4) for _ in range(3))
    with torch.no_grad():
        mask = torch.zeros(5, 5, dtype=torch.bool)
        mask[:, 3:] = True
        want, _ = qkv.attention(q, k, v, mask=mask, backend=backend)
    with torch.inference_mode():
        inference_mask = mask.clone()
        got, _ = qkv.attention(q, k, v, mask=inference_mask, backend=backend)
    assert inference_mask.is_inference()
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_a_padded_forward_in_inference_mode_equals_no_grad() -> None:
    torch.manual_seed(0)
    cfg = qkv.DecoderOnlyConfig(vocab_size=20, d_model=16, num_heads=2, num_layers=2, pad_id=0)
    model = qkv.DecoderOnlyLM(cfg).eval()
    ids = torch.randint(1, 20, (2, 7))
    ids[1, :3] = 0  # left padding: the forward builds its padding mask inside inference mode
    with torch.no_grad():
        want = model(ids)
    with torch.inference_mode():
        got = model(ids)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
