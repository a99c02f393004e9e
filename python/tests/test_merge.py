# SPDX-License-Identifier: Apache-2.0
"""Merging from Python: KvpressMerging (against kvpress 0.5.5's fixture), LookMPivot, NearestKeptMerge, D2O, and
merge_contiguous applying a plan to a contiguous cache in place."""
import json
import pathlib

import numpy as np
import pytest

import kvpolicy
from kvpolicy import KeepSet
from kvpolicy.merging import D2O, KvpressCAM, KvpressMerging, LookMPivot, NearestKeptMerge, merge_contiguous

RNG = np.random.default_rng(5)
FIXTURE = pathlib.Path(__file__).resolve().parents[2] / "tests" / "data" / "fixtures" / "merge_kvpress.json"


def keep_of(rows):
    indptr = np.cumsum([0] + [len(r) for r in rows]).astype(np.int32)
    indices = np.concatenate([np.asarray(r, dtype=np.int32) for r in rows]) if rows else np.zeros(0, np.int32)
    return KeepSet(indptr, indices.astype(np.int32))


# The C++ hand case: K1 is parallel to K0 (cos 1) and orthogonal to K2; |V1| = |V0| = 5.
K3 = np.array([[[1, 0], [2, 0], [0, 1]]], dtype=np.float32)
V3 = np.array([[[3, 4], [0, 5], [1, 1]]], dtype=np.float32)


def test_kvpress_merging_hand_case():
    plan = KvpressMerging().merge(K3, V3, keep_of([[0, 2]]))
    w = 5.0 / (10.0 + 1e-6)
    dst, src, weight = plan.row(0)
    assert list(dst) == [0] and list(src) == [1]
    assert weight[0] == pytest.approx(w / (1 + w), rel=1e-6)
    assert plan.merged_keys is None and plan.merged_values.shape == (1, 2, 2)
    np.testing.assert_allclose(plan.merged_values[0, 0], [3 / (1 + w), (4 + 5 * w) / (1 + w)], rtol=1e-6)
    assert np.isnan(plan.merged_values[0, 1]).all()  # slot 1 received nothing
    # threshold 0.5: token 0 is parallel to kept token 1 (cos 1 >= 0.5) and still merges into slot 0.
    p2 = KvpressMerging(similarity_threshold=0.5).merge(K3, V3, keep_of([[1, 2]]))
    assert list(p2.row(0)[1]) == [0]


def test_kvpress_merging_matches_kvpress_fixture():
    cases = [c for c in json.loads(FIXTURE.read_text())["cases"] if "merge_fraction" in c]
    assert cases
    for c in cases:
        H, T, d = c["H"], c["T"], c["d"]
        keys = np.asarray(c["keys"], np.float32).reshape(H, T, d)
        values = np.asarray(c["values"], np.float32).reshape(H, T, d)
        want = np.asarray(c["merged_values"], np.float32).reshape(H, -1, d)
        keep = keep_of(c["kept"])
        plan = KvpressMerging(similarity_threshold=c["similarity_threshold"],
                              merge_fraction=c["merge_fraction"]).merge(keys, values, keep)
        changed = 0
        for h in range(H):
            kept = np.asarray(c["kept"][h])
            dst, src, w = plan.row(h)
            assert (w > 0).all() and not np.isin(src, kept).any()
            touched = np.zeros(len(kept), bool)
            touched[dst] = True
            got = np.where(touched[:, None], plan.merged_values[h], values[h, kept])
            err = np.abs(got - want[h]).max(axis=1) / np.maximum(np.abs(want[h]).max(axis=1), 1e-30)
            assert (err <= 1e-6).all()
            changed += int(touched.sum())
        assert changed == c["slots_changed"]


def test_kvpress_cam_matches_kvpress_fixture():
    cases = [c for c in json.loads(FIXTURE.read_text())["cases"] if c["kind"] == "cam_press"]
    assert len(cases) >= 8
    for c in cases:
        H, T, d, n = c["H"], c["T"], c["d"], c["target_size"]
        values = np.asarray(c["values"], np.float32).reshape(H, T, d)
        attn = np.asarray(c["attention_sums"], np.float32).reshape(H, T)
        scores = np.asarray(c["scores"], np.float32).reshape(H, T)
        want = np.asarray(c["merged_values"], np.float32).reshape(H, n, d)
        cam = KvpressCAM(merge_budget=c["merge_budget"])
        keep = cam.evict(scores, n)
        for h in range(H):
            assert keep.row(h).tolist() == c["kept"]
        plan = cam.merge(values, keep, attention_sums=attn, scores=scores, new_tokens=c["new_tokens"], seed=c["seed"])
        assert plan.merged_keys is None
        draws = 0
        kept = np.asarray(c["kept"])
        for h in range(H):
            dst, src, _ = plan.row(h)
            draws += int(len(src) and 1 + np.count_nonzero(np.diff(src)))
            touched = np.zeros(n, bool)
            touched[dst] = True
            got = np.where(touched[:, None], plan.merged_values[h], values[h, kept])
            err = np.abs(got - want[h]).max(axis=1) / np.maximum(np.abs(want[h]).max(axis=1), 1e-30)
            assert (err <= 1e-6).all()
        assert draws == c["draws"]


def test_kvpress_cam_hand_case_and_errors():
    # A[1] = 2 > the mean of its window (1): p = 1; V[1] spreads over the next 2 kept tokens with weight 1/2.
    v = np.array([[[1, 1], [4, 8], [10, 20], [30, 40], [50, 60]]], np.float32)
    attn = np.array([[1, 2, 1, 1, 1]], np.float32)
    plan = KvpressCAM(merge_budget=2).merge(v, keep_of([[0, 2, 3, 4]]), attention_sums=attn)
    dst, src, w = plan.row(0)
    assert dst.tolist() == [1, 2] and src.tolist() == [1, 1] and w.tolist() == [0.5, 0.5]
    np.testing.assert_array_equal(plan.merged_values[0, 1], [12, 24])
    np.testing.assert_array_equal(plan.merged_values[0, 2], [32, 44])
    with pytest.raises(ValueError, match="scores"):  # fewer candidates than evicted tokens need scores
        KvpressCAM(merge_budget=2).merge(v, keep_of([[0, 3, 4]]), attention_sums=attn, new_tokens=0)
    with pytest.raises(ValueError, match="merge_budget"):
        KvpressCAM(merge_budget=0).merge(v, keep_of([[0, 2, 3, 4]]), attention_sums=attn)


def lookm_reference(K, V, kept_rows):
    """numpy LOOK-M pivot, per head: cosine argmax over kept (ties: earliest), X[c] = ((1 + n/2) X[c] + sum X[e] / 2) / (1 + n)."""
    H, T, d = K.shape
    for h in range(H):
        kept = np.asarray(kept_rows[h])
        ev = np.setdiff1d(np.arange(T), kept)
        u = K[h] / np.maximum(np.linalg.norm(K[h], axis=1, keepdims=True), 1e-8)
        tgt = np.argmax(u[ev] @ u[kept].T, axis=1)
        n = np.bincount(tgt, minlength=len(kept)).astype(np.float64)
        mk, mv = [], []
        for X, acc in ((K[h], mk), (V[h], mv)):
            s = np.zeros((len(kept), d))
            np.add.at(s, tgt, X[ev] / 2)
            acc.append(((1 + n / 2)[:, None] * X[kept] + s) / (1 + n)[:, None])
        yield h, kept, ev, tgt, n, mk[0], mv[0]


def test_lookm_pivot_hand_case_and_numpy_reference():
    plan = LookMPivot().merge(K3, V3, keep_of([[0, 2]]))
    dst, src, w = plan.row(0)
    assert list(dst) == [0] and list(src) == [1] and w[0] == 0.25
    np.testing.assert_allclose(plan.merged_keys[0, 0], (1.5 * K3[0, 0] + 0.5 * K3[0, 1]) / 2)
    np.testing.assert_allclose(plan.merged_values[0, 0], (1.5 * V3[0, 0] + 0.5 * V3[0, 1]) / 2)
    # Random cache, the keep set of a bound eviction policy (SnapKV).
    H, T, d = 2, 40, 16
    K = RNG.standard_normal((H, T, d)).astype(np.float32)
    V = RNG.standard_normal((H, T, d)).astype(np.float32)
    Q = RNG.standard_normal((4, 8, d)).astype(np.float32)
    keep = kvpolicy.SnapKV(compression_ratio=0.5, window=8).evict(queries=Q, keys=K)
    plan = LookMPivot().merge(K, V, keep)
    for h, kept, ev, tgt, n, mk, mv in lookm_reference(K, V, [keep.row(r) for r in range(H)]):
        dst, src, w = plan.row(h)
        np.testing.assert_array_equal(src, ev)
        np.testing.assert_array_equal(dst, tgt)
        np.testing.assert_allclose(w, 1 / (2 * (1 + n[tgt])), rtol=1e-6)
        hit = n > 0
        np.testing.assert_allclose(plan.merged_keys[h][hit], mk[hit], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(plan.merged_values[h][hit], mv[hit], rtol=1e-5, atol=1e-6)
    # float16 caches are read in place too (same plan structure).
    p16 = LookMPivot().merge(K.astype(np.float16), V.astype(np.float16), keep, merge_keys=False)
    assert p16.merged_keys is None and p16.merged_values.shape == plan.merged_values.shape


def test_nearest_kept_weights_are_python_owned():
    m = NearestKeptMerge()
    st = m.new_state(1, 4)
    plan = m.merge(K3, V3, keep_of([[0, 2]]), st)
    dst, src, w = plan.row(0)
    assert list(dst) == [0] and list(src) == [1] and w[0] == 0.5
    np.testing.assert_allclose(plan.merged_keys[0, 0], (K3[0, 0] + K3[0, 1]) / 2)
    np.testing.assert_allclose(plan.merged_values[0, 0], (V3[0, 0] + V3[0, 1]) / 2)
    np.testing.assert_array_equal(st.weights[0, :2], [2, 1])  # re-packed in kept order: slot 0 holds two tokens' mass
    # A second step: token mass 2 in slot 0 weighs double; weight of the source = 1 / (2 + 1).
    K2 = np.array([[[1, 0], [0, 1], [1, 0.1]]], np.float32)
    st.init(0, 2, 3)
    plan = m.merge(K2, K2, keep_of([[0, 1]]), st)
    assert list(plan.row(0)[1]) == [2] and plan.row(0)[2][0] == pytest.approx(1 / 3)
    np.testing.assert_allclose(plan.merged_keys[0, 0], (2 * K2[0, 0] + K2[0, 2]) / 3, rtol=1e-6)
    np.testing.assert_array_equal(st.weights[0, :2], [3, 1])
    # Bad weights: ValueError, nothing written.
    bad = m.new_state(1, 3)
    bad.weights[0, 1] = 0
    before = bad.weights.copy()
    with pytest.raises(ValueError, match="must be finite and > 0"):
        m.merge(K3, V3, keep_of([[0, 2]]), bad)
    np.testing.assert_array_equal(bad.weights, before)
    with pytest.raises(ValueError, match="threshold"):
        NearestKeptMerge(threshold=2).merge(K3, V3, keep_of([[0, 2]]), m.new_state(1, 3))


def test_d2o_state_and_evict():
    d2o = D2O(heavy=1, recent=1, sinks=0)
    st = d2o.new_state()
    plan = d2o.merge(K3, V3, keep_of([[0, 2]]), st)
    # One evicted token, similarity 1 with slot 0: tau = mean(s) = 1 on the first call, 1 >= 1 merges.
    assert st.initialised and st.tau == pytest.approx(1.0)
    dst, src, w = plan.row(0)
    assert list(dst) == [0] and list(src) == [1] and w[0] == pytest.approx(0.5)
    np.testing.assert_allclose(plan.merged_keys[0, 0], (K3[0, 0] + K3[0, 1]) / 2)
    # EMA: tau <- alpha tau + beta mean(s) = 0.5 * 1 + 0.5 * 0 (token 2 is orthogonal to token 0), no merge (0 < 0.5).
    p2 = d2o.merge(K3, V3, keep_of([[0, 1]]), st)
    assert st.tau == pytest.approx(0.5) and int(p2.indptr[-1]) == 0
    # Unequal keep counts across heads: ValueError, the state is unchanged.
    K = np.concatenate([K3, K3]), np.concatenate([V3, V3])
    with pytest.raises(ValueError, match="equal counts"):
        d2o.merge(K[0], K[1], keep_of([[0, 2], [2]]), st)
    assert st.tau == pytest.approx(0.5)
    with pytest.raises(ValueError, match="weighting"):
        D2O(weighting="mean").merge(K3, V3, keep_of([[0, 2]]), st)
    # evict: sinks, top-heavy of the older tokens, the last recent.
    scores = np.array([[0.0, 5.0, 1.0, 2.0, 0.5], [9.0, 0.0, 3.0, 1.0, 0.5]], np.float32)
    keep = D2O(heavy=2, recent=1, sinks=1).evict(scores)
    assert keep.dense().tolist() == [[0, 1, 4], [0, 2, 4]]


def test_merge_contiguous_compacts_and_writes_rows():
    K = np.ascontiguousarray(np.concatenate([K3, K3[:, ::-1]], axis=1))  # (1, 6, 2)
    V = np.ascontiguousarray(np.concatenate([V3, V3[:, ::-1]], axis=1))
    keep = keep_of([[0, 2, 5]])
    plan = LookMPivot().merge(K, V, keep)
    k, v = K.copy(), V.copy()
    pos = np.arange(6, dtype=np.int32)[None].copy()
    lens = plan.apply(k, v, 6, positions=pos)
    assert lens.tolist() == [3]
    assert pos[0, :3].tolist() == [0, 2, 5]
    dst = set(plan.row(0)[0].tolist())
    for c, t in enumerate([0, 2, 5]):
        np.testing.assert_allclose(k[0, c], plan.merged_keys[0, c] if c in dst else K[0, t])
        np.testing.assert_allclose(v[0, c], plan.merged_values[0, c] if c in dst else V[0, t])
    # compact=False: rows land at the kept tokens' own slots, nothing moves.
    k2, v2 = K.copy(), V.copy()
    assert merge_contiguous(k2, v2, 6, plan, compact=False) is None
    for c, t in enumerate([0, 2, 5]):
        np.testing.assert_allclose(k2[0, t], plan.merged_keys[0, c] if c in dst else K[0, t])
    # float16 cache, values-only plan (kvpress MergingPress): keys may be None with compact=False.
    v16 = V.astype(np.float16)
    pv = KvpressMerging().merge(K.astype(np.float16), v16, keep)
    merge_contiguous(None, v16, 6, pv, compact=False)
    for c in pv.row(0)[0]:
        np.testing.assert_allclose(v16[0, keep.row(0)[c]], pv.merged_values[0, c], rtol=1e-3)


def test_merge_errors_write_nothing():
    K = K3.copy()
    V = V3.copy()
    with pytest.raises(ValueError, match="rows"):
        LookMPivot().merge(K, V, keep_of([[0, 2], [1]]))  # two rows for one kv head
    with pytest.raises(ValueError, match="similarity_threshold"):
        KvpressMerging(similarity_threshold=1.5).merge(K, V, keep_of([[0, 2]]))
    with pytest.raises(ValueError):
        LookMPivot().merge(K, V, keep_of([[2, 0]]))  # not ascending
    with pytest.raises(TypeError):
        LookMPivot().merge(K.astype(np.float64), V.astype(np.float64), keep_of([[0, 2]]))
    plan = LookMPivot().merge(K, V, keep_of([[0, 2]]))
    plan.src[0] = 2  # a kept token as a merge source
    k, v = K.copy(), V.copy()
    with pytest.raises(ValueError, match="is kept"):
        plan.apply(k, v, 3)
    np.testing.assert_array_equal(k, K)
    np.testing.assert_array_equal(v, V)
    plan.src[0] = 1
    plan.merged_keys[0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="not finite"):
        plan.apply(k, v, 3)
    np.testing.assert_array_equal(k, K)
