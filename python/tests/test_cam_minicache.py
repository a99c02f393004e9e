# SPDX-License-Identifier: Apache-2.0
"""CaM (streaming and prefill forms) and MiniCache from Python: CaM's streaming plan against a direct numpy statement of
zyxxmu/cam's slicev with torch's CPU Bernoulli draws (mt19937 after manual_seed: numpy's RandomState gives the same
32-bit outputs), the prefill form's structure and errors; MiniCache's store (norms, retained tokens by angular
distance) and its restore (exact at t = 0 / t = 1, retained rows the originals)."""
import numpy as np
import pytest

import kvpolicy
from kvpolicy.merging import CaM, MiniCache

RNG = np.random.default_rng(5)


def torch_uniforms(seed, n):
    """torch.bernoulli's uniforms on the CPU generator after torch.manual_seed(seed): (x & 0xFFFFFF) * 2^-24."""
    x = np.random.RandomState(seed).randint(0, 2 ** 32, size=n, dtype=np.uint64).astype(np.uint32)
    return (x & 0xFFFFFF).astype(np.float64) / 16777216.0


def ref_streaming(values, keep_rows, A, M, seed):
    H, T, d = values.shape
    evicted = [np.setdiff1d(np.arange(T), k) for k in keep_rows]
    E = max(len(e) for e in evicted)
    u = torch_uniforms(seed, E * H).astype(np.float32)
    entries, merged = [], np.full((H, max(len(k) for k in keep_rows), d), np.nan, np.float32)
    for h in range(H):
        kept = keep_rows[h]
        acc = values[h, kept].astype(np.float32).copy()
        touched = np.zeros(len(kept), bool)
        row = []
        for i, e in enumerate(evicted[h]):
            s0 = int(np.searchsorted(kept, e, side="right"))
            n = min(M, len(kept) - s0)
            if n == 0:
                continue
            mean = np.float32(A[h, kept[s0:s0 + n]].astype(np.float32).sum() / np.float32(n))
            with np.errstate(divide="ignore", invalid="ignore"):
                p = np.float32(A[h, e]) / mean
            p = 0.0 if np.isnan(p) else min(max(p, 0.0), 1.0)
            if not u[i * H + h] < p:
                continue
            for w in range(n):
                row.append((s0 + w, int(e)))
                acc[s0 + w] += values[h, e] / np.float32(M)
                touched[s0 + w] = True
        merged[h, touched] = acc[touched]
        entries.append(row)
    return entries, merged


def test_cam_streaming_matches_the_reference_rule():
    H, T, d, M = 2, 60, 16, 4
    values = RNG.standard_normal((H, T, d)).astype(np.float32)
    A = np.abs(RNG.standard_normal((H, T))).astype(np.float32)
    keep = kvpolicy.StreamingLLM(sinks=4, tokens=40).evict(keys=values)
    rows = [np.asarray(keep.row(h)) for h in range(H)]
    for seed in (0, 7):
        plan = CaM(merge_num=M).merge(values, keep, attention_sums=A, seed=seed)
        entries, merged = ref_streaming(values, rows, A, M, seed)
        assert sum(len(r) for r in entries) > 0
        for h in range(H):
            dst, src, w = plan.row(h)
            assert list(zip(dst.tolist(), src.tolist())) == entries[h]
            assert np.all(w == np.float32(1.0 / M))
        assert plan.merged_keys is None
        np.testing.assert_allclose(plan.merged_values, merged, rtol=1e-6, atol=1e-6)
    # query-head attention (GQA) is averaged over each kv head's group: equal to the kv-head mean given directly
    Aq = np.abs(RNG.standard_normal((4, T))).astype(np.float32)
    a = CaM(merge_num=M).merge(values, keep, attention_sums=Aq, seed=3)
    b = CaM(merge_num=M).merge(values, keep, attention_sums=Aq.reshape(2, 2, T).mean(1), seed=3)
    assert np.array_equal(a.indptr, b.indptr) and np.array_equal(a.src, b.src)
    # applied to the cache: compaction to the keep set with the merged rows in the kept slots
    k, v = values.copy(), values.copy()
    lens = plan.apply(k, v, T)
    assert lens.tolist() == [40, 40]


def test_cam_prefill_form_and_errors():
    H, T, d, S, R = 2, 48, 8, 4, 16
    values = RNG.standard_normal((H, T, d)).astype(np.float32)
    a = np.tril(np.abs(RNG.standard_normal((H, T, T)))).astype(np.float32)
    att = (a / a.sum(-1, keepdims=True)).astype(np.float32)
    keep = kvpolicy.StreamingLLM(sinks=S, tokens=S + R).evict(keys=values)
    plan = CaM(form="prefill", start=S, recent=R).merge(values, keep, attention=att, seed=1)
    for h in range(H):
        dst, src, w = plan.row(h)
        assert np.all((dst >= 0) & (dst < S + R)) and np.all(w == np.float32(1.0 / R))
        assert np.all(np.isin(src, np.setdiff1d(np.arange(T), keep.row(h))))
        hit = np.unique(dst)
        assert np.isfinite(plan.merged_values[h, hit]).all()
    with pytest.raises(ValueError, match="not the start \\+ recent set"):
        CaM(form="prefill", start=S, recent=R).merge(values, kvpolicy.SnapKV(tokens=S + R, window=4).evict(
            queries=RNG.standard_normal((2, 4, d)).astype(np.float32), keys=values), attention=att)
    with pytest.raises(ValueError, match="form is 'decode'"):
        CaM(form="decode").merge(values, keep, attention_sums=att[:, -1])
    with pytest.raises(ValueError, match="merge_num is 0"):
        CaM(merge_num=0).merge(values, keep, attention_sums=att[:, -1])
    with pytest.raises(TypeError):
        CaM().merge(values, keep)  # the streaming form needs attention_sums


def test_minicache_store_and_restore():
    H, T, d = 2, 80, 32
    prev = RNG.standard_normal((H, T, d)).astype(np.float32)
    cur = (0.8 * prev + 0.6 * RNG.standard_normal((H, T, d))).astype(np.float32)
    store = MiniCache(t=0.6, gamma=0.3).merge(prev, cur)
    np.testing.assert_allclose(store.norm_prev, np.linalg.norm(prev, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(store.norm_cur, np.linalg.norm(cur, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(store.direction, axis=-1), 1.0, rtol=1e-5)
    # retained: angular distance above d_min + gamma (d_max - d_min), per head
    cos = (prev * cur).sum(-1) / np.linalg.norm(prev, axis=-1) / np.linalg.norm(cur, axis=-1)
    dist = np.arccos(np.clip(cos, -1, 1)) / np.pi
    for h in range(H):
        thr = dist[h].min() + 0.3 * (dist[h].max() - dist[h].min())
        sure = np.abs(dist[h] - thr) > 1e-5
        got = np.zeros(T, bool)
        got[np.asarray(store.retained.row(h))] = True
        assert np.array_equal(got[sure], (dist[h] > thr)[sure])
    assert 0 < int(store.retained.indptr[-1]) < H * T
    for layer, orig in ((0, prev), (1, cur)):
        out = MiniCache().restore(store, layer)
        for h in range(H):
            ids = np.asarray(store.retained.row(h))
            assert np.array_equal(out[h, ids], orig[h, ids])  # retained rows are the originals
        np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(orig, axis=-1), rtol=1e-5)
    # t = 0: the shared direction is layer l-1's, so l-1 comes back exactly (up to fp32 rounding); t = 1: layer l
    np.testing.assert_allclose(MiniCache().restore(MiniCache(t=0.0, gamma=1.0).merge(prev, cur), 0), prev, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(MiniCache().restore(MiniCache(t=1.0, gamma=1.0).merge(prev, cur), 1), cur, rtol=1e-5, atol=1e-5)
    half = MiniCache().restore(store, 1, out=np.zeros((H, T, d), np.float16))
    assert half.dtype == np.float16
    # float16 layers are read in place (widened per row): at t = 1 layer l comes back up to fp16 rounding
    c16 = cur.astype(np.float16)
    np.testing.assert_allclose(MiniCache().restore(MiniCache(t=1.0, gamma=1.0).merge(prev.astype(np.float16), c16), 1),
                               c16.astype(np.float32), rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="minicache: t is 1.5"):
        MiniCache(t=1.5).merge(prev, cur)
    with pytest.raises(ValueError, match="layer is 2"):
        MiniCache().restore(store, 2)
    with pytest.raises(TypeError):
        MiniCache().merge(prev, cur.astype(np.float16))
    assert MiniCache.bytes_per_token(128, 0.1) == 4.0 * 130 + 0.1 * 8 * 128
