"""Plans shared by the layers of one forward: plan the first layer's call, reuse it.

Every layer of a model attends with the same mask over inputs of the same shapes, so the
plan of the first layer's call (and the host sync that reading a padding mask's lengths
costs) serves every layer. :func:`share_plans` opens that scope (``qkv.nn`` stacks open it
around their layers); inside it :func:`planned` returns the plan of an earlier call with the
same :class:`~qkv.backends.plan.Fit` (shapes, dtype, device, options, the same mask) under the
same policy, and makes one otherwise. Outside it every call plans for itself.

The scope also carries the model's ``validate``: with ``validate=False`` the eager look at each
output for a float32 overflow (a host sync per call) is skipped, as the models' value checks
are (:func:`qkv._checks.checks_values`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from qkv._checks import check_bool, checks_values
from qkv.backends.call import Call, Fit, fit_of
from qkv.backends.plan import Plan, make_plan
from qkv.backends.policy import Policy, current_policy

__all__ = ["planned", "share_plans", "values_checked"]


@dataclass
class _Scope:
    validate: bool
    plans: dict[tuple[Fit, int], tuple[Policy, Plan]] = field(default_factory=dict)


_scope: ContextVar[_Scope | None] = ContextVar("qkv_shared_plans", default=None)


@contextmanager
def share_plans(validate: bool | None = None) -> Iterator[None]:
    """Within the block, attention calls of the same fit share one plan (see the module).

    Nested blocks share the outer one's plans.

    Args:
        validate: check output values (the float32 overflow look, a host sync per call);
            None keeps the enclosing block's setting (True outside any).

    Raises:
        TypeError: ``validate`` is neither a bool nor None.
    """
    outer = None if torch.compiler.is_compiling() else _scope.get()
    if validate is not None:
        check_bool("validate", validate)
    if torch.compiler.is_compiling():
        yield  # dynamo cannot read a ContextVar; a traced call checks no values anyway
        return
    checks = (outer.validate if outer else True) if validate is None else validate
    if outer is not None and outer.validate == checks:
        yield
        return
    token = _scope.set(_Scope(checks, outer.plans if outer else {}))
    try:
        yield
    finally:
        _scope.reset(token)


def values_checked() -> bool:
    """Whether the call being run should have its output values checked: eagerly, and unless
    a :func:`share_plans` block says ``validate=False``."""
    if not checks_values():
        return False
    scope = _scope.get()
    return scope is None or scope.validate


def planned(call: Call) -> Plan:
    """The plan of ``call``: shared within a :func:`share_plans` block, else made for it.

    Raises:
        ValueError: as :func:`~qkv.backends.plan.make_plan`.
    """
    scope = None if torch.compiler.is_compiling() else _scope.get()
    if scope is None:
        return make_plan(call)  # no fit: no other call will run this plan
    fit = fit_of(call)
    policy = current_policy()
    key = (fit, id(policy))
    hit = scope.plans.get(key)
    if hit is not None:
        return hit[1]
    plan = make_plan(call, fit)
    if len(scope.plans) >= policy.max_shared_plans:
        scope.plans.pop(next(iter(scope.plans)))
    scope.plans[key] = (policy, plan)  # the policy kept alive: its id is not reused
    return plan
