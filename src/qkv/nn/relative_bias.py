"""T5's relative position bias: a learned score bias per head and per bucket of distances.

T5 (Raffel et al. 2020) adds no position to the embeddings; each attention score ``q_i · k_j``
gets a learned bias ``b[h, bucket(j - i)]`` instead (passed to :func:`qkv.attention` as
``attn_bias``). Distances below ``num_buckets / 2`` (bidirectional: ``num_buckets / 4`` on each
side) have a bucket each; longer ones share logarithmically wider buckets up to
``max_distance``, beyond which all fall in the last. A causal stack (T5's decoder) only sees keys
at or before the query, so it spends every bucket on those.

Like ALiBi the bias depends only on distances, so a left-padded row (blocked padding keys,
contiguous real tokens) and a cached step get the same bias as a full pass.

Shapes: H heads, T query length, S key length (the last query is key ``S - 1``), N buckets.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from qkv._checks import check_positive_int

__all__ = ["RelativePositionBias", "relative_position_bucket"]


def relative_position_bucket(
    relative_position: Tensor, *, bidirectional: bool, num_buckets: int, max_distance: int
) -> Tensor:
    """The bucket of each distance ``key - query``, as Mesh TensorFlow and ``transformers``.

    Args:
        relative_position: long, any shape, ``key position - query position``.
        bidirectional: keys after the query get buckets of their own (an encoder); False: they
            share bucket 0 with the query itself (a causal decoder never attends to them).
        num_buckets: N.
        max_distance: distances at or beyond it share the last bucket (of their side).

    Returns:
        long, the shape of ``relative_position``, in ``[0, N)``.
    """
    buckets = torch.zeros_like(relative_position)
    n = num_buckets
    if bidirectional:
        n //= 2
        buckets = buckets + (relative_position > 0).to(torch.long) * n
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    exact = n // 2
    # float32 log, as transformers computes it (a float64 one may round to another bucket)
    large = exact + (
        torch.log(distance.float() / exact) / math.log(max_distance / exact) * (n - exact)
    ).to(torch.long)
    large = large.clamp(max=n - 1)
    return buckets + torch.where(distance < exact, distance, large)


class RelativePositionBias(nn.Module):
    """The learned table ``relative_attention_bias`` ``[N, H]`` and the bias it gives a
    ``[T, S]`` attention.

    Args:
        num_heads: H.
        num_buckets: N (T5: 32).
        max_distance: the longest distance with a bucket of its own range (T5: 128).

    Raises:
        TypeError / ValueError: sizes that are not positive ints; fewer than 4 buckets (each side
            needs an exact and a logarithmic half); ``max_distance`` not beyond the exact range.
    """

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128) -> None:
        super().__init__()
        for name, value in (
            ("num_heads", num_heads),
            ("num_buckets", num_buckets),
            ("max_distance", max_distance),
        ):
            check_positive_int(name, value)
        if num_buckets < 4:
            raise ValueError(f"num_buckets must be >= 4, got {num_buckets}")
        if max_distance <= num_buckets // 2:
            raise ValueError(
                f"max_distance must exceed num_buckets // 2 = {num_buckets // 2} (the exact "
                f"buckets), got {max_distance}"
            )
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.relative_attention_bias = nn.Embedding(num_buckets, num_heads)

    def forward(self, T: int, S: int, *, causal: bool) -> Tensor:
        """The score bias of ``T`` queries at positions ``S - T .. S - 1`` over ``S`` keys.

        Args:
            T: query length.
            S: key length, ``>= T`` (the last ``T`` keys are the queries' own tokens).
            causal: a causal stack (one-sided buckets).

        Returns:
            ``[1, H, T, S]`` in the table's dtype.

        Raises:
            ValueError: ``S < T``.
        """
        if S < T:
            raise ValueError(f"expects key length S >= query length T, got T={T}, S={S}")
        device = self.relative_attention_bias.weight.device
        q_pos = torch.arange(S - T, S, device=device)  # [T]
        k_pos = torch.arange(S, device=device)  # [S]
        rel = k_pos[None, :] - q_pos[:, None]  # [T, S]
        bucket = relative_position_bucket(
            rel,
            bidirectional=not causal,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )  # [T, S]
        return self.relative_attention_bias(bucket).permute(2, 0, 1)[None]  # [1, H, T, S]
