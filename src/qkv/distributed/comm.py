"""Point-to-point exchanges of a context-parallel call, in rounds along the ring.

Round ``s`` (``1 <= s < W``) pairs every rank ``r`` with the rank ``s`` steps ahead on the ring
(it sends there) and the rank ``s`` steps behind (it receives from there): every round is a
permutation, so each rank sends one message and receives one, and the messages of a round fly
while the previous round's block is computed. Unlike a relay ring (where a block hops through
``s - 1`` ranks to reach the rank ``s`` steps on), a key crosses the network once and only to the
ranks whose queries see it, cut to the range they see (:mod:`qkv.distributed.plan`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch import Tensor

__all__ = ["Exchange", "bytes_sent", "peer", "reset_bytes_sent"]

_sent = [0]  # bytes this process has posted for sending (for benchmarks)


def bytes_sent() -> int:
    """Bytes this process has sent through context-parallel exchanges since the last reset."""
    return _sent[0]


def reset_bytes_sent() -> None:
    """Start counting :func:`bytes_sent` from 0."""
    _sent[0] = 0


def peer(group: dist.ProcessGroup | None, rank: int) -> int:
    """The global rank of group rank ``rank`` (what point-to-point calls address)."""
    return rank if group is None else dist.get_global_rank(group, rank)


@dataclass
class Exchange:
    """Messages of one round in flight: start them, compute, then :meth:`wait`.

    Attributes:
        group: the process group.
        sends: ``(group rank, tensor)`` to send (kept alive until the round ends).
        recvs: ``(group rank, buffer)`` to fill.
    """

    group: dist.ProcessGroup | None
    sends: list[tuple[int, Tensor]] = field(default_factory=list)
    recvs: list[tuple[int, Tensor]] = field(default_factory=list)
    _works: list[dist.Work] = field(default_factory=list)

    def start(self) -> Exchange:
        """Post every send and receive at once (``batch_isend_irecv``)."""
        ops = [dist.P2POp(dist.isend, t, peer(self.group, r), self.group) for r, t in self.sends]
        ops += [dist.P2POp(dist.irecv, t, peer(self.group, r), self.group) for r, t in self.recvs]
        _sent[0] += sum(t.numel() * t.element_size() for _, t in self.sends)
        if ops:
            self._works = dist.batch_isend_irecv(ops)
        return self

    def wait(self) -> list[Tensor]:
        """Wait for the round; returns the receive buffers in the order given."""
        for w in self._works:
            w.wait()
        self._works = []
        return [t for _, t in self.recvs]
