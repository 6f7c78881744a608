"""Context parallelism on ``torch.distributed``: one sequence cut across processes.

::

    from qkv import distributed as cp
    q, k, v = (cp.shard(t, dim=2, layout="zigzag") for t in (q_all, k_all, v_all))
    out = cp.context_parallel_attention(q, k, v, mask=qkv.Causal(), layout="zigzag")
    out_all = cp.unshard(out, dim=2, layout="zigzag")   # == qkv.attention(q_all, ..., mask)

The mask is a qkv rule in global coordinates; the plan (:func:`plan_context`) knows for every
pair of ranks which keys one needs from the other, so empty pairs are skipped and only the keys
a rank's queries see are sent. The same code runs on gloo (CPU) and NCCL (GPU).
"""

from qkv.distributed.attention import context_parallel_attention, global_length
from qkv.distributed.context import ContextParallel, GlobalMask, active_scope, context_parallel
from qkv.distributed.layout import (
    LAYOUTS,
    Layout,
    group_rank,
    local_positions,
    segments,
    shard,
    unshard,
)
from qkv.distributed.plan import ContextPlan, plan_context

__all__ = [
    "LAYOUTS",
    "ContextParallel",
    "ContextPlan",
    "GlobalMask",
    "Layout",
    "active_scope",
    "context_parallel",
    "context_parallel_attention",
    "global_length",
    "group_rank",
    "local_positions",
    "plan_context",
    "segments",
    "shard",
    "unshard",
]
