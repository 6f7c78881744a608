"""Sentence pooling: mean over the real tokens, unit length, cosine similarity.

Shapes: B batch, T tokens, D width, N rows.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["cosine_similarity_matrix", "l2_normalize", "mean_pool"]


def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """Average ``hidden`` over the tokens where ``attention_mask`` is 1.

    Args:
        hidden: ``[B, T, D]`` last hidden states.
        attention_mask: ``[B, T]``, 1 = token, 0 = padding (Hugging Face sense).

    Returns:
        ``[B, D]``; a row with no token at all is 0.

    Raises:
        ValueError: shapes that do not agree.
    """
    if hidden.dim() != 3 or tuple(attention_mask.shape) != tuple(hidden.shape[:2]):
        raise ValueError(
            f"hidden must be [B, T, D] and attention_mask [B, T]; got {list(hidden.shape)} and "
            f"{list(attention_mask.shape)}"
        )
    keep = attention_mask.to(hidden.dtype)[..., None]  # [B, T, 1]
    total = (hidden * keep).sum(dim=1)  # [B, D]
    count = keep.sum(dim=1).clamp(min=1.0)  # [B, 1]
    return total / count  # [B, D]


def l2_normalize(x: Tensor, eps: float = 1e-12) -> Tensor:
    """Scale each row of ``x`` ``[N, D]`` to unit Euclidean length (rows of 0 stay 0)."""
    return x / x.norm(dim=-1, keepdim=True).clamp(min=eps)  # [N, D]


def cosine_similarity_matrix(embeddings: Tensor) -> Tensor:
    """Cosine similarity of every pair of rows: ``[N, D]`` -> ``[N, N]``."""
    unit = l2_normalize(embeddings)  # [N, D]
    return unit @ unit.T  # [N, N]
