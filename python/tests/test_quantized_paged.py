# SPDX-License-Identifier: Apache-2.0
"""A paged cache of quantized code rows from Python: quantize-on-append at the tokens' slots (the codes equal the
quantizer's one-shot codes of the same rows), Quest metadata from the codes (equal to Quest.on_append on the decoded
pool), exact decode attention over the codes (equal to a numpy softmax over the decoded pool), NHD / HND, errors."""
import numpy as np
import pytest

import kvpolicy

RNG = np.random.default_rng(99)
P, NPAGES, HKV, D, HQ = 16, 12, 2, 64, 8
LENS = (40, 29)


def table():
    indptr = np.array([0, 3, 5], np.int32)
    indices = np.array([4, 0, 7, 2, 9], np.int32)
    last = np.array([40 - 32, 29 - 16], np.int32)
    return indptr, indices, last


def pool(q, layout):
    rb = q.row_bytes(D)
    shape = (NPAGES, P, HKV, rb) if layout == "NHD" else (NPAGES, HKV, P, rb)
    return np.zeros(shape, np.uint8)


def slots(indptr, indices, b):
    """(page, slot) of every token of sequence b."""
    pages = indices[indptr[b]:indptr[b + 1]]
    return [(int(pages[t // P]), t % P) for t in range(LENS[b])]


def token_codes(pages, layout, page, slot):
    return pages[page, slot] if layout == "NHD" else pages[page, :, slot]  # (HKV, rb)


def decoded_pool(q, pages, layout, indptr, indices):
    """{b: (HKV, len, D) float32} decoded from the pool's codes."""
    out = {}
    for b in range(2):
        codes = np.stack([token_codes(pages, layout, p, s) for p, s in slots(indptr, indices, b)], axis=1)  # (HKV, T, rb)
        out[b] = q.dequantize(np.ascontiguousarray(codes), head_dim=D)
    return out


@pytest.mark.parametrize("spec", ["ggml:type=q8_0", "ggml:type=q4_0", "fp8:scales=per_token_head", "int4"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_append_meta_and_attention(spec, layout):
    q = kvpolicy.Quantizer(spec)
    indptr, indices, last = table()
    kp, vp = pool(q, layout), pool(q, layout)
    keys = {b: RNG.standard_normal((HKV, LENS[b], D)).astype(np.float32) for b in range(2)}
    vals = {b: RNG.standard_normal((HKV, LENS[b], D)).astype(np.float32) for b in range(2)}
    for b in range(2):  # the prompt, all at once (rows are the last LENS[b] tokens)
        kvpolicy.quantize_paged_append(q, kp, indptr, indices, last, b, keys[b], layout=layout)
        kvpolicy.quantize_paged_append(spec, vp, indptr, indices, last, b, vals[b], layout=layout)
    # the codes at each token's slot are the quantizer's one-shot codes of that token's rows
    for b in range(2):
        want = q.quantize(keys[b])  # (HKV, T, rb)
        for t, (p, s) in enumerate(slots(indptr, indices, b)):
            assert np.array_equal(token_codes(kp, layout, p, s), want[:, t]), (b, t)
    dk, dv = decoded_pool(q, kp, layout, indptr, indices), decoded_pool(q, vp, layout, indptr, indices)

    # Quest metadata from the codes == Quest.on_append on the decoded pool (float32, same table)
    quest = kvpolicy.Quest()
    st = quest.new_state(NPAGES, HKV, D)
    kvpolicy.quantized_page_meta_append(q, st, kp, indptr, indices, last, D, layout=layout)
    fpool = np.zeros((NPAGES, P, HKV, D), np.float32)
    for b in range(2):
        for t, (p, s) in enumerate(slots(indptr, indices, b)):
            fpool[p, s] = dk[b][:, t]
    ref = quest.new_state(NPAGES, HKV, D)
    quest.on_append(ref, fpool, indptr, indices, last)
    assert np.array_equal(st.data, ref.data)

    # decode attention over the codes == numpy softmax over the decoded rows
    queries = RNG.standard_normal((2, HQ, D)).astype(np.float32)
    out, lse = kvpolicy.quantized_paged_decode_attention(q, q, kp, vp, indptr, indices, last, queries, layout=layout)
    assert out.shape == (2, HQ, D) and lse.shape == (2, HQ)
    G = HQ // HKV
    for b in range(2):
        for h in range(HQ):
            logits = (dk[b][h // G].astype(np.float64) @ queries[b, h]) / np.sqrt(D)
            m = logits.max()
            w = np.exp(logits - m)
            np.testing.assert_allclose(out[b, h], (w / w.sum()) @ dv[b][h // G], rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(lse[b, h], m + np.log(w.sum()), rtol=1e-5, atol=1e-5)
    mine = np.full((2, HQ, D), np.nan, np.float32)
    o2, _ = kvpolicy.quantized_paged_decode_attention(q, q, kp, vp, indptr, indices, last, queries, layout=layout, out=mine)
    assert o2 is mine and np.array_equal(mine, out)


def test_decode_append_one_token_and_errors():
    q = kvpolicy.Quantizer("ggml:type=q8_0")
    indptr, indices, last = table()
    kp = pool(q, "NHD")
    rows = RNG.standard_normal((HKV, 1, D)).astype(np.float16)
    kvpolicy.quantize_paged_append(q, kp, indptr, indices, last, 1, rows)  # token 28 of sequence 1: page 9, slot 12
    assert np.array_equal(kp[9, 12], q.quantize(rows)[:, 0])
    assert np.count_nonzero(kp) == np.count_nonzero(kp[9, 12])
    before = kp.copy()
    with pytest.raises(ValueError, match="quantize_paged_append"):
        kvpolicy.quantize_paged_append(q, kp, indptr, indices, last, 2, rows)  # no sequence 2
    with pytest.raises(ValueError, match="row"):
        kvpolicy.quantize_paged_append(q, np.zeros((NPAGES, P, HKV, 10), np.uint8), indptr, indices, last, 0, rows)
    with pytest.raises(TypeError, match="uint8"):
        kvpolicy.quantize_paged_append(q, kp.astype(np.int32), indptr, indices, last, 0, rows)
    with pytest.raises(ValueError, match="kivi"):
        kvpolicy.quantize_paged_append(kvpolicy.Quantizer("kivi:role=values,bits=2,group=32,residual=32"), kp, indptr, indices,
                                       last, 0, rows)
    with pytest.raises(ValueError, match="layout"):
        kvpolicy.quantize_paged_append(q, kp, indptr, indices, last, 0, rows, layout="XYZ")
    bad = rows.copy()
    bad[0, 0, 3] = np.nan
    with pytest.raises(ValueError):
        kvpolicy.quantize_paged_append(q, kp, indptr, indices, last, 0, bad)
    assert np.array_equal(kp, before)
    st = kvpolicy.Quest().new_state(NPAGES + 1, HKV, D)
    with pytest.raises(ValueError, match="meta has shape"):
        kvpolicy.quantized_page_meta_append(q, st, kp, indptr, indices, last, D)
    with pytest.raises(ValueError, match="multiple"):
        kvpolicy.quantized_paged_decode_attention(q, q, kp, kp, indptr, indices, last, np.zeros((2, 3, D), np.float32))
