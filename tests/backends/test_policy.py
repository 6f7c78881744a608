"""One Policy holds every tuning constant; its opt-ins are per thread, never process-wide."""

import ast
import dataclasses
import threading
from pathlib import Path

import pytest
import torch

import qkv
from qkv.backends import policy
from qkv.backends.policy import POLICY, Policy, current_policy


def test_the_policy_is_frozen_and_checks_its_fields() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        POLICY.band_max_share = 0.9  # type: ignore[misc]
    with pytest.raises(TypeError, match="allow_compile must be a bool, got 1"):
        Policy(allow_compile=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="band_block must be positive, got 0"):
        Policy(band_block=0)
    with pytest.raises(TypeError, match="band_max_share"):
        Policy(band_max_share=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword"), qkv.use_policy(band_size=3):
        pass
    with (
        pytest.raises(TypeError, match="allowed must be a bool, got 'no'"),
        qkv.allow_compile(
            "no"  # type: ignore[arg-type]
        ),
    ):
        pass


def test_every_tuning_constant_lives_in_the_policy() -> None:
    """No other module of qkv.backends keeps a module-level number (log2(e) is no tuning)."""
    backends = Path(policy.__file__).parent
    numbers = []
    for path in sorted(backends.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            value = getattr(node, "value", None)
            target = getattr(node, "targets", [getattr(node, "target", None)])[0]
            name = getattr(target, "id", "")
            number = isinstance(value, ast.BinOp) or (
                isinstance(value, ast.Constant) and type(value.value) in (int, float)
            )
            if number and name != "LOG2E":
                numbers.append(f"{path.name}:{node.lineno} {name}")
    assert numbers == []


def test_blocks_nest_and_restore_also_after_an_error() -> None:
    assert current_policy() == POLICY
    with qkv.allow_sdpa_backward():
        assert current_policy().allow_sdpa_backward
        with qkv.allow_sdpa_backward(False):
            assert not current_policy().allow_sdpa_backward
        with pytest.raises(RuntimeError), qkv.use_policy(allow_sdpa_backward=False):
            raise RuntimeError("inside")
        assert current_policy().allow_sdpa_backward
    assert current_policy() == POLICY


def test_process_wide_setters_change_the_default_only() -> None:
    try:
        policy.set_compile_allowed(True)
        assert policy.compile_allowed()
        with qkv.allow_compile(False):
            assert not policy.compile_allowed()
        seen: list[bool] = []
        worker = threading.Thread(target=lambda: seen.append(policy.compile_allowed()))
        worker.start()
        worker.join()
        assert seen == [True]  # another thread sees the process default
    finally:
        policy.set_compile_allowed(False)
    with pytest.raises(TypeError, match="allowed must be a bool"):
        policy.set_sdpa_backward_allowed(1)  # type: ignore[arg-type]
    assert current_policy() == POLICY


def test_two_threads_blocks_ending_out_of_order_leave_nothing_on() -> None:
    """Threads A and B both enter allow_sdpa_backward (B allow_compile too); A leaves first,
    then B. With one process-wide switch, A's exit turned B's setting off under it and B's
    exit turned the switch back on for the whole process; per context, each thread sees its
    own blocks only, and nothing stays on."""
    a_in, b_in, a_out, b_out = (threading.Event() for _ in range(4))
    seen: dict[str, object] = {}

    def now() -> tuple[bool, bool]:
        return policy.sdpa_backward_allowed(), policy.compile_allowed()

    def thread_a() -> None:
        with qkv.allow_sdpa_backward():
            a_in.set()
            b_in.wait(5)
            seen["a inside"] = now()
        a_out.set()
        b_out.wait(5)
        seen["a after both"] = now()

    def thread_b() -> None:
        a_in.wait(5)
        with qkv.allow_sdpa_backward(), qkv.allow_compile():
            b_in.set()
            a_out.wait(5)  # A has left its block, B's is still open
            seen["b inside, a gone"] = now()
            q = k = v = torch.zeros(1, 1, 1024, 8)
            seen["b plans"] = qkv.plan(q, k, v, mask=qkv.MaskMod(_diag)).backend
        b_out.set()
        seen["b after"] = now()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen["a inside"] == (True, False)
    assert seen["b inside, a gone"] == (True, True)
    assert seen["b plans"] == "flex"
    assert seen["a after both"] == seen["b after"] == (False, False)
    assert now() == (False, False) and current_policy() == POLICY


def _diag(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return q >= k
