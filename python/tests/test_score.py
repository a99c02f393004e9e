# SPDX-License-Identifier: Apache-2.0
"""policy.score(...): the per-token score map of every erased Scorer, whose per-row top-k (ties: the later token) is
evict's kept set; StreamingLLM has none and says so; Knorm's scores are minus the key norms (numpy only)."""
import numpy as np
import pytest

import kvpolicy

RNG = np.random.default_rng(77)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def topk_rows(scores, counts):
    """Each row's `counts[r]` best ids, ascending, under the library's order (higher score, then the later token)."""
    out = []
    for r, k in enumerate(counts):
        s = scores[r]
        order = sorted(range(len(s)), key=lambda j: (-np.inf if np.isnan(s[j]) else s[j], j), reverse=True)
        out.append(np.sort(np.array(order[:k], dtype=np.int32)))
    return out


def case(name):
    Hq, Hkv, T, d = 8, 2, 200, 32
    keys, values = rand(Hkv, T, d, dtype=np.float16), rand(Hkv, T, d, dtype=np.float16)
    args = dict(keys=keys, values=values)
    if name == "observed_attention":
        a = np.tril(np.abs(rand(Hq, T, T)))
        args["column_sums"] = (a / a.sum(-1, keepdims=True)).sum(1).astype(np.float32)
    elif name == "expected_attention":
        args["queries"] = rand(Hq, T, d)
    elif name == "tova":
        args["queries"] = rand(Hq, 1, d)
    elif name != "knorm":
        args["queries"] = rand(Hq, 16, d)
    return args, T


SPECS = ["snapkv:compression_ratio=0.5,window=16", "tova:compression_ratio=0.6", "observed_attention:compression_ratio=0.5",
         "pyramidkv:compression_ratio=0.5,window=16,layer=3", "adakv:compression_ratio=0.6,window=16",
         "expected_attention:compression_ratio=0.5,n_sink=2", "knorm:compression_ratio=0.7"]


@pytest.mark.parametrize("spec", SPECS)
def test_score_topk_equals_evict(spec):
    p = kvpolicy.make(spec)
    args, T = case(p.name)
    assert p.has_scores
    s = p.score(**args)
    assert s.dtype == np.float32 and s.shape == (2, T)
    keep = p.evict(**args)
    for r, want in enumerate(topk_rows(s, keep.counts())):
        assert np.array_equal(keep.row(r), want), (spec, r)
    assert np.isinf(s).sum(axis=1).tolist() == [p.protected_tokens(T)] * 2
    # the reference backend gives the same map; a caller-owned output is written in place
    np.testing.assert_allclose(p.score(**args, backend="scalar"), s, rtol=1e-5, atol=1e-7)
    out = np.full((4, T), -1.0, dtype=np.float32)[::2]  # strided rows
    assert p.score(**args, out=out) is out
    assert np.array_equal(out, s)


def test_score_batch_axis_equals_per_sequence():
    p = kvpolicy.SnapKV(compression_ratio=0.5, window=16)
    q, k = rand(2, 8, 16, 32), rand(2, 2, 120, 32)
    s = p.score(queries=q, keys=k)
    assert s.shape == (2, 2, 120)
    for b in range(2):
        assert np.array_equal(s[b], p.score(queries=q[b], keys=k[b]))
    assert np.isinf(s[:, :, -16:]).all() and not np.isinf(s[:, :, :-16]).any()


def test_knorm_scores_are_minus_key_norms_and_keep_the_smallest():
    keys = rand(3, 50, 64, dtype=np.float16)
    p = kvpolicy.Knorm(compression_ratio=0.5)
    s = p.score(keys=keys)
    ref = -np.sqrt((keys.astype(np.float64) ** 2).sum(-1))
    np.testing.assert_allclose(s, ref, rtol=1e-6)
    keep = p.evict(keys=keys).dense()
    assert keep.shape == (3, 25)
    for h in range(3):
        assert np.array_equal(keep[h], np.sort(np.argsort(-ref[h], kind="stable")[:25]))
    assert kvpolicy.Knorm(compression_ratio=0.99).kept_count(50) == 1  # kvpress >= 0.5.5 keeps one token


def test_score_errors():
    sl = kvpolicy.StreamingLLM(compression_ratio=0.5)
    assert not sl.has_scores
    with pytest.raises(ValueError, match="streaming_llm has no per-token scores: StreamingLLM keeps the attention sinks"):
        sl.score(keys=rand(2, 50, 16))
    p = kvpolicy.SnapKV(compression_ratio=0.5, window=16)
    q, k = rand(8, 16, 32), rand(2, 100, 32)
    with pytest.raises(ValueError, match="out has extent 99 on axis 1, expected 100"):
        p.score(queries=q, keys=k, out=np.zeros((2, 99), np.float32))
    with pytest.raises(TypeError, match="out has dtype float64"):
        p.score(queries=q, keys=k, out=np.zeros((2, 100), np.float64))
    out = np.full((2, 100), 7.0, np.float32)
    with pytest.raises(ValueError, match="snapkv"):
        p.score(queries=rand(8, 16, 16), keys=k, out=out)  # head_dim mismatch
    assert (out == 7.0).all()
    with pytest.raises(TypeError):
        p.score(queries=q, keys=None)
