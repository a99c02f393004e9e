# SPDX-License-Identifier: Apache-2.0
"""Tensor-parallel head shards: the engine's own collective, no transport of the library's.

Each rank holds a slice of a layer's kv heads (with their whole GQA groups). Per-head policies need nothing from
the other ranks; Ada-KV's budget is layer-wide, so its decision takes a few small collectives per layer (a hand-shake,
at most four all-reduces of 256 int64 per sequence and one all-gather; no scores are gathered), and the union of the
ranks' decisions equals the single-process decision bit for bit.

    import torch.distributed as dist, kvpolicy
    from kvpolicy.distributed import TorchCollective
    dist.init_process_group("gloo")                                   # or the engine's TP group
    comm = TorchCollective()                                          # group=None: the default group
    shard = kvpolicy.HeadShard(kv_head_offset=rank * 4, num_kv_heads=8, num_q_heads=32, comm=comm)
    keep = kvpolicy.make("adakv", compression_ratio=0.5).evict(queries=q_local, keys=k_local, shard=shard)

Any object with ``rank``, ``world_size``, ``all_reduce_sum(array)`` (int64, summed over the ranks in place) and
``all_gather(bytes) -> bytes`` (every rank's bytes concatenated in rank order) works as ``comm``; every rank must
make the same calls (same batch, same policy), which the hand-shake checks before anything is written.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ._core import HeadShard

__all__ = ["HeadShard", "TorchCollective"]


class TorchCollective:
    """The two operations over a ``torch.distributed`` process group (gloo on the CPU; CPU tensors)."""

    def __init__(self, group: Optional[Any] = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank: int = dist.get_rank(group)
        self.world_size: int = dist.get_world_size(group)

    def all_reduce_sum(self, data: np.ndarray) -> None:
        """Sums the int64 array over the ranks, in place (the tensor shares the array's memory)."""
        import torch

        t = torch.from_numpy(data)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.SUM, group=self.group)

    def all_gather(self, data: bytes) -> bytes:
        """Every rank's ``data`` (equal sizes), concatenated in rank order."""
        import torch

        t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self._dist.all_gather(out, t, group=self.group)
        return b"".join(o.numpy().tobytes() for o in out)
