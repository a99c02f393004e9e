# SPDX-License-Identifier: Apache-2.0
"""The bindings on numpy arrays only (always run)."""
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import kvpolicy
from kvpolicy import _core

RNG = np.random.default_rng(1234)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def test_version_matches_header():
    root = pathlib.Path(__file__).resolve().parents[2]
    text = (root / "include" / "kvpolicy" / "core" / "version.hpp").read_text()
    parts = [line.split()[2] for line in text.splitlines() if line.startswith("#define KVP_VERSION_")][:3]
    assert kvpolicy.__version__ == ".".join(parts)


def test_stub_shipped():
    pkg = pathlib.Path(kvpolicy.__file__).parent
    assert (pkg / "_core.pyi").is_file() and (pkg / "py.typed").is_file()
    stub = (pkg / "_core.pyi").read_text()
    for cls in ("EvictionPolicy", "Quantizer", "KiviCache", "QuestPolicy", "QuestState"):
        assert f"class {cls}" in stub
    assert "def compact_paged" in stub
    for name in ("QuestLookaheadPolicy", "SpeCachePolicy", "ShadowKVPolicy", "InfiniGenPolicy", "OffloadSim"):
        assert f"class {name}" in stub
    for fn in ("def score", "def quantized_paged_decode_attention", "def minicache_merge", "def cam_orig_merge"):
        assert fn in stub


def test_generated_classes_are_current():
    gen = pathlib.Path(__file__).resolve().parents[1] / "tools" / "gen_policies.py"
    committed = pathlib.Path(__file__).resolve().parents[1] / "kvpolicy" / "_policies.py"
    installed = pathlib.Path(kvpolicy.__file__).parent / "_policies.py"
    r = subprocess.run([sys.executable, str(gen), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert committed.read_text() == installed.read_text()


def test_policies_list_every_registry_entry():
    infos = kvpolicy.policies()
    names = [p.name for p in infos]
    assert names == [p["name"] for p in _core.registry()]
    for p in infos:
        assert p.family and p.paper and p.doc
        if p.family == "eviction":
            assert p.bound and p.cls is not None and p.cls.policy_name == p.name
    snap = next(p for p in infos if p.name == "snapkv")
    assert {"window", "kernel", "compression_ratio"} <= {a.name for a in snap.params}
    assert next(a for a in snap.params if a.name == "window").default == "64"


@pytest.mark.parametrize("name", ["streaming_llm", "snapkv", "observed_attention", "tova", "pyramidkv", "adakv",
                                  "expected_attention", "knorm"])
def test_every_one_shot_policy_by_name_and_class(name):
    Hq, Hkv, T, d = 8, 2, 300, 32
    window = 64 if name not in ("adakv",) else 32
    keys, values = rand(Hkv, T, d, dtype=np.float16), rand(Hkv, T, d, dtype=np.float16)
    q = rand(Hq, T if name == "expected_attention" else (1 if name == "tova" else window), d)
    col = None
    if name == "observed_attention":  # the engine's column sums of its softmax probabilities
        a = np.tril(np.abs(rand(Hq, T, T)))
        col = (a / a.sum(-1, keepdims=True)).sum(1).astype(np.float32)
    by_name = kvpolicy.make(name, compression_ratio=0.5)
    cls = kvpolicy.policies()[[p.name for p in kvpolicy.policies()].index(name)].cls
    by_class = cls(compression_ratio=0.5)
    assert by_name.spec == by_class.spec == f"{name}:compression_ratio=0.5"
    args = dict(keys=keys, values=values, column_sums=col, queries=None if name in ("streaming_llm", "observed_attention", "knorm") else q)
    k1, k2 = by_name.evict(**args), by_class.evict(**args)
    assert np.array_equal(k1.indptr, k2.indptr) and np.array_equal(k1.indices, k2.indices)
    assert k1.num_rows == Hkv and k1.counts().sum() > 0
    for r in range(k1.num_rows):
        row = k1.row(r)
        assert np.all(np.diff(row) > 0) and row[-1] < T


def test_snapkv_keeps_window_and_budget_and_matches_scalar():
    Hq, Hkv, T, d, w = 8, 2, 500, 64, 16
    keys, q = rand(Hkv, T, d), rand(Hq, w, d)
    p = kvpolicy.SnapKV(compression_ratio=0.5, window=w)
    keep = p.evict(queries=q, keys=keys)
    dense = keep.dense()
    assert dense.shape == (Hkv, p.kept_count(T)) == (Hkv, 250)
    assert np.all(dense[:, -w:] == np.arange(T - w, T))  # the window is protected
    ref = p.evict(queries=q, keys=keys, backend="scalar")
    assert np.array_equal(ref.indices, keep.indices)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_dtypes_agree(dtype):
    keys, q = rand(2, 400, 64), rand(4, 32, 64)
    p = kvpolicy.SnapKV(tokens=100, window=32)
    a = p.evict(queries=q, keys=keys.astype(dtype))
    b = p.evict(queries=q, keys=keys.astype(dtype).astype(np.float32))
    assert np.array_equal(a.indices, b.indices)  # fp16 keys are widened exactly in registers


def test_zero_copy_pointers_and_strides():
    # A padded, token-major cache: (capacity, kv_heads, head_dim) viewed as (kv_heads, len, head_dim) by strides.
    cap, Hkv, d, T = 700, 2, 32, 600
    pool = rand(cap, Hkv, d, dtype=np.float16)
    keys = pool[:T].transpose(1, 0, 2)
    assert not keys.flags.c_contiguous
    q = rand(4, 64, d)
    p = kvpolicy.SnapKV(compression_ratio=0.5)
    keep = p.evict(queries=q, keys=keys)
    seen = _core._last_view_pointers()
    assert seen["keys"] == keys.ctypes.data == pool.ctypes.data
    assert seen["queries"] == q.ctypes.data
    same = p.evict(queries=q, keys=np.ascontiguousarray(keys))
    assert np.array_equal(same.indices, keep.indices)
    assert _core._view_pointer(keys) == pool.ctypes.data


def test_batch_axis():
    B, Hkv, T, d = 3, 2, 256, 32
    keys, q = rand(B, Hkv, T, d), rand(B, 4, 64, d)
    p = kvpolicy.SnapKV(compression_ratio=0.25)
    keep = p.evict(queries=q, keys=keys)
    assert keep.num_rows == B * Hkv and keep.dense().shape == (B, Hkv, 192)
    for b in range(B):
        one = p.evict(queries=q[b], keys=keys[b]).dense()
        assert np.array_equal(one, keep.dense()[b])


def test_caller_provided_outputs_written_in_place():
    keys, q = rand(2, 300, 32), rand(4, 64, 32)
    p = kvpolicy.SnapKV(tokens=100)
    indptr, indices = np.zeros(3, np.int32), np.full(500, -1, np.int32)
    keep = p.evict(queries=q, keys=keys, out=(indptr, indices))
    assert keep.indptr is indptr and keep.indices is indices
    assert indptr[-1] == 200 and np.all(indices[200:] == -1)
    assert np.array_equal(indices[:200], p.evict(queries=q, keys=keys).indices)
    with pytest.raises(ValueError, match="indices has 10 entries, needs at least"):
        p.evict(queries=q, keys=keys, out=(indptr, np.zeros(10, np.int32)))


def test_adakv_ragged_rows_and_mask():
    keys, q = rand(4, 400, 32), rand(8, 32, 32)
    keep = kvpolicy.AdaKV(compression_ratio=0.5).evict(queries=q, keys=keys)
    assert keep.counts().sum() == 4 * 200
    m = keep.mask(400)
    assert m.shape == (4, 400) and m.sum() == 800
    if not keep.uniform:
        with pytest.raises(ValueError, match="different numbers"):
            keep.dense()


def test_compact_contiguous_in_place():
    Hkv, cap, d, T = 2, 64, 8, 50
    keys, values = rand(Hkv, cap, d), rand(Hkv, cap, d)
    k0, v0 = keys.copy(), values.copy()
    pos = np.tile(np.arange(cap, dtype=np.int32), (Hkv, 1))
    keep = kvpolicy.StreamingLLM(tokens=20, sinks=4).evict(keys=keys[:, :T])
    lens = kvpolicy.compact_contiguous(keys, T, keep, values=values, positions=pos)
    assert lens.tolist() == [20, 20]
    kept = keep.dense()
    for h in range(Hkv):
        assert np.array_equal(keys[h, :20], k0[h, kept[h]]) and np.array_equal(values[h, :20], v0[h, kept[h]])
        assert np.array_equal(pos[h, :20], kept[h])
    assert _core._last_view_pointers()["keys"] == keys.ctypes.data


def test_h2o_state_object():
    Hq, Hkv, T, d = 4, 2, 40, 16
    h2o = kvpolicy.H2O(hh_size=8, recent_size=8)
    st = h2o.new_state(Hq, Hkv, capacity=64)
    a = np.abs(rand(Hq, T, T))
    a = np.tril(a)
    a = (a / a.sum(-1, keepdims=True)).astype(np.float32)
    h2o.update(st, attention=a)
    assert st.length == T and st.scores.shape == (Hkv, 64)
    keep = h2o.evict(st)
    assert keep.dense().shape == (Hkv, 16) and st.length == 16
    assert np.all(keep.dense()[:, -8:] == np.arange(T - 8, T))
    assert kvpolicy.make("h2o", hh_size=8, recent_size=8).spec == h2o.spec


# ---- bad input -------------------------------------------------------------------------------------------------


def test_unknown_policy_and_parameter_raise_value_error_with_library_message():
    with pytest.raises(ValueError, match="no eviction policy named 'snapkvv'; known: streaming_llm, snapkv"):
        kvpolicy.make("snapkvv")
    with pytest.raises(ValueError, match="unknown parameter 'windw'; valid: window"):
        kvpolicy.make("snapkv", windw=3)
    with pytest.raises(ValueError, match="pooling kernel is 4, must be odd"):
        kvpolicy.SnapKV(kernel=4)
    with pytest.raises(TypeError):
        kvpolicy.SnapKV(window=[1])
    assert isinstance(kvpolicy.make("quest"), kvpolicy.Quest) and isinstance(kvpolicy.make("kivi"), kvpolicy.Quantizer)
    with pytest.raises(ValueError, match="unknown parameter 'tokn_budget'"):
        kvpolicy.make("quest", tokn_budget=64)


def test_bad_arrays():
    p = kvpolicy.SnapKV(compression_ratio=0.5)
    keys, q = rand(2, 300, 32), rand(4, 64, 32)
    with pytest.raises(TypeError, match="keys is None"):
        p.evict(queries=q, keys=None)
    with pytest.raises(TypeError, match="keys has dtype int64"):
        p.evict(queries=q, keys=np.zeros((2, 300, 32), np.int64))
    with pytest.raises(TypeError, match="keys has dtype float64"):
        p.evict(queries=q, keys=keys.astype(np.float64))
    with pytest.raises(ValueError, match="keys has rank 2, expected rank 3 or 4"):
        p.evict(queries=q, keys=keys[0])
    with pytest.raises(ValueError, match="keys has stride 2 on its last axis"):
        p.evict(queries=q, keys=rand(2, 300, 64)[:, :, ::2])
    with pytest.raises(ValueError, match="queries has rank 2"):
        p.evict(queries=q[0], keys=keys)
    with pytest.raises(TypeError, match="must be a numpy array or torch tensor"):
        p.evict(queries=q, keys="not an array")
    with pytest.raises(ValueError, match="snapkv: queries has 32 rows per head, expected window=64"):
        p.evict(queries=q[:, :32], keys=keys)
    with pytest.raises(ValueError, match="must be a positive multiple of num_kv_heads=2"):
        p.evict(queries=rand(3, 64, 32), keys=keys)
    with pytest.raises(ValueError, match="backend is 'gpu'"):
        p.evict(queries=q, keys=keys, backend="gpu")
    with pytest.raises(TypeError, match="values has dtype float16 but keys has float32"):
        kvpolicy.ExpectedAttention().evict(queries=rand(4, 300, 32), keys=keys, values=keys.astype(np.float16))
    with pytest.raises(TypeError, match="keys must be a writable numpy array"):
        ro = rand(2, 64, 8)
        ro.setflags(write=False)
        kvpolicy.compact_contiguous(ro, 10, kvpolicy.StreamingLLM(tokens=5, sinks=1).evict(keys=ro[:, :10]))


def test_threads():
    n = kvpolicy.get_num_threads()
    kvpolicy.set_num_threads(2)
    assert kvpolicy.get_num_threads() == 2
    keys, q = rand(4, 2000, 64), rand(8, 64, 64)
    a = kvpolicy.SnapKV().evict(queries=q, keys=keys)
    kvpolicy.set_num_threads(1)
    b = kvpolicy.SnapKV().evict(queries=q, keys=keys)
    assert np.array_equal(a.indices, b.indices)  # results never depend on the thread count
    kvpolicy.set_num_threads(n)
    with pytest.raises(ValueError):
        kvpolicy.set_num_threads(0)
