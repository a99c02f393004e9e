#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Cross-validation fixtures of the merging family: kvpress 0.5.5 MergingPress and CAMPress.

Writes tests/data/fixtures/merge_kvpress.json, read by tests/policy/merging/test_merge_fixtures.cpp. Never run by
CI (the JSON file is committed). Inputs are small, sampled here with numpy and stored in the file as float32
values (exact in JSON), so the C++ side needs no generator.

    python3 -m venv /work/.venv-kvpress
    /work/.venv-kvpress/bin/pip install torch==2.15.0 numpy==2.4.6 kvpress==0.5.5
    /work/.venv-kvpress/bin/python tests/reference/make_merge_fixtures.py      # ~10 s, deterministic

What each case records:
  * merging_press: `MergingPress(KnormPress(), similarity_threshold, merge_fraction).merge(keys, values, indices)`
    on a random kept set per kv head (indices handed in a random order, as a top-k would); `merged_values` are the
    returned values at the kept tokens, ascending token order per head.
  * cam_press: `CAMPress(KnormPress(), target_size, merge_budget).compress(...)` after `torch.manual_seed(seed)`,
    with `layer_step_counts[0] = new_tokens`, cumulative attentions per kv head and KnormPress scores
    (-|K|, recorded as `scores`); `kept` are kvpress's kept token ids (ascending), `merged_values` the returned
    (pruned) values. `draws` is the number of Bernoulli successes, recomputed here from an independent numpy
    mt19937 model of torch's CPU generator (the script asserts that the model's merged values equal kvpress's).
"""
from __future__ import annotations

import importlib.metadata as md
import json
import platform
import sys
import types
from pathlib import Path

import numpy as np
import torch

from kvpress import CAMPress, KnormPress, MergingPress

torch.set_num_threads(1)
OUT = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "merge_kvpress.json"


def f32list(a):
    return [float(x) for x in np.asarray(a, dtype=np.float32).ravel()]


def sample_kv(rs, H, T, d, dup_frac=0.3):
    keys = rs.standard_normal((H, T, d)).astype(np.float32)
    # Some near-duplicate keys so similarities span a wide range.
    for h in range(H):
        for j in range(T):
            if rs.rand() < dup_frac and j > 0:
                src = rs.randint(0, j)
                keys[h, j] = keys[h, src] + 0.3 * rs.standard_normal(d).astype(np.float32)
    values = rs.standard_normal((H, T, d)).astype(np.float32) * rs.uniform(0.2, 3.0, size=(H, T, 1)).astype(np.float32)
    # Inputs on a 1/256 grid: exact in float32 and short in JSON.
    return np.round(keys * 256) / np.float32(256), np.round(values * 256) / np.float32(256)


def merging_case(rs, H, T, d, n_kept, thr, frac):
    keys, values = sample_kv(rs, H, T, d)
    kept = np.stack([np.sort(rs.choice(T, n_kept, replace=False)) for _ in range(H)])
    order = np.stack([rs.permutation(kept[h]) for h in range(H)])  # top-k order
    press = MergingPress(press=KnormPress(), similarity_threshold=thr, merge_fraction=frac)
    k = torch.from_numpy(keys)[None]
    v = torch.from_numpy(values)[None]
    _, out = press.merge(k, v, torch.from_numpy(order.astype(np.int64))[None])
    out = out[0].numpy()
    merged = np.stack([out[h, kept[h]] for h in range(H)])
    changed = int(sum((merged[h] != values[h, kept[h]]).any(axis=-1).sum() for h in range(H)))
    return {
        "kind": "merging_press", "H": H, "T": T, "d": d, "similarity_threshold": thr, "merge_fraction": frac,
        "keys": f32list(keys), "values": f32list(values), "kept": kept.astype(int).tolist(),
        "merged_values": f32list(merged), "slots_changed": changed,
    }


def torch_uniforms(seed, n):
    rs = np.random.RandomState(seed)  # init_genrand(seed): the same mt19937 state as torch.manual_seed(seed)
    x = rs.randint(0, 2**32, size=n, dtype=np.uint64)
    return ((x & 0xFFFFFF).astype(np.float64) / 2**24).astype(np.float32)


def cam_model(values, attn, scores, target, k, M, seed):
    """Independent numpy model of CAMPress.compress (same spec as kvpress_cam.hpp)."""
    H, T, d = values.shape
    mean = scores.mean(axis=0, dtype=np.float32)
    order = sorted(range(T), key=lambda j: (-mean[j], -j))
    kept = np.sort(order[:target])
    evicted = np.sort(order[target:])
    if k < len(evicted):
        ev = sorted(evicted, key=lambda j: (-mean[j], -j))[:k]
        cand = np.sort(ev)
    else:
        cand = evicted
    u = torch_uniforms(seed, H * len(cand)).reshape(H, len(cand))
    v = values.astype(np.float32).copy()
    draws = 0
    for h in range(H):
        for ci, i in enumerate(cand):
            s = int(np.searchsorted(kept, i, side="right"))
            win = kept[s:s + M]
            a = len(win)
            mean_attn = np.float32(attn[h, win].sum(dtype=np.float32) / np.float32(max(a, 1)))
            with np.errstate(divide="ignore", invalid="ignore"):
                p = np.float32(attn[h, i]) / mean_attn
            p = 0.0 if np.isnan(p) else (1.0 if np.isinf(p) else float(np.clip(p, 0, 1)))
            if u[h, ci] < np.float32(p) and a > 0:
                draws += 1
                for t in win:
                    v[h, t] += values[h, i] * np.float32(np.float32(1.0) / np.float32(a))
    return kept, v[:, kept], draws


def cam_case(rs, H, T, d, target, k, M, seed):
    keys, values = sample_kv(rs, H, T, d, dup_frac=0.0)
    attn = rs.uniform(0.2, 1.8, size=(H, T)).astype(np.float32) * rs.uniform(0.5, 1.5, size=(1, T)).astype(np.float32)
    attn = (np.round(attn * 1024) / 1024).astype(np.float32)
    press = CAMPress(base_press=KnormPress(), target_size=target, merge_budget=M)
    press.layer_step_counts[0] = k
    module = types.SimpleNamespace(layer_idx=0, head_dim=d)
    kt = torch.from_numpy(keys)[None]
    vt = torch.from_numpy(values.copy())[None]
    scores = KnormPress().score(module, None, kt, vt, None, {})[0].numpy()
    press._running_attn_sum[0] = torch.from_numpy(attn)[None].clone()
    torch.manual_seed(seed)
    _, vout = press.compress(module, torch.zeros(1, 1, 8), kt, vt, torch.from_numpy(attn)[None], {})
    vout = vout[0].numpy()
    kept, merged, draws = cam_model(values, attn, scores, target, k, M, seed)
    assert np.array_equal(merged, vout), "numpy model of CAMPress disagrees with kvpress"
    return {
        "kind": "cam_press", "H": H, "T": T, "d": d, "target_size": target, "new_tokens": k, "merge_budget": M, "seed": seed,
        "values": f32list(values), "attention_sums": f32list(attn), "scores": f32list(scores),
        "kept": kept.astype(int).tolist(), "merged_values": f32list(vout), "draws": draws,
    }


def main():
    rs = np.random.RandomState(12)
    cases = []
    for (H, T, d, n_kept, thr, frac) in [
        (1, 6, 4, 3, 0.0, 1.0), (2, 16, 8, 5, 0.0, 1.0), (4, 40, 16, 12, 0.0, 1.0), (2, 64, 32, 16, 0.0, 1.0),
        (3, 33, 8, 10, 0.1, 1.0), (2, 50, 16, 20, 0.3, 1.0), (4, 48, 8, 8, 0.0, 0.75), (2, 41, 16, 13, 0.0, 0.5),
        (2, 30, 8, 6, 0.2, 0.75), (1, 100, 16, 25, 0.0, 0.3), (2, 12, 4, 11, 0.0, 1.0), (2, 9, 4, 1, 0.0, 0.75),
    ]:
        cases.append(merging_case(rs, H, T, d, n_kept, thr, frac))
    for (H, T, d, target, k, M, seed) in [
        (1, 12, 4, 6, 6, 4, 0), (2, 40, 8, 20, 20, 32, 1), (4, 64, 8, 32, 8, 32, 2), (2, 50, 16, 30, 5, 4, 3),
        (4, 100, 4, 60, 40, 8, 4), (2, 30, 4, 25, 5, 32, 5), (1, 80, 16, 16, 64, 2, 6), (8, 64, 8, 40, 24, 16, 7),
        (2, 20, 4, 19, 1, 32, 1234567),
    ]:
        cases.append(cam_case(rs, H, T, d, target, k, M, seed))
    doc = {
        "format": "kvp-merge-fixtures", "format_version": 1, "generated_by": "tests/reference/make_merge_fixtures.py",
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
                     "kvpress": md.version("kvpress"), "transformers": md.version("transformers")},
        "conventions": {
            "layout": "arrays are row-major: keys/values (H, T, d); attention_sums/scores (H, T); merged_values (H, n_kept, d)",
            "kept": "per kv head, ascending token ids",
            "tolerance": "merged values: float32 from kvpress; C++ agrees to 1e-6 of the row's max |value| (observed <= 5e-7: summation order); Bernoulli draws and kept sets exactly",
        },
        "cases": cases,
    }
    OUT.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(cases)} cases)", file=sys.stderr)


if __name__ == "__main__":
    main()
