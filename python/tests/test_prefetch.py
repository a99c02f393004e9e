# SPDX-License-Identifier: Apache-2.0
"""kvpolicy.prefetch from Python on hand-computed cases (the same as tests/policy/prefetch/test_prefetch_policies.cpp):
Quest lookahead's bound ranking and reuse, SpeCache's GQA-mean softmax over its q4_0 key copy, ShadowKV's landmarks,
outliers and local tail, InfiniGen's partial channels and logit threshold; the hit-rate counters of observe; the
offload simulator's timed replay; errors."""
import math

import numpy as np
import pytest

import kvpolicy
from kvpolicy import prefetch


def pool(num_pages, heads, page_size, d, pages, length, dtype=np.float32):
    """An NHD key pool and the table of one sequence of `length` tokens on `pages`; key(t) gives token t's (heads, d) row."""
    k = np.zeros((num_pages, page_size, heads, d), dtype)
    indptr = np.array([0, len(pages)], np.int32)
    indices = np.array(pages, np.int32)
    last = np.array([length - (len(pages) - 1) * page_size], np.int32)

    def key(t):
        return k[pages[t // page_size], t % page_size]
    return k, indptr, indices, last, key


def test_quest_lookahead_bound_ranking_reuse_and_counters():
    k, ip, ids, last, key = pool(4, 1, 2, 2, [3, 0, 2, 1], 8)
    for t, x in enumerate([1, 2, 5, 4, 3, 0, 9, 9]):
        key(t)[0, 0] = x
    quest = kvpolicy.Quest()
    qs = quest.new_state(4, 1, 2)
    quest.on_append(qs, k, ip, ids, last)
    pol = prefetch.QuestLookahead(page_budget=3, dense_layers=0)
    st = pol.new_state(qs)
    q = np.array([[[1.0, 0.0]]], np.float32)
    pages, prio = pol.predict(st, q, ip, ids, last, page_size=2, layer=5)
    assert pages.tolist() == [1, 2, 0] and prio[0] == 1.0  # bounds [2, 5, 3] over logical 0..2: top-2 + the last page
    c = pol.observe(st, np.array([0, 2], np.int32), np.array([3, 1], np.int32))
    assert (c["hits"], c["misses"], c["wasted"], c["needed"]) == (1, 1, 2, 2)
    assert st.step == 1 and st.counters["prediction_recall"] == 0.5
    pages, prio = pol.predict(st, q, ip, ids, last, page_size=2, layer=5)
    assert pages.tolist() == [1, 2, 0, 3] and prio[3] == 0.0  # page 3 (read by step 0) stays requested
    assert prefetch.QuestLookahead(page_budget=3, dense_layers=0, reuse_previous=False).predict(
        st, q, ip, ids, last, page_size=2, layer=5)[0].tolist() == [1, 2, 0]
    assert prefetch.QuestLookahead(page_budget=3, dense_layers=2).predict(st, q, ip, ids, last, page_size=2, layer=1)[0].tolist() == [1, 2, 0, 3]
    st.reset()
    assert st.step == 0 and st.counters["steps"] == 0
    with pytest.raises(ValueError, match="quest_lookahead: page_budget is 0"):
        prefetch.QuestLookahead(page_budget=0)
    with pytest.raises(ValueError, match="quest_lookahead"):
        pol.predict(st, np.zeros((2, 1, 2), np.float32), ip, ids, last, page_size=2)  # 2 sequences, the table has 1
    with pytest.raises(TypeError, match="float32"):
        pol.new_state(quest.new_state(4, 1, 2, "float16"))


def test_specache_q4_0_copy_and_gqa_mean_probabilities():
    k, ip, ids, last, key = pool(2, 1, 2, 32, [1, 0], 4)
    a = [0, 8, 4, 2]
    for t in range(4):
        key(t)[0, 0] = a[t]
    pol = prefetch.SpeCache(topk=2)
    st = pol.new_state(2, 2, 1, 32)
    assert st.codes.shape == (2, 1, 2, pol.row_bytes(32)) and pol.row_bytes(32) == 18
    pol.on_append(st, k, ip, ids, last)
    assert st.codes.any()
    q = np.zeros((1, 2, 32), np.float32)
    q[0, 0, 0], q[0, 1, 0] = 1.0, -1.0
    p0 = np.exp(np.array(a) / math.sqrt(32))
    p1 = np.exp(-np.array(a) / math.sqrt(32))
    mean = 0.5 * (p0 / p0.sum() + p1 / p1.sum())
    pages, prio = pol.predict(st, q, ip, ids, last, page_size=2)
    assert pages.tolist() == [1]
    assert prio[0] == pytest.approx(mean[0] + mean[1], rel=1e-5)
    pages, prio = prefetch.SpeCache(topk=3).predict(st, q, ip, ids, last, page_size=2)
    assert pages.tolist() == [1, 0] and prio[1] == pytest.approx(mean[3], rel=1e-5)
    bad = k.copy()
    bad[0, 0, 0, 3] = np.nan
    codes = st.codes.copy()
    with pytest.raises(ValueError, match="specache"):
        pol.on_append(st, bad, ip, ids, last)
    assert np.array_equal(st.codes, codes)
    with pytest.raises(ValueError, match="specache"):
        prefetch.SpeCache().new_state(2, 2, 1, 20)  # head_dim not a multiple of 32
    with pytest.raises(ValueError, match="type"):
        prefetch.SpeCache(type="q3_k")


def test_shadowkv_landmarks_outlier_local_tail_and_reuse():
    k, ip, ids, last, key = pool(4, 1, 4, 2, [2, 3, 0, 1], 16)
    x = [1, 5, 2, 0, 0.5, 1.5, 0, 0]
    for c in range(8):
        for j in range(2):
            key(2 * c + j)[0, 0] = x[c]
    key(6)[0, 0] = 1
    key(7)[0, 1] = 1  # chunk 3 = {(1, 0), (0, 1)}: landmark (0.5, 0.5), min cosine 0.7071
    pol = prefetch.ShadowKV(chunk_size=2, chunk_budget=1, outlier_chunks=1, local_chunks=1)
    st = pol.new_state(4, 4, 1, 2)
    pol.on_append(st, k.astype(np.float16), ip, ids, last)  # any float dtype, read in place
    assert st.landmarks.shape == (4, 2, 1, 2) and st.outlier.shape == (4, 2, 1)
    assert st.landmarks[3, 1, 0].tolist() == [0.5, 0.5]
    assert st.outlier[3, 1, 0] == pytest.approx(math.sqrt(0.5), rel=1e-3)
    q = np.array([[[1.0, 0.0]]], np.float32)
    pages, prio = pol.predict(st, q, ip, ids, last, page_size=4)
    assert pages.tolist() == [1, 3, 2] and np.isinf(prio[0])
    s = sum(math.exp(x[c] / math.sqrt(2)) for c in (0, 1, 2, 4, 5, 6))
    assert prio[2] == pytest.approx(math.exp(5 / math.sqrt(2)) / s, rel=1e-5)
    pol.observe(st, np.array([0, 2], np.int32), np.array([0, 1], np.int32))
    pages, prio = pol.predict(st, q, ip, ids, last, page_size=4)
    assert pages.tolist() == [1, 3, 2, 0] and prio[3] == -1.0
    with pytest.raises(ValueError, match="not a multiple of chunk_size"):
        prefetch.ShadowKV(chunk_size=3).new_state(4, 4, 1, 2)
    with pytest.raises(ValueError, match="out of the pool"):
        pol.observe(st, np.array([0, 1], np.int32), np.array([9], np.int32))


def test_infinigen_partial_channels_threshold_and_dense_layers():
    k, ip, ids, last, key = pool(3, 1, 2, 4, [2, 0, 1], 6)
    for t, v in enumerate([0, 8, 2, 7, 1, 10]):
        key(t)[0] = [v / 2, 100.0, v / 2, 100.0]
    pol = prefetch.InfiniGen(skew=False, partial_ratio=0.5, alpha=1.5, dense_layers=2)
    st = pol.new_state(3, 2, 1, 4)
    assert not st.prepared
    with pytest.raises(ValueError, match="infinigen"):
        pol.predict(st, np.ones((1, 1, 4), np.float32), ip, ids, last, page_size=2, layer=2)  # before prepare
    prompt = np.array([[[3, 0.1, 2, 0], [-3, 0, 1, 0.1]]], np.float32)  # (Hq=1, W=2, d=4)
    pol.prepare(st, prompt, k, ip, ids, last)
    assert st.prepared and st.channels.tolist() == [[0, 2]]
    assert st.partial_keys[1, 0, 1, 0] == 5.0  # token 5: page 1, slot 1
    q = np.array([[[1, 5, 1, 5]]], np.float32)
    pages, prio = pol.predict(st, q, ip, ids, last, page_size=2, layer=2)
    assert pages.tolist() == [1, 2] and prio.tolist() == [5.0, 4.0]
    assert prefetch.InfiniGen(skew=False, partial_ratio=0.5, alpha=1.5, max_num_kv=1).predict(
        st, q, ip, ids, last, page_size=2, layer=2)[0].tolist() == [1]
    assert pol.predict(st, q, ip, ids, last, page_size=2, layer=1)[0].tolist() == [1, 0, 2]
    key(5)[0, 0] = key(5)[0, 2] = 0
    pol.on_append(st, k, ip, ids, last, append_len=np.array([1], np.int32))
    assert st.partial_keys[1, 0, 1, 0] == 0.0


def test_offload_sim_by_hand():
    # 1000-byte pages over 1 GB/s: 1 us per page, 2 us per batch, 3 device pages.
    sim = prefetch.OffloadSim(bandwidth_gb_s=1.0, latency_us=2.0, page_bytes=1000.0, device_pages=3, num_layers=1, pool_pages=10)
    a = sim.step(0, np.array([1, 2, 3, 4], np.int32), np.array([1, 2, 5], np.int32), 3.5)
    assert (a["needed"], a["requested_needed"], a["prefetched"], a["arrived_hits"], a["late"], a["demand"], a["wasted"]) == \
        (3, 2, 3, 1, 1, 1, 1)
    assert a["stall_us"] == pytest.approx(4.5) and a["bytes"] == pytest.approx(4000.0)
    assert sim.resident(0) == 3
    b = sim.step(0, np.array([5, 6], np.int32), np.array([5, 6], np.int32), 10.0)
    assert (b["resident_hits"], b["arrived_hits"], b["demand"], b["stall_us"]) == (1, 1, 0, 0.0)
    t = sim.totals
    assert t["steps"] == 2 and t["needed"] == 5 and t["prediction_recall"] == pytest.approx(4 / 5)
    lazy = prefetch.OffloadSim(bandwidth_gb_s=1.0, latency_us=2.0, page_bytes=1000.0, device_pages=3, num_layers=1,
                               pool_pages=10, mode="fetch_on_miss")
    assert lazy.step(0, None, np.array([1, 2], np.int32))["demand"] == 2
    with pytest.raises(ValueError, match="device_pages is 0"):
        prefetch.OffloadSim(page_bytes=1.0, device_pages=0, num_layers=1, pool_pages=4)
    with pytest.raises(ValueError, match="needed lists page 1 twice"):
        sim.step(0, None, np.array([1, 1], np.int32))
    with pytest.raises(ValueError, match="mode is 'x'"):
        prefetch.OffloadSim(page_bytes=1.0, device_pages=1, num_layers=1, pool_pages=4, mode="x")


def test_predict_from_quest_selection_end_to_end():
    """A decode loop: Quest selects the pages a step reads, Quest lookahead predicts them one step ahead; the
    prediction of step t for step t + 1 with B_L = B names every page Quest then reads when the query is unchanged."""
    rng = np.random.default_rng(3)
    k = rng.standard_normal((20, 16, 2, 32)).astype(np.float32)
    ip = np.array([0, 10, 20], np.int32)
    ids = rng.permutation(20).astype(np.int32)
    last = np.array([16, 9], np.int32)
    quest = kvpolicy.Quest(page_budget=4, dense_layers=0)
    qs = quest.new_state(20, 2, 32)
    quest.on_append(qs, k, ip, ids, last)
    pol = prefetch.QuestLookahead(page_budget=4, dense_layers=0)
    st = pol.new_state(qs)
    q = rng.standard_normal((2, 8, 32)).astype(np.float32)
    for step in range(3):
        sel = quest.select(qs, q, ip, ids, last, page_size=16, layer=3)
        c = pol.observe(st, sel.indptr, sel.indices)
        if step > 0:
            assert c["misses"] == 0 and c["hits"] == c["needed"]
        pol.predict(st, q, ip, ids, last, page_size=16, layer=3)
    assert st.counters["prediction_recall"] == 1.0 and st.counters["buffer_hit_rate"] == 1.0
