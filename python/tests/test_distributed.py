# SPDX-License-Identifier: Apache-2.0
"""Tensor-parallel head shards from Python: HeadShard + any collective object (kvpolicy.distributed).

Two real processes decide Ada-KV on their halves of the heads and each compares its rows with the
single-process decision: over a multiprocessing pipe (numpy only, always) and over torch.distributed
with gloo (when torch is installed). Errors: a collective that raises, bad HeadShard arguments.
"""
import multiprocessing as mp
import os
import tempfile

import numpy as np
import pytest

import kvpolicy

HQ, HKV, W, D = 16, 4, 8, 32
SPECS = ["adakv:compression_ratio=0.5,window=8", "adakv:compression_ratio=0.8,window=8,alpha=0.5",
         "adakv:variant=original,tokens=40,window=8", "snapkv:compression_ratio=0.5,window=8",
         "pyramidkv:compression_ratio=0.5,window=8,layer=3"]


def inputs(T, seed, tied=False):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((HQ, W, D), dtype=np.float32)
    k = rng.standard_normal((HKV, T, D)).astype(np.float16)
    if tied:  # equal scores across heads: the tie order between ranks decides
        k[:] = k[0]
        q[:] = np.tile(q[: HQ // HKV], (HKV, 1, 1))
    return q, k


def check_rank(rank, world, comm):
    """This rank's rows == the single-process rows of its heads, for every spec and input."""
    n = HKV // world
    shard = kvpolicy.HeadShard(kv_head_offset=rank * n, num_kv_heads=HKV, num_q_heads=HQ, comm=comm)
    G = HQ // HKV
    checked = 0
    for spec in SPECS:
        p = kvpolicy.EvictionPolicy(spec)
        for T, seed, tied in [(64, 1, False), (333, 2, False), (200, 3, True)]:
            q, k = inputs(T, seed, tied)
            full = p.evict(queries=q, keys=k)
            mine = p.evict(queries=q[rank * n * G:(rank + 1) * n * G], keys=k[rank * n:(rank + 1) * n], shard=shard)
            for r in range(n):
                assert np.array_equal(mine.row(r), full.row(rank * n + r)), (spec, T, rank, r)
            checked += 1
    return checked


class PipeCollective:
    """Two ranks joined by a multiprocessing Pipe (the test's own transport)."""

    def __init__(self, rank, conn):
        self.rank, self.world_size, self.conn = rank, 2, conn

    def all_reduce_sum(self, data):
        self.conn.send(data.copy())
        data += self.conn.recv()

    def all_gather(self, data):
        self.conn.send(data)
        other = self.conn.recv()
        return data + other if self.rank == 0 else other + data


def _pipe_worker(rank, conn, results):
    try:
        results.put((rank, check_rank(rank, 2, PipeCollective(rank, conn)), ""))
    except BaseException as e:  # report, do not hang the parent
        results.put((rank, 0, repr(e)))


def _run_two(target, *args):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *a, results)) for r, a in enumerate(args)]
    for p in procs:
        p.start()
    out = sorted(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return out


def test_two_processes_over_a_pipe_equal_one_process():
    a, b = mp.get_context("spawn").Pipe()
    out = _run_two(_pipe_worker, (a,), (b,))
    for rank, checked, err in out:
        assert err == "", f"rank {rank}: {err}"
        assert checked == len(SPECS) * 3


def _torch_worker(rank, path, results):
    try:
        import torch.distributed as dist
        from kvpolicy.distributed import TorchCollective
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
        try:
            results.put((rank, check_rank(rank, 2, TorchCollective()), ""))
        finally:
            dist.destroy_process_group()
    except BaseException as e:
        results.put((rank, 0, repr(e)))


def test_two_processes_over_torch_distributed_gloo_equal_one_process():
    pytest.importorskip("torch")
    path = os.path.join(tempfile.mkdtemp(), "rendezvous")
    out = _run_two(_torch_worker, (path,), (path,))
    for rank, checked, err in out:
        assert err == "", f"rank {rank}: {err}"
        assert checked == len(SPECS) * 3


class Counting:
    def __init__(self, world=1, fail=False):
        self.rank, self.world_size, self.calls, self.fail = 0, world, 0, fail

    def all_reduce_sum(self, data):
        self.calls += 1
        if self.fail:
            raise OSError("link down")

    def all_gather(self, data):
        self.calls += 1
        if self.fail:
            raise OSError("link down")
        return data * self.world_size


def test_world_size_one_calls_nothing_and_equals_no_shard():
    q, k = inputs(128, 5)
    comm = Counting(1)
    shard = kvpolicy.HeadShard(0, HKV, HQ, comm)
    p = kvpolicy.EvictionPolicy(SPECS[0])
    a, b = p.evict(queries=q, keys=k), p.evict(queries=q, keys=k, shard=shard)
    assert np.array_equal(a.indptr, b.indptr) and np.array_equal(a.indices, b.indices)
    assert comm.calls == 0


def test_a_collective_that_raises_is_a_runtime_error():
    q, k = inputs(128, 6)
    shard = kvpolicy.HeadShard(0, HKV * 2, HQ * 2, Counting(2, fail=True))
    with pytest.raises(RuntimeError, match="collective.all_gather raised: OSError: link down"):
        kvpolicy.EvictionPolicy(SPECS[0]).evict(queries=q, keys=k, shard=shard)


def test_a_peer_that_holds_the_same_heads_is_rejected():
    q, k = inputs(128, 7)
    # all_gather echoes this rank's record as the peer's: both claim heads [0, 4) of 8.
    shard = kvpolicy.HeadShard(0, HKV * 2, HQ * 2, Counting(2))
    with pytest.raises(RuntimeError, match="overlapping rows"):
        kvpolicy.EvictionPolicy(SPECS[0]).evict(queries=q, keys=k, shard=shard)


def test_head_shard_arguments():
    with pytest.raises(ValueError, match="multiple of kv heads"):
        kvpolicy.HeadShard(0, 4, 6, Counting(2))
    with pytest.raises(ValueError, match="kv_head_offset"):
        kvpolicy.HeadShard(4, 4, 16, Counting(2))
    bad = Counting(2)
    bad.rank = 2
    with pytest.raises(ValueError, match="rank is 2"):
        kvpolicy.HeadShard(0, 4, 16, bad)
    with pytest.raises(TypeError, match="HeadShard"):
        kvpolicy.EvictionPolicy(SPECS[0]).evict(queries=inputs(64, 1)[0], keys=inputs(64, 1)[1], shard=object())
