# SPDX-License-Identifier: Apache-2.0
"""MixedPrecision(SnapKV, per-token quantizer): the budget split, tiers by SnapKV's ranking, the window in the full
tier, full_share = 1 equal to SnapKV eviction at the same bytes, and errors."""
import numpy as np
import pytest

import kvpolicy

RNG = np.random.default_rng(9)
HQ, H, T, D, W = 4, 2, 100, 64, 8
Q = RNG.standard_normal((HQ, W, D)).astype(np.float32)
K = RNG.standard_normal((H, T, D)).astype(np.float32)
SNAP = kvpolicy.SnapKV(compression_ratio=0.5, window=W, kernel=5)


def tiers(keep, full, h):
    ids = np.asarray(keep.row(h))
    f = full[int(keep.indptr[h]):int(keep.indptr[h + 1])]
    return set(ids[f == 1].tolist()), set(ids[f == 0].tolist())


def test_split_formula():
    mp = kvpolicy.MixedPrecision(SNAP, "ggml:type=q4_0", ratio=0.1, full_share=0.5)
    # fp32 keys: Bf = 256, q4_0 Bq = 36; budget 2560 -> 5 full, floor(1280 / 36) = 35 low.
    assert mp.bytes_per_token(D) == 36
    assert mp.split(T, D, 4) == (5, 35)
    assert mp.split(T, D, 2) == (5, 17)  # fp16: budget 1280, 5 full in 640 bytes, floor(640 / 36) = 17 low
    # Every token fits: the spare bytes buy precision, floor((6400 - 100 * 36) / (256 - 36)) = 12 full.
    assert kvpolicy.MixedPrecision(SNAP, "ggml:type=q4_0", ratio=0.25).split(T, D, 4) == (12, 88)
    # bytes= overrides ratio; full_share = 0: everything the quantized format holds.
    assert kvpolicy.MixedPrecision(SNAP, "int4", bytes=1000.0, full_share=0.0).split(T, D, 4) == (0, 1000 // (D // 2 + 8))


@pytest.mark.parametrize("spec", ["ggml:type=q4_0", "ggml:type=q8_0", "fp8", "int4:bits=8"])
def test_tiers_follow_snapkv_ranking(spec):
    mp = kvpolicy.MixedPrecision("snapkv:compression_ratio=0.5,window=8,kernel=5", spec, ratio=0.1, full_share=0.5)
    n_full, n_low = mp.split(T, D, 4)
    keep, full = mp.decide(Q, K)
    scores = mp.scores(Q, K)
    assert scores.shape == (H, T) and np.isinf(scores[:, -W:]).all()
    assert keep.counts().tolist() == [n_full + n_low] * H and full.dtype == np.uint8 and set(full.tolist()) <= {0, 1}
    for h in range(H):
        order = np.argsort(-scores[h], kind="stable")  # higher first, ties by position
        got_full, got_low = tiers(keep, full, h)
        assert got_full == set(order[:n_full].tolist())
        assert got_low == set(order[n_full:n_full + n_low].tolist())
        assert (np.diff(keep.row(h)) > 0).all()


def test_window_in_full_tier_and_fp16_keys():
    mp = kvpolicy.MixedPrecision(SNAP, "ggml:type=q4_0", ratio=0.25)
    k16 = K.astype(np.float16)
    n_full, n_low = mp.split(T, D, 2)
    keep, full = mp.decide(Q, k16)
    assert n_full >= W and keep.counts().tolist() == [n_full + n_low] * H
    for h in range(H):
        got_full, _ = tiers(keep, full, h)
        assert set(range(T - W, T)) <= got_full


def test_full_share_one_is_snapkv_eviction_at_the_same_bytes():
    budget = 30 * D * 4  # 30 fp32 tokens
    mp = kvpolicy.MixedPrecision(SNAP, "int4", bytes=float(budget), full_share=1.0)
    assert mp.split(T, D, 4) == (30, 0)
    keep, full = mp.decide(Q, K)
    assert (full == 1).all()
    want = kvpolicy.SnapKV(tokens=30, window=W, kernel=5).evict(queries=Q, keys=K)
    np.testing.assert_array_equal(keep.dense(), want.dense())


def test_errors():
    with pytest.raises(ValueError, match="per-token"):
        kvpolicy.MixedPrecision(SNAP, "kivi")
    with pytest.raises(ValueError, match="full_share"):
        kvpolicy.MixedPrecision(SNAP, "int4", full_share=1.5)
    with pytest.raises(ValueError, match="ratio"):
        kvpolicy.MixedPrecision(SNAP, "int4", ratio=0.0)
    with pytest.raises(ValueError, match="SnapKV"):
        kvpolicy.MixedPrecision("tova", "int4")
    with pytest.raises(ValueError):
        kvpolicy.MixedPrecision(SNAP, "nope")
    mp = kvpolicy.MixedPrecision(SNAP, "int4")
    with pytest.raises(ValueError):
        mp.decide(Q[:, :, :32], K)  # head_dim mismatch
    with pytest.raises(TypeError):
        mp.decide(Q, K.astype(np.float64))
