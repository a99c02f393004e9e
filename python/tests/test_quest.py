# SPDX-License-Identifier: Apache-2.0
"""Quest from Python on a paged cache given as arrays, against a direct numpy statement of Quest's page scoring."""
import numpy as np
import pytest

import kvpolicy

RNG = np.random.default_rng(2024)
P, NPAGES, HKV, D = 16, 40, 2, 32


def make_cache(dtype=np.float32):
    """A pool (NHD) and a table of two sequences: 12 pages (last holds 5 tokens) and 9 pages (last full)."""
    pool = RNG.standard_normal((NPAGES, P, HKV, D)).astype(dtype)
    perm = RNG.permutation(NPAGES).astype(np.int32)
    indices = np.concatenate([perm[:12], perm[12:21]]).astype(np.int32)
    indptr = np.array([0, 12, 21], np.int32)
    last = np.array([5, 16], np.int32)
    return pool, indptr, indices, last


def ref_meta(pool, indptr, indices, last):
    """Channel max / min of each referenced page's valid slots, per kv head: {page: (max (HKV, D), min (HKV, D))}."""
    out = {}
    for b in range(len(last)):
        pages = indices[indptr[b]:indptr[b + 1]]
        for i, p in enumerate(pages):
            n = last[b] if i == len(pages) - 1 else P
            k = pool[p, :n].astype(np.float32)  # (n, HKV, D)
            out[int(p)] = (k.max(0), k.min(0))
    return out


def ref_select(meta, q, indptr, indices, B, mode="per_query_head"):
    """Quest's rule: U[h][p] = sum_i max(q_h[i] M[p][g][i], q_h[i] m[p][g][i]) over the complete pages, top-(B-1) with
    ties to the later page, plus the last page; rows in ascending logical order. Returns logical page lists per row."""
    rows = []
    Hq = q.shape[1]
    G = Hq // HKV
    for b in range(len(indptr) - 1):
        pages = indices[indptr[b]:indptr[b + 1]]
        n = len(pages)
        if n <= B:
            rows += [list(range(n))] * (Hq if mode == "per_query_head" else HKV)
            continue
        U = np.zeros((Hq, n - 1), np.float32)
        for h in range(Hq):
            g = h // G
            for j in range(n - 1):
                M, m = meta[int(pages[j])]
                qh = q[b, h].astype(np.float32)
                U[h, j] = np.maximum(qh * M[g], qh * m[g]).sum()

        def top(u):
            order = sorted(range(n - 1), key=lambda j: (-u[j], -j))[:B - 1]
            return sorted(order) + [n - 1]

        if mode == "per_query_head":
            rows += [top(U[h]) for h in range(Hq)]
        else:
            for g in range(HKV):
                grp = U[g * G:(g + 1) * G]
                rows.append(top(grp.max(0) if mode == "group_max" else grp.sum(0)))
    return rows


def test_metadata_matches_numpy_and_incremental_append():
    pool, indptr, indices, last = make_cache()
    quest = kvpolicy.Quest(token_budget=64)
    st = quest.new_state(NPAGES, HKV, D)
    assert st.data.shape == (NPAGES, HKV, 2, D) and np.isneginf(st.data[:, :, 0]).all() and np.isposinf(st.data[:, :, 1]).all()
    quest.on_append(st, pool, indptr, indices, last)
    ref = ref_meta(pool, indptr, indices, last)
    for p, (M, m) in ref.items():
        assert np.array_equal(st.data[p, :, 0], M) and np.array_equal(st.data[p, :, 1], m)
    untouched = sorted(set(range(NPAGES)) - set(ref))
    assert np.isneginf(st.data[untouched, :, 0]).all()
    # one decode step on sequence 0: the key goes to slot 5 of its last page
    pool[indices[11], 5] = RNG.standard_normal((HKV, D)) * 4
    last2 = np.array([6, 16], np.int32)
    quest.on_append(st, pool, indptr, indices, last2, append_len=np.array([1, 0], np.int32))
    full = quest.new_state(NPAGES, HKV, D)
    quest.on_append(full, pool, indptr, indices, last2)
    assert np.array_equal(st.data[indices], full.data[indices])


@pytest.mark.parametrize("mode", ["per_query_head", "group_max", "group_sum"])
def test_select_matches_numpy_quest(mode):
    pool, indptr, indices, last = make_cache()
    quest = kvpolicy.Quest(token_budget=4 * P, gqa=mode)
    assert quest.page_budget(P) == 4
    st = quest.new_state(NPAGES, HKV, D)
    quest.on_append(st, pool, indptr, indices, last)
    q = RNG.standard_normal((2, 4, D)).astype(np.float32)
    sel = quest.select(st, q, indptr, indices, last, page_size=P, layer=2)
    ref = ref_select(ref_meta(pool, indptr, indices, last), q, indptr, indices, 4, mode)
    assert sel.num_rows == len(ref) == (8 if mode == "per_query_head" else 4)
    rows_per_seq = sel.num_rows // 2
    for r, want in enumerate(ref):
        b = r // rows_per_seq
        assert list(sel.logical_row(r)) == want
        assert list(sel.row(r)) == [int(indices[indptr[b] + j]) for j in want]
        assert sel.last_page_len[r] == last[b]


def test_dense_layers_short_sequences_layouts_and_dtypes():
    pool, indptr, indices, last = make_cache(np.float16)
    quest = kvpolicy.make("quest", token_budget=10 * P)  # 10 pages: sequence 1 (9 pages) attends everything
    st = quest.new_state(NPAGES, HKV, D, dtype=np.float16)
    quest.on_append(st, pool, indptr, indices, last)
    hnd = np.ascontiguousarray(pool.transpose(0, 2, 1, 3))  # (pages, kv_heads, page_size, d)
    st2 = quest.new_state(NPAGES, HKV, D, dtype="float32")
    quest.on_append(st2, hnd, indptr, indices, last, layout="HND")
    assert np.array_equal(st.data[indices].astype(np.float32), st2.data[indices])  # exact in either dtype
    q = RNG.standard_normal((2, 4, D)).astype(np.float16)
    a = quest.select(st, q, indptr, indices, last, page_size=P, layer=2)
    b = quest.select(st2, q, indptr, indices, last, page_size=P, layer=2)
    assert np.array_equal(a.indices, b.indices) and np.array_equal(a.indptr, b.indptr)
    assert all(len(a.row(r)) == 10 for r in range(4)) and all(list(a.logical_row(r)) == list(range(9)) for r in range(4, 8))
    dense = quest.select(st, q, indptr, indices, last, page_size=P, layer=0)  # layers < dense_layers=2: every page
    assert all(list(dense.logical_row(r)) == list(range(12)) for r in range(4))
    info = next(p for p in kvpolicy.policies() if p.name == "quest")
    assert info.bound and info.cls is kvpolicy.Quest


def test_errors_raise_library_message_and_write_nothing():
    pool, indptr, indices, last = make_cache()
    quest = kvpolicy.Quest(token_budget=64)
    st = quest.new_state(NPAGES, HKV, D)
    quest.on_append(st, pool, indptr, indices, last)
    before = st.data.copy()
    bad = indices.copy()
    bad[3] = bad[5]
    with pytest.raises(ValueError, match="quest: page table sequence 0 lists page .* twice"):
        quest.select(st, RNG.standard_normal((2, 4, D)).astype(np.float32), indptr, bad, last, page_size=P, layer=2)
    with pytest.raises(ValueError, match=r"quest: append_len\[0\] is 999"):
        quest.on_append(st, pool, indptr, indices, last, append_len=np.array([999, 0], np.int32))
    with pytest.raises(ValueError, match="metadata has 41 pages, the page pool has 40"):
        quest.on_append(quest.new_state(NPAGES + 1, HKV, D), pool, indptr, indices, last)
    with pytest.raises(ValueError, match="cannot hold keys of dtype float32 exactly"):
        quest.on_append(quest.new_state(NPAGES, HKV, D, "float16"), pool, indptr, indices, last)
    with pytest.raises(ValueError, match="token_budget=8 / page_size=16 rounds down to 0 pages"):
        kvpolicy.Quest(token_budget=8).select(st, RNG.standard_normal((2, 4, D)).astype(np.float32), indptr, indices, last,
                                              page_size=P, layer=2)
    with pytest.raises(TypeError, match="must be int32"):
        quest.on_append(st, pool, indptr.astype(np.int64), indices, last)
    assert np.array_equal(st.data, before)


# ---- compact_paged ---------------------------------------------------------------------------------------------------


def token_rows(pool, indptr, indices, b, h, n):
    """Rows of tokens [0, n) of sequence b, kv head h (NHD pool)."""
    pages = indices[indptr[b]:indptr[b + 1]]
    return np.stack([pool[pages[t // P], t % P, h] for t in range(n)]) if n else np.zeros((0, D), pool.dtype)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_compact_paged_matches_numpy(layout):
    kp, indptr, indices, last = make_cache()
    vp = RNG.standard_normal(kp.shape).astype(np.float32)
    pos = np.broadcast_to(np.arange(NPAGES * P, dtype=np.int32).reshape(NPAGES, 1, P), (NPAGES, HKV, P)).copy()
    lens = [11 * P + 5, 9 * P]
    counts = [37, 16]  # sequence 0 keeps 37 tokens (3 pages, last holds 5), sequence 1 keeps 16 (1 full page)
    rows = [np.sort(RNG.choice(lens[b], counts[b], replace=False)).astype(np.int32) for b in range(2) for _ in range(HKV)]
    keep = kvpolicy.KeepSet(np.cumsum([0] + [len(r) for r in rows]).astype(np.int32), np.concatenate(rows))
    want_k = [token_rows(kp, indptr, indices, b, h, lens[b])[rows[b * HKV + h]] for b in range(2) for h in range(HKV)]
    want_v = [token_rows(vp, indptr, indices, b, h, lens[b])[rows[b * HKV + h]] for b in range(2) for h in range(HKV)]
    want_pos = []
    for b in range(2):
        for h in range(HKV):
            pages = indices[indptr[b]:indptr[b + 1]]
            want_pos.append(np.array([pos[pages[t // P], h, t % P] for t in rows[b * HKV + h]]))
    if layout == "HND":
        k_arr, v_arr = kp.transpose(0, 2, 1, 3), vp.transpose(0, 2, 1, 3)  # strided views: compacted in place
    else:
        k_arr, v_arr = kp, vp
    ip, ids, lp, freed = kvpolicy.compact_paged(k_arr, indptr, indices, last, keep, v_pages=v_arr, positions=pos, layout=layout)
    assert list(ip) == [0, 3, 4] and list(lp) == [5, 16]
    assert list(ids) == list(indices[:3]) + [indices[12]]
    assert sorted(freed) == sorted(list(indices[3:12]) + list(indices[13:21]))
    for b in range(2):
        for h in range(HKV):
            r = b * HKV + h
            assert np.array_equal(token_rows(kp, ip, ids, b, h, counts[b]), want_k[r])
            assert np.array_equal(token_rows(vp, ip, ids, b, h, counts[b]), want_v[r])
            pages = ids[ip[b]:ip[b + 1]]
            assert [pos[pages[t // P], h, t % P] for t in range(counts[b])] == list(want_pos[r])


def test_compact_paged_errors_write_nothing():
    kp, indptr, indices, last = make_cache()
    before = kp.copy()
    rows = [np.arange(10, dtype=np.int32), np.arange(12, dtype=np.int32), np.arange(5, dtype=np.int32), np.arange(5, dtype=np.int32)]
    keep = kvpolicy.KeepSet(np.cumsum([0] + [len(r) for r in rows]).astype(np.int32), np.concatenate(rows) + 1)
    with pytest.raises(ValueError, match="compact_paged: sequence 0 keeps 10 tokens in kv head 0 but 12 in kv head 1"):
        kvpolicy.compact_paged(kp, indptr, indices, last, keep)
    shared = indices.copy()
    shared[15] = shared[2]
    ok = kvpolicy.KeepSet(np.array([0, 4, 8, 12, 16], np.int32), np.tile(np.arange(1, 5, dtype=np.int32), 4))
    with pytest.raises(ValueError, match="appears twice in the page table"):
        kvpolicy.compact_paged(kp, indptr, shared, last, ok)
    assert np.array_equal(kp, before)
