#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Generate the cross-validation fixtures in tests/data/fixtures/ (see tests/reference/README.md).

Two kinds of references:
  * kvpress presses (pip package, pinned in README.md), called on stub modules with float32 tensors
    (spec algorithms-eviction.md §10 recipe); each case also carries an independent float64 re-implementation
    ("mirror") of the same formula, and the kept sets of both must agree;
  * the original papers' algorithms, implemented here from the spec's pseudo-code in float64 (SnapKV original
    and KVCache-Factory kv_head mode, Ada-KV original, PyramidKV Factory schedule, H2O real-drop online,
    TOVA online).

Inputs come from fixture_rng (bit-identical to fixture_rng.hpp), so the files hold only parameters, sampled
scores and kept sets. Seeds are bumped (seed += 1) until every selection boundary of a case has a relative gap of
at least GAP_MIN, so the kept sets are unique and robust to float32 rounding.

Usage:  python make_fixtures.py [--only snapkv_kvpress,tova_original,...] [--out DIR]
kvpress/torch are imported only for the kvpress policies and the score arithmetic.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import math
import platform
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fixture_rng as R  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "data" / "fixtures"
FORMAT_VERSION = 1
GAP_MIN = 1e-5  # minimum relative gap at any selection boundary (fp64 mirror / reference scores)
MAX_SEED_TRIES = 200
EDGE = 8  # always sample the first/last EDGE tokens
FLT_MAX = float(np.finfo(np.float32).max)

torch.set_num_threads(1)  # deterministic float32 reductions, and robust on a loaded machine


class NearTie(Exception):
    """A selection boundary is (nearly) tied; the case is regenerated with the next seed."""


# ---------------------------------------------------------------------------------------------------------------
# inputs

class Inputs:
    def __init__(self, seed, hq, hkv, T, d):
        self.seed, self.hq, self.hkv, self.T, self.d = seed, hq, hkv, T, d
        self.G = hq // hkv
        self.q = R.gen_queries(seed, hq, hkv, T, d)
        self.k = R.gen_keys(seed, hkv, T, d)
        self.v = R.gen_values(seed, hkv, T, d)

    def describe(self, query_role):
        return {
            "recipe": R.RECIPE,
            "queries": dict(role=query_role, shape=[self.hq, self.T, self.d], **R.tensor_check(self.q)),
            "keys": dict(role="post_rope_keys", shape=[self.hkv, self.T, self.d], **R.tensor_check(self.k)),
            "values": dict(role="values", shape=[self.hkv, self.T, self.d], **R.tensor_check(self.v)),
        }


def case_header(cid, inp: Inputs, params, query_role="post_rope_queries"):
    return {
        "id": cid,
        "seed": inp.seed,
        "num_q_heads": inp.hq,
        "num_kv_heads": inp.hkv,
        "seq_len": inp.T,
        "head_dim": inp.d,
        "params": params,
        "inputs": inp.describe(query_role),
    }


def with_seed_retry(base_seed, build):
    last = None
    for i in range(MAX_SEED_TRIES):
        try:
            return build(base_seed + i), i
        except NearTie as e:  # noqa: PERF203
            last = e
    raise RuntimeError(f"no tie-free seed found from {base_seed}: {last}")


# ---------------------------------------------------------------------------------------------------------------
# selection helpers

def topk_set(scores, k, allow_ties=False, what="", check_gap=True):
    """Top-k under (higher score first, then lower index). Returns (sorted kept, ties or None, relative gap).

    ties = {"tied": all indices whose score equals the boundary value, "n_tied_kept": how many of them are kept}
    when equal values straddle the boundary (max-pooling plateaus); otherwise the kept set is unique."""
    s = np.asarray(scores, dtype=np.float64)
    n = s.size
    if k >= n:
        return np.arange(n), None, math.inf
    if k <= 0:
        return np.zeros(0, dtype=np.int64), None, math.inf
    order = np.lexsort((np.arange(n), -s))
    vb = s[order[k - 1]]
    n_gt = int(np.sum(s > vb))
    n_ge = int(np.sum(s >= vb))
    scale = max(abs(vb), 1e-300)
    below = s[s < vb]
    gap = (vb - below.max()) / scale if below.size else math.inf
    ties = None
    if n_ge > k:
        if not allow_ties:
            raise NearTie(f"{what}: exact tie at the boundary")
        ties = {"tied": np.flatnonzero(s == vb), "n_tied_kept": k - n_gt}
        above = s[s > vb]
        if above.size:
            gap = min(gap, (above.min() - vb) / scale)
    if check_gap and gap < GAP_MIN:
        raise NearTie(f"{what}: relative gap {gap:.3g}")
    return np.sort(order[:k]), ties, gap


def encode_set(idx, universe):
    """Ascending index list for universe <= 256, else a hex bitmap (char i = tokens 4i..4i+3, bit b = token 4i+b)."""
    idx = np.sort(np.asarray(idx, dtype=np.int64))
    if universe <= 256:
        return {"count": int(idx.size), "idx": [int(x) for x in idx]}
    nib = np.zeros((universe + 3) // 4, dtype=np.int64)
    np.add.at(nib, idx // 4, 1 << (idx % 4))
    return {"count": int(idx.size), "bitmap": "".join("0123456789abcdef"[x] for x in nib)}


def sample_positions(seed, head, lo, hi, n_random):
    """Deterministic sample of positions in [lo, hi): all of the first/last EDGE plus n_random hashed ones."""
    if hi - lo <= 2 * EDGE + n_random:
        return np.arange(lo, hi)
    pts = set(range(lo, lo + EDGE)) | set(range(hi - EDGE, hi))
    idx = np.arange(n_random, dtype=np.uint64) + np.uint64(head * 4096)
    h = R.hash_np(seed, R.STREAM_SAMPLE, idx)
    pts |= set(int(x) + lo for x in (h % np.uint64(hi - lo)).astype(np.int64))
    return np.array(sorted(pts), dtype=np.int64)


def n_random_for(heads):
    return 64 if heads <= 8 else 16


def score_block(seed, ref, mirror=None, lo=0, hi=None, protected=None, pad_value=None, pad_value_fp64=None):
    """ref/mirror: [H, n] arrays indexed by token (columns lo..hi-1 are sampled)."""
    ref = np.asarray(ref, dtype=np.float64)
    H = ref.shape[0]
    hi = ref.shape[1] if hi is None else hi
    toks, vals, vals64 = [], [], []
    for h in range(H):
        p = sample_positions(seed, h, lo, hi, n_random_for(H))
        toks.append([int(x) for x in p])
        vals.append([float(x) for x in ref[h, p]])
        if mirror is not None:
            vals64.append([float(x) for x in np.asarray(mirror, dtype=np.float64)[h, p]])
    out = {"tokens": toks, "value": vals}
    if mirror is not None:
        out["value_fp64"] = vals64
    out["protected"] = protected
    out["pad_value"] = pad_value
    if pad_value_fp64 is not None:
        out["pad_value_fp64"] = pad_value_fp64
    return out


def encode_ties(ties, universe):
    if ties is None:
        return None
    return {"tied": encode_set(ties["tied"], universe), "n_tied_kept": int(ties["n_tied_kept"])}


# ---------------------------------------------------------------------------------------------------------------
# float64 building blocks (the spec's formulas)

def t64(x):
    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.float64)


def window_attention64(inp: Inputs, w, T=None):
    """A[h, i, j] = softmax_j(<q[h, T-w+i], k[h/G, j]> / sqrt(d)), j <= T-w+i; shape [Hq, w, T] float64."""
    T = inp.T if T is None else T
    q = t64(inp.q[:, T - w:T])
    k = t64(inp.k[:, :T]).repeat_interleave(inp.G, dim=0)
    logits = q @ k.transpose(1, 2) / math.sqrt(inp.d)
    i = torch.arange(w)[:, None]
    j = torch.arange(T)[None, :]
    logits = logits.masked_fill(j > (T - w) + i, float("-inf"))
    return torch.softmax(logits, dim=-1)


def causal_attention_rows64(inp: Inputs, r0, r1, T):
    """Rows r0..r1-1 of the causal attention over keys 0..T-1: [Hq, r1-r0, T] float64."""
    q = t64(inp.q[:, r0:r1])
    k = t64(inp.k[:, :T]).repeat_interleave(inp.G, dim=0)
    logits = q @ k.transpose(1, 2) / math.sqrt(inp.d)
    i = torch.arange(r0, r1)[:, None]
    j = torch.arange(T)[None, :]
    logits = logits.masked_fill(j > i, float("-inf"))
    return torch.softmax(logits, dim=-1)


def causal_colsum64(inp: Inputs, T, chunk=256):
    """sum_i A[h, i, j] over all causal query rows i < T: [Hq, T] float64."""
    out = torch.zeros(inp.hq, T, dtype=torch.float64)
    for r0 in range(0, T, chunk):
        out += causal_attention_rows64(inp, r0, min(T, r0 + chunk), T).sum(1)
    return out


def pool64(s, K, mode):
    """Pool along the last axis of s [H, L]: avg (zero padding counted, divisor K) or max (padding never wins)."""
    if K == 1 or mode == "none":
        return s.clone()
    if mode == "avg":
        return F.avg_pool1d(s[:, None], K, stride=1, padding=K // 2, count_include_pad=True)[:, 0]
    if mode == "max":
        return F.max_pool1d(s[:, None], K, stride=1, padding=K // 2)[:, 0]
    raise ValueError(mode)


def group_reduce64(s, G, how):
    H, L = s.shape
    x = s.view(H // G, G, L)
    return {"mean": x.mean(1), "max": x.max(1).values, "sum": x.sum(1)}[how]


def rope_tables64(positions, d, base=10000.0):
    inv = torch.tensor([base ** (-2.0 * i / d) for i in range(d // 2)], dtype=torch.float64)
    ang = torch.as_tensor(positions, dtype=torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


# ---------------------------------------------------------------------------------------------------------------
# kvpress plumbing (§10 recipe: stub module, identity q_proj, tensors as given)

class RotaryStub:
    """module.rotary_emb: standard RoPE (base 10000, half-split), angles and cos/sin in float64, cast to x.dtype."""

    def __init__(self, d):
        self.d = d

    def __call__(self, x, position_ids):
        c, s = rope_tables64(position_ids[0], self.d)
        return c[None].to(x.dtype), s[None].to(x.dtype)


def kv_module(inp: Inputs, num_layers=32, layer=0):
    cfg = types.SimpleNamespace(num_attention_heads=inp.hq, num_key_value_heads=inp.hkv,
                                num_hidden_layers=num_layers, _attn_implementation="sdpa")
    return types.SimpleNamespace(layer_idx=layer, head_dim=inp.d, config=cfg, q_proj=torch.nn.Identity(),
                                 rotary_emb=RotaryStub(inp.d), masked_key_indices=None)


def kv_tensors(inp: Inputs):
    T, d = inp.T, inp.d
    hidden = torch.from_numpy(inp.q).permute(1, 0, 2).reshape(1, T, inp.hq * d).contiguous()
    keys = torch.from_numpy(inp.k)[None].contiguous()
    values = torch.from_numpy(inp.v)[None].contiguous()
    # identity RoPE: the recompute path sees the queries exactly as generated (they are post-RoPE already)
    kwargs = {"position_embeddings": (torch.ones(1, T, d), torch.zeros(1, T, d))}
    return hidden, keys, values, kwargs


def kept_from_gather(inp: Inputs, out_keys):
    """Recover kvpress's kept indices by matching gathered key rows to the (distinct) input rows."""
    kept = []
    for g in range(inp.hkv):
        lut = {inp.k[g, t].tobytes(): t for t in range(inp.T)}
        assert len(lut) == inp.T, "key rows must be distinct"
        kept.append(np.sort(np.array([lut[r.tobytes()] for r in out_keys[0, g].numpy()], dtype=np.int64)))
    return kept


def kvpress_n_kept(T, r):
    from kvpress.utils import compute_n_kept
    return compute_n_kept(T, r)


def check_kept_equal(kv_kept, mirror_kept, what):
    for g, (a, b) in enumerate(zip(kv_kept, mirror_kept)):
        if not np.array_equal(np.sort(a), np.sort(b)):
            raise NearTie(f"{what}: kvpress and fp64 mirror disagree on kv head {g}")


def max_diffs(ref, mirror, mask=None):
    a = np.asarray(ref, dtype=np.float64)
    b = np.asarray(mirror, dtype=np.float64)
    if mask is not None:
        a, b = a[mask], b[mask]
    if a.size == 0:
        return 0.0, 0.0
    diff = np.abs(a - b)
    return float(diff.max()), float(diff.max() / max(np.abs(b).max(), 1e-300))


# ---------------------------------------------------------------------------------------------------------------
# fp64 mirrors of the kvpress scorers (§3.3, §8.2, §6.5, §7.2, §9)

def mirror_snapkv_kvpress(inp, w, K):
    L = inp.T - w
    A = window_attention64(inp, w)[:, :, :L]
    s = pool64(A.mean(1), K, "avg")
    s = group_reduce64(s, inp.G, "mean")
    pad = float(s.max()) + 1 if s.numel() else 1.0
    return torch.cat([s, torch.full((inp.hkv, w), pad, dtype=torch.float64)], 1).numpy(), pad


def mirror_tova_kvpress(inp):
    A = window_attention64(inp, 1)[:, 0, : inp.T - 1]  # [Hq, T-1]
    s = A.mean(0, keepdim=True).repeat(inp.hkv, 1)
    pad = float(s.max()) + 1 if s.numel() else 1.0
    return torch.cat([s, torch.full((inp.hkv, 1), pad, dtype=torch.float64)], 1).numpy(), pad


def mirror_observed_kvpress(inp):
    T = inp.T
    s = causal_colsum64(inp, T) / torch.arange(T, 0, -1, dtype=torch.float64)[None]
    return group_reduce64(s, inp.G, "mean").numpy()


def mirror_streaming_kvpress(T, hkv, n_sink, r):
    s = np.ones((hkv, T))
    n_pruned = T - int(T * (1 - r))
    s[:, n_sink:n_sink + n_pruned] = 0
    return s


def mirror_ea_kvpress(inp, n_sink, n_future, use_cov, use_vnorm, eps):
    T, d, G = inp.T, inp.d, inp.G
    Q = t64(inp.q[:, n_sink:])  # pre-RoPE queries [Hq, N, d]
    N = Q.shape[1]
    mu = Q.mean(1)
    C = Q - mu[:, None]
    cov = C.transpose(1, 2) @ C / N
    cos, sin = rope_tables64(np.arange(T, T + n_future), d)
    h = d // 2
    Rm = torch.zeros(n_future, d, d, dtype=torch.float64)
    idx = torch.arange(d)
    Rm[:, idx, idx] = cos
    Rm[:, torch.arange(h), torch.arange(h) + h] = -sin[:, h:]  # (R x)_i = cos_i x_i - sin_i x_{i+h}
    Rm[:, torch.arange(h) + h, torch.arange(h)] = sin[:, :h]  # (R x)_{i+h} = sin_i x_i + cos_i x_{i+h}
    Rb = Rm.mean(0)
    mu = mu @ Rb.T
    cov = Rb @ cov @ Rb.T
    Ks = t64(inp.k[:, n_sink:]).repeat_interleave(G, dim=0)
    z = (Ks @ mu[:, :, None])[:, :, 0] / math.sqrt(d)
    if use_cov:
        z = z + torch.einsum("hnd,hde,hne->hn", Ks, cov, Ks) / d / 2
    a = torch.softmax(z, dim=-1)
    s = a.view(inp.hkv, G, N).mean(1)
    if use_vnorm:
        s = (s + eps) * t64(inp.v[:, n_sink:]).norm(dim=-1)
    pad = float(s.max()) + 1
    return torch.cat([torch.full((inp.hkv, n_sink), pad, dtype=torch.float64), s], 1).numpy(), pad


def mirror_adakv_kvpress(S, T, r, alpha, pad, what):
    """§5.3 with kvpress 0.5.5's clamps. Returns kept per head (ragged) and the gaps."""
    hkv = S.shape[0]
    n_kept = max(1, int(T * (1 - r)))
    n_safe = int(n_kept * alpha)
    if alpha > 0:
        n_safe = max(1, n_safe) if n_kept > 0 else 0
    S2 = S.copy()
    gaps = []
    for g in range(hkv):
        order_safe = topk_set(S[g], n_safe, allow_ties=True, check_gap=False)
        kept_g, ties, gap = order_safe
        vb = S[g][np.lexsort((np.arange(T), -S[g]))[n_safe - 1]] if 0 < n_safe < T else None
        if vb is not None and pad is not None and vb == pad:
            pass  # the safeguard only hits protected tokens, which outrank every real score anyway
        elif ties is not None or gap < GAP_MIN:
            raise NearTie(f"{what}: safeguard boundary of head {g}")
        else:
            gaps.append(gap)
        S2[g, kept_g] = FLT_MAX
    keep_total = hkv * n_kept
    kept_flat, _, gap = topk_set(S2.reshape(-1), keep_total, allow_ties=False, what=what + " global")
    gaps.append(gap)
    kept = [kept_flat[kept_flat // T == g] % T for g in range(hkv)]
    return kept, n_kept, n_safe, min(gaps)


# ---------------------------------------------------------------------------------------------------------------
# the original algorithms (float64)

def snapkv_original_scores(inp, w, K, pooling, granularity, agg, T=None):
    """Pooled SUM-over-window scores of the past tokens: [Hq or Hkv, T-w]."""
    T = inp.T if T is None else T
    L = T - w
    s = window_attention64(inp, w, T)[:, :, :L].sum(1)
    if granularity == "kv_head":
        s = group_reduce64(s, inp.G, agg)
    return pool64(s, K, pooling).numpy()


def select_past_plus_window(P, T, w, n_past, what):
    kept, ties, gaps = [], [], []
    for h in range(P.shape[0]):
        k, t, gap = topk_set(P[h], n_past, allow_ties=True, what=f"{what} head {h}")
        kept.append(np.concatenate([k, np.arange(T - w, T)]))
        ties.append(t)
        gaps.append(gap)
    return kept, ties, min(gaps) if gaps else math.inf


def pyramid_factory_capacity(T, C, w, beta, NL, layer):
    """KVCache-Factory PyramidKVCluster (§4.1). Returns (regime, total kept incl. the window)."""
    if T < C:
        return "none", T
    if T < 2 * (C - w):
        return "uniform", C
    min_num = (C - w) // beta
    max_num = 2 * (C - w) - min_num
    if max_num >= T - w:
        max_num = T - w
        min_num = 2 * (C - w) - max_num
    steps = (max_num - min_num) // (NL - 1)
    return "pyramid", max_num - layer * steps + w


def adakv_original_scores(inp, w, K, pooling, gqa_support, gqa_func):
    L = inp.T - w
    s = window_attention64(inp, w)[:, :, :L].mean(1)
    if gqa_support:
        s = group_reduce64(s, inp.G, gqa_func)
    return pool64(s, K, pooling).numpy()


def adakv_original_allocate(S, B, alpha, layer_idx, skip, what):
    """Per-head capacities of AdaptiveSnapKVCluster (§5.1): counts in the global top H*B, blended with the floor in
    float32 (int64 tensor * python float -> float32, as torch does), rounded half-to-even."""
    H, L = S.shape
    floor_capacity = int(B * alpha)
    if layer_idx < skip:
        return np.full(H, B, dtype=np.int64), None, floor_capacity, math.inf
    top, _, gap = topk_set(S.reshape(-1), H * B, allow_ties=False, what=what + " global top H*B")
    count = np.bincount(top // L, minlength=H)
    cap = torch.round(torch.tensor(count, dtype=torch.int64) * (1 - alpha) + floor_capacity).int()
    return cap.numpy().astype(np.int64), count, floor_capacity, gap


def h2o_online(inp, T0, steps, hh, recent, record, what):
    """H2O real-drop (§6.1) with per-kv-head state; G > 1 sums the group's attention (spec §6.6 option (a))."""
    G, hkv, d = inp.G, inp.hkv, inp.d
    budget = hh + recent
    col = causal_colsum64(inp, T0).numpy()  # [Hq, T0]
    acc = [col[g * G:(g + 1) * G].sum(0) for g in range(hkv)]
    cache = [np.arange(T0) for _ in range(hkv)]
    gaps = []
    out = []

    def evict(g, tag):
        n = cache[g].size
        if n <= budget:
            return
        cand = n - recent
        k, _, gap = topk_set(acc[g][:cand], hh, allow_ties=False, what=f"{what} {tag} head {g}")
        gaps.append(gap)
        keep = np.concatenate([k, np.arange(cand, n)])
        cache[g], acc[g] = cache[g][keep], acc[g][keep]

    def snapshot(step):
        n_seen = T0 + step
        rec = {"step": step, "n_seen": n_seen, "kept": [encode_set(cache[g], n_seen) for g in range(hkv)]}
        toks, vals = [], []
        for g in range(hkv):
            sel = sample_positions(inp.seed, g, 0, cache[g].size, 8)
            toks.append([int(x) for x in cache[g][sel]])
            vals.append([float(x) for x in acc[g][sel]])
        rec["scores"] = {"tokens": toks, "value": vals}
        out.append(rec)

    for g in range(hkv):
        evict(g, "prefill")
    if 0 in record:
        snapshot(0)
    q = inp.q
    for s in range(1, steps + 1):
        p = T0 + s - 1
        for g in range(hkv):
            cache[g] = np.append(cache[g], p)
            acc[g] = np.append(acc[g], 0.0)
            keys = t64(inp.k[g, cache[g]])
            qs = t64(q[g * G:(g + 1) * G, p])
            a = torch.softmax(qs @ keys.T / math.sqrt(d), dim=-1).sum(0).numpy()
            acc[g] = acc[g] + a
            evict(g, f"step {s}")
        if s in record:
            snapshot(s)
    return out, min(gaps) if gaps else math.inf


def tova_online(inp, T0, steps, cache_size, record, what):
    """TOVA (§8.1): newest query's attention averaged over all Hq heads; one selection for every head."""
    G, d = inp.G, inp.d
    cache = np.arange(T0)
    gaps, out = [], []

    def reduce(s, tag, n_seen, step):
        nonlocal cache
        rec = None
        if step in record:
            sel = sample_positions(inp.seed, 0, 0, cache.size, 64)
            rec = {"step": step, "n_seen": n_seen,
                   "scores": {"tokens": [[int(x) for x in cache[sel]]], "value": [[float(x) for x in s[sel]]]}}
        if cache.size > cache_size:
            k, _, gap = topk_set(s, cache_size, allow_ties=False, what=f"{what} {tag}")
            gaps.append(gap)
            cache = cache[k]
        if rec is not None:
            rec["kept"] = [encode_set(cache, n_seen)]
            out.append(rec)

    A = window_attention64(inp, 1, T0)[:, 0]  # last prompt row [Hq, T0]
    reduce(A.mean(0).numpy(), "prefill", T0, 0)
    for s in range(1, steps + 1):
        p = T0 + s - 1
        cache = np.append(cache, p)
        rows = []
        for h in range(inp.hq):
            keys = t64(inp.k[h // G, cache])
            rows.append(torch.softmax(keys @ t64(inp.q[h, p]) / math.sqrt(d), dim=-1))
        reduce(torch.stack(rows).mean(0).numpy(), f"step {s}", p + 1, s)
    return out, min(gaps) if gaps else math.inf


# ---------------------------------------------------------------------------------------------------------------
# case tables.  Shapes (Hq, Hkv, d) span GQA groups 1/2/4/8 and d in {64, 96, 128}.

SNAP_CASES = [  # Hq, Hkv, d, T, window, kernel, ratio
    (4, 4, 64, 7, 3, 3, 0.5), (8, 4, 64, 13, 4, 1, 0.3), (8, 2, 96, 16, 8, 5, 0.25), (16, 2, 128, 33, 2, 3, 0.8),
    (8, 1, 64, 64, 16, 5, 0.5), (4, 4, 64, 100, 8, 7, 0.9), (8, 4, 64, 100, 32, 5, 0.5),
    (32, 8, 128, 128, 64, 5, 0.1), (8, 2, 96, 257, 31, 9, 0.75), (16, 2, 128, 500, 64, 5, 0.8),
    (8, 4, 64, 1000, 64, 5, 0.8), (8, 1, 64, 1000, 32, 7, 0.9), (32, 8, 128, 1024, 64, 5, 0.5),
    (8, 2, 96, 2000, 128, 11, 0.6), (8, 1, 64, 4099, 64, 5, 0.5), (8, 4, 64, 4099, 16, 3, 0.9),
    (12, 6, 96, 750, 1, 1, 0.3), (2, 2, 128, 301, 5, 15, 0.4), (16, 2, 128, 3000, 64, 7, 0.7),
    (16, 16, 64, 90, 4, 3, 0.3), (16, 16, 64, 2048, 64, 5, 0.25), (4, 4, 64, 170, 8, 5, 0.3),
    (4, 1, 128, 9, 8, 1, 0.1),
]

TOVA_KV_CASES = [  # Hq, Hkv, d, T, ratio
    (4, 4, 64, 2, 0.5), (8, 4, 64, 7, 0.5), (8, 2, 96, 16, 0.25), (16, 2, 128, 33, 0.8), (8, 1, 64, 64, 0.5),
    (4, 4, 64, 100, 0.9), (8, 4, 64, 100, 0.5), (32, 8, 128, 128, 0.1), (8, 2, 96, 257, 0.75),
    (16, 2, 128, 500, 0.8), (8, 4, 64, 1000, 0.8), (8, 1, 64, 1000, 0.9), (32, 8, 128, 1024, 0.5),
    (8, 2, 96, 2000, 0.6), (8, 1, 64, 4099, 0.5), (8, 4, 64, 4099, 0.9), (12, 6, 96, 750, 0.3),
    (2, 2, 128, 301, 0.4), (16, 2, 128, 3000, 0.7), (16, 16, 64, 90, 0.3), (16, 16, 64, 2048, 0.25),
    (4, 4, 64, 170, 0.3),
]

STREAM_CASES = [  # Hq, Hkv, d, T, n_sink, ratio
    (4, 4, 64, 5, 4, 0.1), (4, 2, 64, 7, 2, 0.5), (8, 4, 64, 8, 4, 0.5), (8, 2, 96, 16, 4, 0.25),
    (16, 2, 128, 33, 1, 0.8), (8, 1, 64, 64, 4, 0.5), (4, 4, 64, 100, 4, 0.9), (8, 4, 64, 100, 0, 0.5),
    (32, 8, 128, 128, 8, 0.1), (8, 2, 96, 257, 4, 0.75), (16, 2, 128, 500, 4, 0.8), (8, 4, 64, 1000, 4, 0.8),
    (8, 1, 64, 1000, 16, 0.9), (8, 8, 64, 1024, 4, 0.5), (8, 2, 96, 2000, 64, 0.6), (8, 1, 64, 4099, 4, 0.5),
    (4, 4, 64, 4099, 4, 0.9), (12, 6, 96, 750, 4, 0.3), (2, 2, 128, 301, 2, 0.4), (16, 16, 64, 90, 4, 0.3),
    (4, 4, 64, 170, 4, 0.3), (8, 1, 128, 3000, 128, 0.7), (4, 4, 64, 12, 11, 0.05),
]

OBS_CASES = [  # Hq, Hkv, d, T, ratio
    (4, 4, 64, 1, 0.5), (4, 4, 64, 7, 0.5), (8, 4, 64, 13, 0.3), (8, 2, 96, 16, 0.25), (16, 2, 128, 33, 0.8),
    (8, 1, 64, 64, 0.5), (4, 4, 64, 100, 0.9), (8, 4, 64, 100, 0.5), (32, 8, 128, 128, 0.1),
    (8, 2, 96, 257, 0.75), (16, 2, 128, 500, 0.8), (8, 4, 64, 1000, 0.8), (8, 1, 64, 1000, 0.9),
    (8, 8, 64, 1024, 0.5), (8, 2, 96, 2000, 0.6), (8, 1, 64, 4099, 0.5), (4, 4, 64, 4099, 0.9),
    (12, 6, 96, 750, 0.3), (2, 2, 128, 301, 0.4), (8, 2, 128, 3000, 0.7), (16, 16, 64, 90, 0.3),
    (4, 4, 64, 170, 0.3),
]

EA_CASES = [  # Hq, Hkv, d, T, n_sink, n_future, use_cov, use_vnorm, epsilon, ratio
    (4, 4, 64, 5, 4, 512, True, True, 0.0, 0.1), (8, 4, 64, 7, 2, 4, True, True, 0.0, 0.5),
    (8, 2, 96, 16, 4, 512, True, True, 0.0, 0.25), (16, 2, 128, 33, 4, 512, True, True, 0.01, 0.8),
    (8, 1, 64, 64, 4, 64, False, True, 0.0, 0.5), (4, 4, 64, 100, 4, 512, True, False, 0.0, 0.9),
    (8, 4, 64, 100, 0, 512, True, True, 0.0, 0.5), (32, 8, 128, 128, 4, 512, True, True, 0.0, 0.1),
    (8, 2, 96, 257, 4, 512, True, True, 0.01, 0.75), (16, 2, 128, 500, 4, 512, True, True, 0.0, 0.8),
    (8, 4, 64, 1000, 4, 512, True, True, 0.0, 0.8), (8, 1, 64, 1000, 8, 256, True, True, 0.01, 0.9),
    (32, 8, 128, 1024, 4, 512, True, True, 0.0, 0.5), (8, 2, 96, 2000, 4, 512, False, False, 0.0, 0.6),
    (8, 1, 64, 4099, 4, 512, True, True, 0.0, 0.5), (8, 4, 64, 4099, 4, 512, True, True, 0.01, 0.9),
    (12, 6, 96, 750, 4, 128, True, True, 0.0, 0.3), (2, 2, 128, 301, 4, 512, True, True, 0.0, 0.4),
    (16, 2, 128, 3000, 4, 512, True, True, 0.0, 0.7), (16, 16, 64, 90, 4, 512, True, True, 0.0, 0.3),
    (16, 16, 64, 2048, 4, 1, True, True, 0.0, 0.25), (4, 4, 64, 170, 16, 512, True, True, 0.0, 0.3),
]

ADA_SNAP_ALPHAS = [0.2, 0.0, 0.1, 0.5, 1.0, 0.2, 0.2, 0.25, 0.2, 0.2, 0.3, 0.2, 0.2, 0.2, 0.2, 0.1, 0.2, 0.5, 0.2,
                   0.2, 0.2, 0.2, 0.2]
ADA_EA_ALPHAS = [0.2, 0.2, 0.0, 0.2, 0.1, 0.5, 0.2, 1.0, 0.2, 0.25, 0.2, 0.2, 0.2, 0.3, 0.2, 0.2, 0.2, 0.2, 0.1,
                 0.2, 0.2, 0.2]

PYR_KV_CASES = [  # Hq, Hkv, d, T, window, kernel, ratio, beta, num_layers, layers
    (4, 4, 64, 64, 4, 3, 0.5, 20, 32, [0, 16, 31]), (8, 4, 64, 100, 8, 5, 0.5, 20, 32, [0, 15, 31]),
    (8, 2, 96, 257, 16, 7, 0.75, 20, 32, [0, 31]), (16, 2, 128, 500, 32, 5, 0.5, 20, 28, [0, 13, 27]),
    (8, 1, 64, 1000, 64, 5, 0.5, 20, 32, [0, 10, 31]), (8, 4, 64, 1000, 64, 5, 0.8, 20, 32, [0, 31]),
    (32, 8, 128, 1024, 64, 5, 0.5, 20, 32, [0, 16, 31]), (8, 2, 96, 2000, 64, 5, 0.6, 20, 64, [0, 32, 63]),
    (8, 1, 64, 4099, 64, 5, 0.5, 20, 32, [0, 16, 31]), (8, 4, 64, 4099, 16, 3, 0.9, 20, 32, [0, 31]),
    (12, 6, 96, 750, 8, 1, 0.3, 20, 4, [0, 1, 2, 3]), (2, 2, 128, 301, 5, 15, 0.4, 5, 8, [0, 7]),
    (16, 2, 128, 3000, 64, 7, 0.7, 20, 32, [0, 31]), (16, 16, 64, 90, 4, 3, 0.3, 1, 2, [0, 1]),
    (16, 16, 64, 2048, 64, 5, 0.25, 20, 32, [0, 16, 31]), (4, 4, 64, 170, 8, 5, 0.3, 20, 16, [0, 15]),
    (4, 1, 128, 120, 8, 3, 0.1, 20, 32, [0, 31]), (8, 4, 64, 1024, 64, 5, 0.9, 20, 32, [5]),
    (8, 2, 64, 600, 32, 5, 0.5, 20, 1, [0]), (4, 2, 96, 333, 16, 5, 0.25, 10, 12, [0, 6, 11]),
    (8, 8, 64, 512, 8, 5, 0.8, 20, 24, [0, 12, 23]),
]

SNAP_ORIG_CASES = [  # Hq, Hkv, d, T, C, window, kernel, pooling, granularity, group agg
    (4, 4, 64, 7, 5, 3, 3, "avg", "query_head", None), (8, 4, 64, 13, 8, 4, 1, "max", "query_head", None),
    (8, 2, 96, 16, 12, 8, 5, "avg", "kv_head", "mean"), (16, 2, 128, 33, 10, 2, 3, "max", "kv_head", "max"),
    (8, 1, 64, 64, 64, 16, 5, "avg", "query_head", None), (4, 4, 64, 100, 200, 8, 7, "max", "query_head", None),
    (8, 4, 64, 100, 40, 32, 5, "avg", "kv_head", "sum"), (32, 8, 128, 128, 96, 64, 5, "avg", "query_head", None),
    (8, 2, 96, 257, 100, 31, 9, "max", "kv_head", "mean"), (16, 2, 128, 500, 128, 32, 7, "max", "query_head", None),
    (8, 4, 64, 1000, 320, 64, 5, "avg", "query_head", None), (8, 1, 64, 1000, 320, 64, 5, "avg", "kv_head", "max"),
    (8, 8, 128, 1024, 1024, 32, 7, "max", "query_head", None),
    (8, 2, 96, 2000, 1024, 32, 7, "max", "kv_head", "mean"), (8, 1, 64, 4099, 2048, 32, 7, "max", "query_head", None),
    (8, 4, 64, 4099, 512, 8, 7, "max", "kv_head", "mean"), (12, 6, 96, 750, 128, 8, 7, "max", "kv_head", "sum"),
    (2, 2, 128, 301, 300, 5, 15, "avg", "query_head", None), (16, 2, 128, 3000, 2048, 32, 7, "max", "kv_head", "max"),
    (16, 16, 64, 90, 50, 4, 3, "avg", "kv_head", "mean"), (4, 4, 64, 170, 40, 8, 1, "max", "query_head", None),
    (8, 2, 64, 600, 128, 64, 5, "avg", "kv_head", "mean"),
]

ADA_ORIG_CASES = [  # Hq, Hkv, d, T, base_capacity, window, kernel, pooling, alpha, gqa_support, gqa_func, layer, skip
    (4, 4, 64, 20, 12, 4, 3, "max", 0.2, False, None, 0, 0), (8, 4, 64, 40, 16, 8, 7, "max", 0.2, True, "mean", 0, 0),
    (8, 2, 96, 64, 40, 8, 7, "max", 0.5, False, None, 0, 0), (16, 2, 128, 100, 48, 16, 7, "max", 0.25, True, "max", 0, 0),
    (8, 1, 64, 128, 96, 32, 7, "max", 0.2, True, "mean", 0, 0), (4, 4, 64, 100, 120, 8, 7, "max", 0.2, False, None, 0, 0),
    (8, 4, 64, 100, 100, 8, 7, "max", 0.2, False, None, 0, 0),
    (32, 8, 128, 512, 128, 32, 7, "max", 0.2, True, "mean", 0, 0),
    (8, 2, 96, 257, 64, 16, 5, "avg", 0.2, False, None, 0, 0), (16, 2, 128, 500, 128, 32, 7, "max", 0.2, False, None, 3, 0),
    (8, 4, 64, 1000, 256, 32, 7, "max", 0.2, True, "mean", 0, 0), (8, 1, 64, 1000, 128, 32, 7, "max", 0.5, True, "max", 0, 0),
    (8, 8, 128, 1024, 512, 32, 7, "max", 0.2, False, None, 0, 0),
    (8, 2, 96, 2000, 1024, 32, 7, "max", 0.2, True, "mean", 0, 0),
    (8, 1, 64, 4099, 1024, 32, 7, "max", 0.2, True, "mean", 0, 0), (8, 4, 64, 4099, 512, 32, 7, "max", 0.0, False, None, 0, 0),
    (12, 6, 96, 750, 128, 8, 7, "max", 1.0, True, "mean", 0, 0), (2, 2, 128, 301, 64, 5, 9, "avg", 0.25, False, None, 0, 0),
    (16, 2, 128, 3000, 512, 32, 7, "max", 0.2, False, None, 0, 0), (16, 16, 64, 90, 40, 4, 3, "max", 0.2, False, None, 0, 0),
    (4, 4, 64, 170, 40, 8, 7, "max", 0.2, False, None, 0, 1), (8, 2, 64, 600, 160, 32, 7, "max", 0.3, True, "max", 0, 0),
]

H2O_CASES = [  # Hq, Hkv, d, prefill T0, decode steps, hh_size, recent_size
    (4, 4, 64, 8, 8, 2, 2), (8, 8, 64, 13, 10, 4, 4), (2, 2, 96, 16, 16, 4, 8), (4, 4, 128, 33, 20, 8, 8),
    (8, 8, 64, 64, 32, 16, 16), (4, 4, 64, 100, 32, 4, 16), (8, 8, 64, 100, 16, 32, 32), (2, 2, 128, 128, 64, 48, 16),
    (4, 4, 96, 257, 32, 64, 64), (8, 8, 128, 500, 24, 64, 128), (4, 4, 64, 1000, 32, 100, 100),
    (2, 2, 64, 1000, 16, 256, 256), (8, 8, 64, 1024, 16, 128, 128), (4, 4, 96, 2000, 16, 256, 512),
    (2, 2, 64, 4099, 8, 1024, 1024), (4, 4, 64, 10, 20, 8, 4), (4, 4, 64, 1, 40, 8, 8), (8, 4, 64, 100, 24, 16, 16),
    (8, 2, 96, 257, 16, 32, 32), (16, 2, 128, 500, 16, 64, 64), (8, 1, 64, 1000, 16, 128, 128), (4, 4, 64, 300, 64, 0, 32),
]

TOVA_ORIG_CASES = [  # Hq, Hkv, d, prefill T0, decode steps, cache_size
    (4, 4, 64, 8, 8, 4), (8, 4, 64, 13, 10, 8), (8, 2, 96, 16, 16, 12), (16, 2, 128, 33, 20, 16), (8, 1, 64, 64, 32, 32),
    (4, 4, 64, 100, 32, 20), (8, 4, 64, 100, 16, 64), (32, 8, 128, 128, 24, 100), (8, 2, 96, 257, 32, 128),
    (16, 2, 128, 500, 24, 256), (8, 4, 64, 1000, 32, 200), (8, 1, 64, 1000, 16, 512), (8, 8, 128, 1024, 16, 512),
    (8, 2, 96, 2000, 16, 1024), (8, 1, 64, 4099, 8, 1024), (4, 4, 64, 10, 20, 16), (4, 4, 64, 1, 40, 8),
    (12, 6, 96, 750, 16, 300), (2, 2, 128, 301, 24, 100), (16, 2, 128, 3000, 8, 1500), (16, 16, 64, 90, 24, 30),
    (4, 4, 64, 170, 64, 1),
]

PYR_FACTORY_KEPT_CASES = [  # Hq, Hkv, d, T, C, window, kernel, pooling, granularity, agg, beta, NL, layers
    (4, 4, 64, 300, 80, 16, 7, "max", "query_head", None, 20, 4, [0, 1, 2, 3]),
    (4, 4, 64, 300, 120, 8, 7, "max", "query_head", None, 20, 4, [0, 3]),
    (4, 4, 64, 300, 200, 16, 7, "max", "query_head", None, 20, 4, [0, 3]),  # uniform regime
    (8, 2, 96, 257, 300, 8, 7, "max", "query_head", None, 20, 32, [0]),  # T < C: no compression
    (8, 4, 64, 1000, 128, 8, 7, "max", "kv_head", "mean", 20, 32, [0, 16, 31]),
    (8, 1, 64, 4099, 512, 8, 7, "max", "kv_head", "mean", 20, 32, [0, 31]),
    (16, 2, 128, 2000, 256, 32, 5, "avg", "query_head", None, 20, 32, [0, 31]),
    (8, 8, 64, 1024, 128, 8, 7, "max", "query_head", None, 20, 32, [0, 15, 31]),
    (12, 6, 96, 750, 100, 8, 7, "max", "kv_head", "max", 20, 28, [0, 27]),
    (2, 2, 128, 301, 64, 5, 9, "avg", "query_head", None, 5, 8, [0, 7]),
    (8, 4, 64, 600, 310, 8, 7, "max", "kv_head", "sum", 20, 32, [0, 31]),  # uniform regime
    (8, 2, 64, 500, 128, 32, 5, "avg", "kv_head", "mean", 20, 2, [0, 1]),
    (4, 1, 128, 160, 64, 16, 3, "max", "query_head", None, 20, 16, [0, 8, 15]),
    (16, 16, 64, 90, 40, 4, 3, "avg", "query_head", None, 20, 32, [0, 31]),
    (8, 4, 96, 3000, 1024, 64, 7, "max", "kv_head", "mean", 20, 32, [0, 31]),
    (4, 4, 64, 128, 128, 8, 7, "max", "query_head", None, 20, 32, [0]),  # T == C
    (8, 2, 64, 140, 40, 8, 5, "avg", "query_head", None, 1, 4, [0, 3]),
    (8, 4, 64, 2048, 256, 8, 7, "max", "kv_head", "mean", 20, 40, [0, 20, 39]),
    (16, 4, 128, 1024, 160, 32, 7, "max", "query_head", None, 20, 32, [0, 31]),
    (4, 2, 96, 512, 64, 8, 7, "max", "kv_head", "max", 20, 32, [0, 31]),
]


# ---------------------------------------------------------------------------------------------------------------
# conventions written into every file

COMMON_CONVENTIONS = {
    "layout": "Every tensor is (head, token, dim), row-major, batch 1, float32. Query head h reads kv head h / G, "
              "G = num_q_heads / num_kv_heads (repeat_kv layout).",
    "inputs": "Regenerate the tensors with fixture_rng (recipe kvp-fixture-v1) from (seed, num_q_heads, "
              "num_kv_heads, seq_len, head_dim); 'inputs' gives each tensor's role and a drift check: the exact "
              "float64 sum, bits_checksum = sum_i bits(x_i)*(2i+1) mod 2^64 over the float32 bit patterns, and "
              "the first 8 values.",
    "keys": "The generated keys are the post-RoPE keys (they are what the cache holds); they are passed to the "
            "references as they are.",
    "numbers": "Floats are printed with 17 significant digits (exact double round trip). kvpress results are "
               "float32 values widened to double.",
    "kept_sets": "Per head: ascending token indices, encoded as {count, idx: [...]} when the universe (seq_len, "
                 "or n_seen for online steps) is <= 256, else {count, bitmap}: hex char i holds tokens 4i..4i+3, "
                 "bit b (value 1<<b) of that nibble = token 4i+b; length ceil(universe/4).",
    "scores": "scores.tokens[h] lists the sampled token positions of head h (all first/last 8 of the scored "
              "range plus hashed ones); scores.value[h] the reference scores there; value_fp64 (when present) the "
              "float64 mirror computed by make_fixtures.py from the spec formulas. scores.protected = [begin, end) "
              "token range that the reference pads (kvpress: with pad_value = max over all heads and tokens + 1, "
              "recorded raw as kvpress returned it) or always keeps (originals); null if none.",
    "ties": "Inputs are tie-free: seeds were bumped until every selection boundary has relative gap "
            "(v_k - v_{k+1}) / |v_k| >= 1e-05 (checks.min_rel_gap; null when nothing was selected). Max-pooling creates exact plateaus; where equal "
            "scores straddle a boundary, kept_ties[h] = {tied: set, n_tied_kept} and 'kept' uses the tie-break "
            "'higher score, then lower token index'; any n_tied_kept of the tied tokens is equally valid.",
}


def conventions(extra):
    c = dict(COMMON_CONVENTIONS)
    c.update(extra)
    return c


KVPRESS_CONVENTIONS = {
    "reference": "kvpress press.score()/compress() on a stub module (algorithms-eviction.md §10): float32 "
                 "tensors, hidden_states = queries laid out [1, T, Hq*d] with q_proj = identity, "
                 "config._attn_implementation = 'sdpa'.",
    "rope": "Queries are post-RoPE for the window-attention presses: the recompute path was driven with "
            "position_embeddings cos = 1, sin = 0, so the generated queries enter unchanged.",
    "n_kept": "kvpress 0.5.5 compute_n_kept: max(1, int(T * (1 - r))) in double (T=1000, r=0.8 -> 199).",
    "kept_from": "kept = the token positions of the rows kvpress's compress() gathered (top-k of its float32 "
                 "scores); the fp64 mirror's top-k is asserted to give the same sets.",
}


# ---------------------------------------------------------------------------------------------------------------
# policy builders (each returns (conventions, cases, extra top-level fields))

def run_scorer(inp, press, layer=0, num_layers=32, attentions=None):
    module = kv_module(inp, num_layers, layer)
    hidden, keys, values, kwargs = kv_tensors(inp)
    captured = []
    score = press.score

    def capture(*args):  # compress() calls score() once; keep what it returned
        captured.append(score(*args).clone())
        return captured[-1].clone()

    press.score = capture
    try:
        with torch.no_grad():
            out_k, _ = press.compress(module, hidden, keys, values, attentions, kwargs)
    finally:
        del press.score
    assert len(captured) == 1
    return captured[0][0].double().numpy(), kept_from_gather(inp, out_k)


def build_snapkv_kvpress():
    from kvpress import SnapKVPress
    cases = []
    for n, (hq, hkv, d, T, w, K, r) in enumerate(SNAP_CASES):
        def build(seed):
            inp = Inputs(seed, hq, hkv, T, d)
            press = SnapKVPress(compression_ratio=r, window_size=w, kernel_size=K)
            mir, pad64 = mirror_snapkv_kvpress(inp, w, K)
            n_kept = kvpress_n_kept(T, r)
            assert n_kept >= w, "the kept set is only defined when n_kept >= window"
            sel = [topk_set(mir[g], n_kept, what=f"snapkv head {g}") for g in range(hkv)]
            ref, kv_kept = run_scorer(inp, press)
            check_kept_equal(kv_kept, [s[0] for s in sel], "snapkv")
            past = np.zeros_like(ref, dtype=bool)
            past[:, :T - w] = True
            c = case_header(f"snapkv_kvpress/{n:02d}", inp,
                            {"compression_ratio": r, "window_size": w, "kernel_size": K})
            c["n_kept"] = n_kept
            c["score_granularity"] = "kv_head"
            c["scores"] = score_block(seed, ref, mir, protected=[T - w, T], pad_value=float(ref[0, -1]),
                                      pad_value_fp64=pad64)
            c["kept"] = [encode_set(k, T) for k in kv_kept]
            ad, rd = max_diffs(ref, mir, past)
            c["checks"] = {"min_rel_gap": min(s[2] for s in sel), "fp32_vs_fp64_max_abs": ad,
                           "fp32_vs_fp64_max_rel": rd}
            return c
        cases.append(with_seed_retry(1000 + 10 * n, build)[0])
    conv = conventions(dict(KVPRESS_CONVENTIONS, policy=(
        "SnapKVPress(compression_ratio, window_size, kernel_size), recompute path (attentions=None): mean over "
        "the window queries of the causal window attention (fp32 softmax), avg_pool1d (count_include_pad), mean "
        "over the GQA group, window tokens padded with max+1. Scores are per kv head over all T tokens.")))
    return conv, cases, {}


def build_tova_kvpress():
    from kvpress import TOVAPress
    cases = []
    for n, (hq, hkv, d, T, r) in enumerate(TOVA_KV_CASES):
        def build(seed):
            inp = Inputs(seed, hq, hkv, T, d)
            mir, pad64 = mirror_tova_kvpress(inp)
            n_kept = kvpress_n_kept(T, r)
            sel = [topk_set(mir[g], n_kept, what=f"tova head {g}") for g in range(hkv)]
            ref, kv_kept = run_scorer(inp, TOVAPress(compression_ratio=r))
            check_kept_equal(kv_kept, [s[0] for s in sel], "tova")
            past = np.zeros_like(ref, dtype=bool)
            past[:, :T - 1] = True
            c = case_header(f"tova_kvpress/{n:02d}", inp, {"compression_ratio": r})
            c["n_kept"] = n_kept
            c["score_granularity"] = "kv_head"
            c["scores"] = score_block(seed, ref, mir, protected=[T - 1, T], pad_value=float(ref[0, -1]),
                                      pad_value_fp64=pad64)
            c["kept"] = [encode_set(k, T) for k in kv_kept]
            ad, rd = max_diffs(ref, mir, past)
            c["checks"] = {"min_rel_gap": min(s[2] for s in sel), "fp32_vs_fp64_max_abs": ad,
                           "fp32_vs_fp64_max_rel": rd}
            return c
        cases.append(with_seed_retry(2000 + 10 * n, build)[0])
    conv = conventions(dict(KVPRESS_CONVENTIONS, policy=(
        "TOVAPress(compression_ratio), recompute path: attention of the last query (position T-1) over keys "
        "0..T-2, averaged over ALL query heads, the same row repeated for every kv head; the last token is padded "
        "with max+1.")))
    return conv, cases, {}


def build_streamingllm_kvpress():
    from kvpress import StreamingLLMPress
    cases = []
    for n, (hq, hkv, d, T, n_sink, r) in enumerate(STREAM_CASES):
        seed = 3000 + 10 * n
        inp = Inputs(seed, hq, hkv, T, d)
        ref, kv_kept = run_scorer(inp, StreamingLLMPress(compression_ratio=r, n_sink=n_sink))
        mir = mirror_streaming_kvpress(T, hkv, n_sink, r)
        n_kept = kvpress_n_kept(T, r)
        assert n_kept >= n_sink and np.array_equal(ref, mir)
        expect = np.concatenate([np.arange(n_sink), np.arange(n_sink + (T - int(T * (1 - r))), T)])
        for g in range(hkv):
            assert np.array_equal(kv_kept[g], expect)
        c = case_header(f"streamingllm_kvpress/{n:02d}", inp, {"compression_ratio": r, "n_sink": n_sink})
        c["n_kept"] = n_kept
        c["score_granularity"] = "kv_head"
        c["scores"] = score_block(seed, ref, None, protected=None, pad_value=None)
        c["kept"] = [encode_set(k, T) for k in kv_kept]
        c["checks"] = {"min_rel_gap": 1.0}
        cases.append(c)
    conv = conventions(dict(KVPRESS_CONVENTIONS, policy=(
        "StreamingLLMPress(compression_ratio, n_sink): score 1 for tokens [0, n_sink) and [n_sink + n_pruned, T), "
        "0 for the rest, n_pruned = T - int(T*(1-r)). Positional: the inputs only give the shapes.")))
    return conv, cases, {}


def build_observed_attention_kvpress():
    from kvpress import ObservedAttentionPress
    cases = []
    for n, (hq, hkv, d, T, r) in enumerate(OBS_CASES):
        def build(seed):
            inp = Inputs(seed, hq, hkv, T, d)
            mir = mirror_observed_kvpress(inp)
            n_kept = kvpress_n_kept(T, r)
            sel = [topk_set(mir[g], n_kept, what=f"observed head {g}") for g in range(hkv)]
            att = torch.empty(1, hq, T, T, dtype=torch.float32)
            for r0 in range(0, T, 256):
                r1 = min(T, r0 + 256)
                att[0, :, r0:r1] = causal_attention_rows64(inp, r0, r1, T).float()
            ref, kv_kept = run_scorer(inp, ObservedAttentionPress(compression_ratio=r), attentions=att)
            del att
            check_kept_equal(kv_kept, [s[0] for s in sel], "observed")
            c = case_header(f"observed_attention_kvpress/{n:02d}", inp, {"compression_ratio": r})
            c["n_kept"] = n_kept
            c["score_granularity"] = "kv_head"
            c["scores"] = score_block(seed, ref, mir, protected=None, pad_value=None)
            c["kept"] = [encode_set(k, T) for k in kv_kept]
            ad, rd = max_diffs(ref, mir)
            c["checks"] = {"min_rel_gap": min(s[2] for s in sel), "fp32_vs_fp64_max_abs": ad,
                           "fp32_vs_fp64_max_rel": rd}
            return c
        cases.append(with_seed_retry(4000 + 10 * n, build)[0])
    conv = conventions(dict(KVPRESS_CONVENTIONS, policy=(
        "ObservedAttentionPress(compression_ratio): score[g, j] = mean over the group of sum_i A[h, i, j] / (T - j). "
        "The attentions passed to kvpress are the full causal softmax(q k^T / sqrt(d)) computed in float64 and "
        "rounded to float32 (what an eager fp32 model would return, correctly rounded). No protected tokens.")))
    return conv, cases, {}


EA_POLICY_TEXT = (
    "ExpectedAttentionPress(compression_ratio, n_future_positions, n_sink, use_covariance, use_vnorm, epsilon): "
    "queries here are the PRE-RoPE queries (hidden_states with identity q_proj), keys are post-RoPE as given. "
    "mu/cov = mean and population covariance (divide by N) of the pre-RoPE queries of tokens n_sink..T-1; "
    "Rbar = mean over p in [T, T+n_future) of the RoPE matrix; z = <Rbar mu, k>/sqrt(d) + k^T Rbar cov Rbar^T k "
    "/ (2d); softmax over the non-sink keys; mean over the group; (s + epsilon) * ||v||; sinks padded on the LEFT "
    "with max+1.")
EA_ROPE_TEXT = (
    "Future-position RoPE (module.rotary_emb stub): base 10000, half-split rotate_half convention, "
    "inv_freq[i] = 10000^(-2i/d) (i < d/2), angle = p * inv_freq[i] duplicated to d (cat(freqs, freqs)); angles, "
    "cos and sin computed in float64 and rounded to float32 before kvpress uses them. The fp64 mirror uses the "
    "float64 tables.")


def build_expected_attention_kvpress():
    from kvpress import ExpectedAttentionPress
    cases = []
    for n, (hq, hkv, d, T, n_sink, nf, cov, vn, eps, r) in enumerate(EA_CASES):
        def build(seed):
            inp = Inputs(seed, hq, hkv, T, d)
            press = ExpectedAttentionPress(compression_ratio=r, n_future_positions=nf, n_sink=n_sink,
                                           use_covariance=cov, use_vnorm=vn, epsilon=eps)
            mir, pad64 = mirror_ea_kvpress(inp, n_sink, nf, cov, vn, eps)
            n_kept = kvpress_n_kept(T, r)
            assert n_kept >= n_sink
            sel = [topk_set(mir[g], n_kept, what=f"ea head {g}") for g in range(hkv)]
            ref, kv_kept = run_scorer(inp, press)
            check_kept_equal(kv_kept, [s[0] for s in sel], "ea")
            past = np.zeros_like(ref, dtype=bool)
            past[:, n_sink:] = True
            c = case_header(f"expected_attention_kvpress/{n:02d}", inp,
                            {"compression_ratio": r, "n_future_positions": nf, "n_sink": n_sink,
                             "use_covariance": cov, "use_vnorm": vn, "epsilon": eps}, "pre_rope_queries")
            c["n_kept"] = n_kept
            c["score_granularity"] = "kv_head"
            c["scores"] = score_block(seed, ref, mir, protected=[0, n_sink] if n_sink else None,
                                      pad_value=float(ref[0, 0]) if n_sink else None,
                                      pad_value_fp64=pad64 if n_sink else None)
            c["kept"] = [encode_set(k, T) for k in kv_kept]
            ad, rd = max_diffs(ref, mir, past)
            c["checks"] = {"min_rel_gap": min(s[2] for s in sel), "fp32_vs_fp64_max_abs": ad,
                           "fp32_vs_fp64_max_rel": rd}
            return c
        cases.append(with_seed_retry(5000 + 10 * n, build)[0])
    conv = conventions(dict(KVPRESS_CONVENTIONS, policy=EA_POLICY_TEXT, rope=EA_ROPE_TEXT))
    return conv, cases, {}


def adakv_case(n, name, inp, inner, alpha, params, ref_fn, mirror, pad64, protected, query_role, seed):
    from kvpress import AdaKVPress
    T, hkv = inp.T, inp.hkv
    mk, n_kept, n_safe, gap = mirror_adakv_kvpress(mirror, T, inner.compression_ratio, alpha, pad64, name)
    module = kv_module(inp)
    hidden, keys, values, kwargs = kv_tensors(inp)
    with torch.no_grad():
        scores = inner.score(module, hidden, keys, values, None, kwargs)[0].double().numpy()
        AdaKVPress(inner, alpha_safeguard=alpha).compress(module, hidden, keys, values, None, kwargs)
    _, h_idx, t_idx = module.masked_key_indices
    kv_kept = [np.setdiff1d(np.arange(T), t_idx[h_idx == g].numpy()) for g in range(hkv)]
    pad = None if protected is None else float(scores[0, protected[0]])
    check_kept_equal(kv_kept, mk, name)
    c = case_header(f"{name}/{n:02d}", inp, dict(params, alpha_safeguard=alpha), query_role)
    c["n_kept"] = n_kept
    c["n_safe"] = n_safe
    c["n_pruned_total"] = hkv * (T - n_kept)
    c["score_granularity"] = "kv_head"
    c["scores"] = score_block(seed, scores, mirror, protected=protected, pad_value=pad,
                              pad_value_fp64=pad64 if protected else None)
    c["kept"] = [encode_set(k, T) for k in kv_kept]
    c["kept_counts"] = [int(k.size) for k in kv_kept]
    mask = np.ones_like(scores, dtype=bool)
    if protected:
        mask[:, protected[0]:protected[1]] = False
    ad, rd = max_diffs(scores, mirror, mask)
    c["checks"] = {"min_rel_gap": gap, "fp32_vs_fp64_max_abs": ad, "fp32_vs_fp64_max_rel": rd}
    return c


ADAKV_TEXT = (
    "AdaKVPress(inner, alpha_safeguard) (kvpress 0.5.5): S = inner.score (with its max+1 pads); n_kept = max(1, "
    "int(T(1-r))); n_safe = int(n_kept*alpha), clamped to >= 1 when alpha > 0; each head's top n_safe scores are "
    "set to FLT_MAX; then the bottom Hkv*(T-n_kept) of the flattened [Hkv*T] scores are masked. kept[h] = the "
    "complement of module.masked_key_indices for kv head h (ragged: kept_counts). 'scores' are the inner press's "
    "scores (before the safeguard).")


def build_adakv_snapkv_kvpress():
    from kvpress import SnapKVPress
    cases = []
    for n, (hq, hkv, d, T, w, K, r) in enumerate(SNAP_CASES):
        alpha = ADA_SNAP_ALPHAS[n]

        def build(seed):
            inp = Inputs(seed, hq, hkv, T, d)
            inner = SnapKVPress(compression_ratio=r, window_size=w, kernel_size=K)
            mir, pad64 = mirror_snapkv_kvpress(inp, w, K)
            return adakv_case(n, "adakv_snapkv_kvpress", inp, inner, alpha,
                              {"compression_ratio": r, "window_size": w, "kernel_size": K}, None, mir, pad64,
                              [T - w, T], "post_rope_queries", seed)
        cases.append(with_seed_retry(6000 + 10 * n, build)[0])
    conv = conventions(dict(KVPRESS_CONVENTIONS, policy=ADAKV_TEXT + " Inner press: SnapKVPress (see "
                            "snapkv_kvpress.json), recompute path."))
    return conv, cases, {}


def build_adakv_expected_attention_kvpress():
    from kvpress import ExpectedAttentionPress
    cases = []
    for n, (hq, hkv, d, T, n_sink, nf, cov, vn, eps, r) in enumerate(EA_CASES):
        alpha = ADA_EA_ALPHAS[n]

        def build(seed):
            inp = Inputs(seed, hq, hkv, T, d)
            inner = ExpectedAttentionPress(compression_ratio=r, n_future_positions=nf, n_sink=n_sink,
                                           use_covariance=cov, use_vnorm=vn, epsilon=eps)
            mir, pad64 = mirror_ea_kvpress(inp, n_sink, nf, cov, vn, eps)
            return adakv_case(n, "adakv_expected_attention_kvpress", inp, inner, alpha,
                              {"compression_ratio": r, "n_future_positions": nf, "n_sink": n_sink,
                               "use_covariance": cov, "use_vnorm": vn, "epsilon": eps}, None, mir, pad64,
                              [0, n_sink] if n_sink else None, "pre_rope_queries", seed)
        cases.append(with_seed_retry(7000 + 10 * n, build)[0])
    conv = conventions(dict(KVPRESS_CONVENTIONS, policy=ADAKV_TEXT + " Inner press: " + EA_POLICY_TEXT,
                            rope=EA_ROPE_TEXT))
    return conv, cases, {}


def pyramid_budget_grid():
    """kvpress PyramidKVPress.get_layer_budget over the kvpress test grid plus edge cases."""
    from kvpress import PyramidKVPress
    rows = []
    combos = []
    for NL in (32, 64, 128):
        for r in (0.1, 0.25, 0.3, 0.5, 0.6, 0.75, 0.8):
            for T in (1024, 2787, 4096, 6591, 8192):
                combos.append((T, r, 64, 20, NL))
    for T, r, w, beta, NL in [(1024, 0.5, 64, 20, 32), (1024, 0.9, 64, 20, 32), (100, 0.5, 8, 20, 4),
                              (257, 0.75, 16, 20, 32), (1000, 0.8, 64, 20, 32), (1000, 0.9, 32, 20, 32),
                              (4099, 0.5, 64, 20, 32), (4099, 0.9, 16, 20, 32), (300, 0.5, 16, 20, 4),
                              (300, 0.6, 8, 20, 4), (500, 0.5, 32, 1, 8), (500, 0.5, 32, 5, 8),
                              (2048, 0.25, 64, 20, 1), (2048, 0.25, 64, 20, 2), (600, 0.5, 32, 20, 1),
                              (90, 0.3, 4, 1, 2), (750, 0.3, 8, 20, 4), (3000, 0.7, 64, 20, 28),
                              (128, 0.05, 8, 20, 32), (8192, 0.95, 64, 20, 32), (333, 0.25, 16, 10, 12),
                              (512, 0.8, 8, 20, 24), (64, 0.5, 4, 20, 32), (120, 0.1, 8, 20, 32)]:
        combos.append((T, r, w, beta, NL))
    for T, r, w, beta, NL in combos:
        press = PyramidKVPress(compression_ratio=r, window_size=w, beta=beta)
        budgets = []
        for layer in range(NL):
            m = types.SimpleNamespace(layer_idx=layer, config=types.SimpleNamespace(num_hidden_layers=NL))
            budgets.append(int(press.get_layer_budget(m, T)))
        rows.append({"T": T, "compression_ratio": r, "window_size": w, "beta": beta, "num_hidden_layers": NL,
                     "budgets": budgets})
    # spec §4.3 example
    ex = next(x for x in rows if (x["T"], x["compression_ratio"], x["window_size"], x["num_hidden_layers"]) ==
              (1024, 0.5, 64, 32))
    assert ex["budgets"][:3] == [960, 931, 902] and ex["budgets"][-1] == 64
    return rows


def build_pyramidkv_kvpress():
    from kvpress import PyramidKVPress
    cases = []
    for n, (hq, hkv, d, T, w, K, r, beta, NL, layers) in enumerate(PYR_KV_CASES):
        def build(seed):
            inp = Inputs(seed, hq, hkv, T, d)
            mir, pad64 = mirror_snapkv_kvpress(inp, w, K)
            per_layer, ref, gaps = [], None, []
            press = PyramidKVPress(compression_ratio=r, window_size=w, kernel_size=K, beta=beta)
            budgets, sels = {}, {}
            for layer in layers:
                m = types.SimpleNamespace(layer_idx=layer, config=types.SimpleNamespace(num_hidden_layers=NL))
                budgets[layer] = int(press.get_layer_budget(m, T))
                assert budgets[layer] >= w, f"pyramid case {n}: budget {budgets[layer]} < window {w}"
                sels[layer] = [topk_set(mir[g], budgets[layer], what=f"pyramid layer {layer} head {g}")
                               for g in range(hkv)]
            for layer in layers:
                budget, sel = budgets[layer], sels[layer]
                ref, kv_kept = run_scorer(inp, press, layer=layer, num_layers=NL)
                check_kept_equal(kv_kept, [s[0] for s in sel], "pyramid")
                gaps += [s[2] for s in sel]
                per_layer.append({"layer_idx": layer, "n_kept": budget,
                                  "kept": [encode_set(k, T) for k in kv_kept]})
            past = np.zeros_like(ref, dtype=bool)
            past[:, :T - w] = True
            c = case_header(f"pyramidkv_kvpress/{n:02d}", inp,
                            {"compression_ratio": r, "window_size": w, "kernel_size": K, "beta": beta,
                             "num_hidden_layers": NL})
            c["score_granularity"] = "kv_head"
            c["scores"] = score_block(seed, ref, mir, protected=[T - w, T], pad_value=float(ref[0, -1]),
                                      pad_value_fp64=pad64)
            c["layers"] = per_layer
            ad, rd = max_diffs(ref, mir, past)
            c["checks"] = {"min_rel_gap": min(gaps), "fp32_vs_fp64_max_abs": ad, "fp32_vs_fp64_max_rel": rd}
            return c
        cases.append(with_seed_retry(8000 + 10 * n, build)[0])
    conv = conventions(dict(KVPRESS_CONVENTIONS, policy=(
        "PyramidKVPress(compression_ratio, window_size, kernel_size, beta): SnapKVPress scores (layer-independent), "
        "n_kept per layer = get_layer_budget(layer_idx, T) (float formula, Python round half-to-even, fallback "
        "max(1, round(T(1-r))), steps = 0 when num_hidden_layers == 1). Each case lists layers[] with that layer's "
        "n_kept and kept sets; 'budget_grid' lists get_layer_budget for every layer of many (T, r, w, beta, NL).")))
    return conv, cases, {"budget_grid": pyramid_budget_grid()}


ORIG_CONVENTIONS = {
    "reference": "Implemented in make_fixtures.py from the spec's pseudo-code (algorithms-eviction.md), float64 "
                 "arithmetic on the float32 inputs (the originals compute the softmax in fp32 and cast to the model "
                 "dtype; here nothing is rounded).",
    "rope": "Queries and keys are used as given (post-RoPE); no rotation is applied.",
}


def build_snapkv_original():
    cases = []
    for n, (hq, hkv, d, T, C, w, K, pool, gran, agg) in enumerate(SNAP_ORIG_CASES):
        def build(seed):
            inp = Inputs(seed, hq, hkv, T, d)
            P = snapkv_original_scores(inp, w, K, pool, gran, agg)
            compressed = T >= C
            if compressed:
                kept, ties, gap = select_past_plus_window(P, T, w, C - w, f"snapkv_original {n}")
            else:
                kept, ties, gap = [np.arange(T)] * P.shape[0], [None] * P.shape[0], math.inf
            params = {"max_capacity_prompt": C, "window_size": w, "kernel_size": K, "pooling": pool,
                      "granularity": gran, "gqa_agg": agg}
            c = case_header(f"snapkv_original/{n:02d}", inp, params)
            c["compressed"] = compressed
            c["n_kept"] = C if compressed else T
            c["score_granularity"] = gran
            c["scores"] = score_block(seed, P, None, protected=[T - w, T])
            c["kept"] = [encode_set(k, T) for k in kept]
            c["kept_ties"] = [encode_ties(t, T) for t in ties]
            c["checks"] = {"min_rel_gap": gap}
            return c
        cases.append(with_seed_retry(9000 + 10 * n, build)[0])
    conv = conventions(dict(ORIG_CONVENTIONS, policy=(
        "SnapKV original (FasterDecoding SnapKVCluster, §3.1) and KVCache-Factory kv_head mode (§3.2). "
        "granularity 'query_head': one selection per QUERY head (keys repeated, cache x G), scores and kept have "
        "num_q_heads rows; 'kv_head': window scores reduced over the GQA group with gqa_agg (mean|max|sum) BEFORE "
        "pooling, one selection per kv head. Score = SUM over the w window queries of the causal window attention "
        "(softmax over all T keys), for past tokens t < T-w only (scores.value[h][i] is that past score), then "
        "pooling (avg: zero padding counted, divisor K; max: padding never wins; kernel 1 = none). If T < C "
        "(compressed=false) nothing is evicted; else keep top C-w past tokens plus the whole window (n_kept = C).")))
    return conv, cases, {}


LAQ_CASES = [  # Hq, Hkv, d, prompt T, pseudo tokens n, W2, capacity C, mask, granularity
    (4, 4, 32, 300, 8, 0, 64, "reference", "query_head"), (4, 4, 32, 300, 8, 8, 64, "reference", "query_head"),
    (4, 4, 32, 300, 3, 8, 64, "reference", "query_head"), (4, 4, 32, 300, 8, 8, 64, "corrected", "query_head"),
    (4, 4, 32, 300, 8, 0, 96, "corrected", "query_head"), (8, 2, 32, 400, 8, 8, 96, "reference", "kv_head"),
    (8, 2, 32, 400, 8, 8, 96, "reference", "query_head"), (4, 4, 32, 50, 8, 8, 64, "reference", "query_head"),
    (4, 2, 64, 1000, 8, 8, 128, "reference", "kv_head"), (4, 2, 64, 1000, 5, 0, 128, "corrected", "kv_head"),
]


def laq_stage2_scores(inp, T, W2, n, K, mask, granularity):
    """LAQ stage 2 (Lookahead_Q-Cache `SnapKVCluster.update_kv_LAQ`) in float64: the W2 + n observation rows are
    query rows T-W2 .. T+n-1 of the generated inputs (W2 prompt queries, then n pseudo queries), the keys the first
    T rows. Per query head (the reference repeats K/V with repeat_kv); 'kv_head' reduces the group's sums with the
    mean before pooling. Returns the pooled scores of the T - W2 past tokens, [H, T - W2]."""
    A = W2 + n
    q = t64(inp.q[:, T - W2:T + n])
    k = t64(inp.k[:, :T]).repeat_interleave(inp.G, dim=0)
    logits = q @ k.transpose(1, 2) / math.sqrt(inp.d)
    if mask == "reference":
        # as coded: a lower-triangular block of finfo.min added to the last A key columns
        m = torch.full((A, A), torch.finfo(logits.dtype).min, dtype=logits.dtype)
        c = torch.arange(A)
        m.masked_fill_(c < (c + 1).view(A, 1), 0)
        logits[:, :, T - A:] += m
    else:
        # corrected: prompt row i sits at T-W2+i, pseudo rows see every prompt key
        i = torch.arange(A)[:, None]
        j = torch.arange(T)[None, :]
        logits = logits.masked_fill((i < W2) & (j > T - W2 + i), float("-inf"))
    attn = torch.softmax(logits, dim=-1)
    s = attn[:, :, :T - W2].sum(1) if W2 > 0 else attn.sum(1)
    if granularity == "kv_head":
        s = group_reduce64(s, inp.G, "mean")
    return pool64(s, K, "max").numpy()


def build_laq_original():
    cases = []
    for n_case, (hq, hkv, d, T, n, W2, C, mask, gran) in enumerate(LAQ_CASES):
        def build(seed):
            inp = Inputs(seed, hq, hkv, T + n, d)  # rows T..T+n-1 of the queries are the pseudo queries
            P = laq_stage2_scores(inp, T, W2, n, 7, mask, gran)
            compressed = T >= C  # the reference returns early only for T < C
            if compressed:
                kept, ties, gap = select_past_plus_window(P, T, W2, C - W2, f"laq {n_case}")
            else:
                kept, ties, gap = [np.arange(T)] * P.shape[0], [None] * P.shape[0], math.inf
            params = {"prompt_len": T, "lookahead": n, "window": W2, "max_capacity_prompt": C, "kernel_size": 7,
                      "pooling": "max", "mask": mask, "granularity": gran}
            c = case_header(f"laq_original/{n_case:02d}", inp, params)
            c["compressed"] = compressed
            c["n_kept"] = C if compressed else T
            c["scores"] = score_block(seed, P, None, protected=[T - W2, T])
            c["kept"] = [encode_set(k, T) for k in kept]
            c["kept_ties"] = [encode_ties(t, T) for t in ties]
            c["checks"] = {"min_rel_gap": gap}
            return c
        cases.append(with_seed_retry(9500 + 10 * n_case, build)[0])
    conv = conventions(dict(ORIG_CONVENTIONS, policy=(
        "LAQ stage 2 (noforit/Lookahead_Q-Cache, SnapKVCluster.update_kv_LAQ, run_LAQ.sh defaults: max pool 7). "
        "Inputs are generated for seq_len = prompt_len + lookahead tokens: key rows [0, prompt_len) are the prompt "
        "keys, query rows [prompt_len - window, prompt_len) the W2 prompt queries and [prompt_len, seq_len) the "
        "pseudo queries. mask 'reference': the as-coded lower-triangular block on the last W2+n keys; 'corrected': "
        "prompt query T-W2+i sees keys <= T-W2+i, pseudo queries see all T. softmax over the T prompt keys, SUM over "
        "the W2+n rows, past tokens t < T-W2 (all when W2 = 0), max pool 7 (padding never wins). granularity "
        "'query_head': per query head (keys repeated, as the reference); 'kv_head': the group's sums averaged before "
        "pooling. If T < C nothing is evicted; else top C-W2 past tokens plus the last W2 (n_kept = C).")))
    return conv, cases, {}


def factory_grid():
    rows = []
    for T, C, w, beta, NL in [(4000, 128, 8, 20, 32), (300, 80, 16, 20, 4), (300, 120, 8, 20, 4),
                              (300, 200, 16, 20, 4), (4000, 2048, 8, 20, 32), (1000, 128, 8, 20, 32),
                              (1000, 512, 8, 20, 32), (1000, 1024, 8, 20, 32), (999, 1000, 8, 20, 32),
                              (1000, 1000, 8, 20, 32), (4099, 512, 8, 20, 32), (4099, 256, 32, 20, 32),
                              (2048, 256, 8, 20, 40), (2000, 256, 32, 20, 32), (750, 100, 8, 20, 28),
                              (301, 64, 5, 5, 8), (160, 64, 16, 20, 16), (90, 40, 4, 20, 32), (3000, 1024, 64, 20, 32),
                              (140, 40, 8, 1, 4), (500, 128, 32, 20, 2), (1024, 160, 32, 20, 32), (512, 64, 8, 20, 32),
                              (8192, 2048, 8, 20, 32), (8192, 128, 8, 20, 80), (600, 300, 8, 20, 32),
                              (128, 128, 8, 20, 32), (2048, 1024, 8, 20, 32), (2100, 1024, 8, 20, 32),
                              (5000, 1024, 32, 3, 16), (300, 150, 8, 20, 4)]:
        regimes, totals = [], []
        for layer in range(NL):
            reg, tot = pyramid_factory_capacity(T, C, w, beta, NL, layer)
            regimes.append(reg)
            totals.append(tot)
        assert len(set(regimes)) == 1
        rows.append({"T": T, "max_capacity_prompt": C, "window_size": w, "beta": beta, "num_hidden_layers": NL,
                     "regime": regimes[0], "totals": totals})
    spec = {(4000, 128, 8, 32): [242, 235, 228, 221, 214, 207, 200, 193, 186, 179, 172, 165, 158, 151, 144, 137, 130,
                                 123, 116, 109, 102, 95, 88, 81, 74, 67, 60, 53, 46, 39, 32, 25],
            (300, 80, 16, 4): [141, 101, 61, 21], (300, 120, 8, 4): [227, 156, 85, 14],
            (300, 200, 16, 4): [200, 200, 200, 200]}
    for row in rows:
        key = (row["T"], row["max_capacity_prompt"], row["window_size"], row["num_hidden_layers"])
        if key in spec:
            assert row["totals"] == spec[key], (key, row["totals"])
    return rows


def build_pyramidkv_factory():
    cases = []
    for n, (hq, hkv, d, T, C, w, K, pool, gran, agg, beta, NL, layers) in enumerate(PYR_FACTORY_KEPT_CASES):
        def build(seed):
            inp = Inputs(seed, hq, hkv, T, d)
            P = snapkv_original_scores(inp, w, K, pool, gran, agg)
            per_layer, gaps = [], []
            for layer in layers:
                regime, total = pyramid_factory_capacity(T, C, w, beta, NL, layer)
                if regime == "none":
                    kept, ties, gap = [np.arange(T)] * P.shape[0], [None] * P.shape[0], math.inf
                else:
                    kept, ties, gap = select_past_plus_window(P, T, w, total - w, f"pyramid_factory {n} l{layer}")
                gaps.append(gap)
                per_layer.append({"layer_idx": layer, "regime": regime, "n_kept": total,
                                  "kept": [encode_set(k, T) for k in kept],
                                  "kept_ties": [encode_ties(t, T) for t in ties]})
            params = {"max_capacity_prompt": C, "window_size": w, "kernel_size": K, "pooling": pool,
                      "granularity": gran, "gqa_agg": agg, "beta": beta, "num_hidden_layers": NL}
            c = case_header(f"pyramidkv_factory/{n:02d}", inp, params)
            c["score_granularity"] = gran
            c["scores"] = score_block(seed, P, None, protected=[T - w, T])
            c["layers"] = per_layer
            c["checks"] = {"min_rel_gap": min(gaps)}
            return c
        cases.append(with_seed_retry(10000 + 10 * n, build)[0])
    conv = conventions(dict(ORIG_CONVENTIONS, policy=(
        "KVCache-Factory PyramidKVCluster (§4.1): integer schedule with floor division; regime 'none' if T < C "
        "(keep all), 'uniform' if T < 2(C-w) (total C every layer), else 'pyramid': min=(C-w)//beta, "
        "max=2(C-w)-min, clamp max to T-w (then min=2(C-w)-max), steps=(max-min)//(NL-1), total_l = "
        "max - l*steps + w. num_hidden_layers = 1 divides by zero in the original and is not covered. Scoring = "
        "snapkv_original (same params). 'schedule_grid' gives totals for every layer of many (T, C, w, beta, NL); "
        "cases give kept sets for some layers.")))
    return conv, cases, {"schedule_grid": factory_grid()}


def build_adakv_original():
    cases = []
    for n, (hq, hkv, d, T, base, w, K, pool, alpha, gqa, func, layer, skip) in enumerate(ADA_ORIG_CASES):
        def build(seed):
            inp = Inputs(seed, hq, hkv, T, d)
            S = adakv_original_scores(inp, w, K, pool, gqa, func)
            H, L = S.shape
            B = base - w
            compressed = not (B > L)
            if compressed:
                cap, count, floor_cap, gap0 = adakv_original_allocate(S, B, alpha, layer, skip, f"adakv_orig {n}")
                kept, ties, gaps = [], [], [gap0]
                for h in range(H):
                    k, t, g = topk_set(S[h], int(cap[h]), allow_ties=True, what=f"adakv_orig {n} head {h}")
                    kept.append(np.concatenate([k, np.arange(L, T)]))
                    ties.append(t)
                    gaps.append(g)
                gap = min(gaps)
            else:
                cap, count, floor_cap = None, None, int(B * alpha)
                kept, ties, gap = [np.arange(T)] * H, [None] * H, math.inf
            params = {"base_capacity": base, "window_size": w, "kernel_size": K, "pooling": pool,
                      "floor_alpha": alpha, "gqa_support": gqa, "gqa_func": func, "layer_idx": layer, "skip": skip,
                      "normalize": False}
            c = case_header(f"adakv_original/{n:02d}", inp, params)
            c["compressed"] = compressed
            c["past_budget"] = B
            c["floor_capacity"] = floor_cap
            c["counts"] = None if count is None else [int(x) for x in count]
            c["capacities"] = None if cap is None else [int(x) for x in cap]
            c["score_granularity"] = "kv_head" if gqa else "query_head"
            c["scores"] = score_block(seed, S, None, protected=[T - w, T])
            c["kept"] = [encode_set(k, T) for k in kept]
            c["kept_counts"] = [int(k.size) for k in kept]
            c["kept_ties"] = [encode_ties(t, T) for t in ties]
            c["checks"] = {"min_rel_gap": gap}
            return c
        cases.append(with_seed_retry(11000 + 10 * n, build)[0])
    conv = conventions(dict(ORIG_CONVENTIONS, policy=(
        "Ada-KV original (FFY0/AdaKV AdaptiveSnapKVCluster, §5.1), normalize off, batch 1. Score = MEAN over the w "
        "window queries (past tokens t < T-w), gqa_support: reduce the group with gqa_func (mean|max) BEFORE "
        "pooling (H = num_kv_heads), otherwise H = num_q_heads; pooling as snapkv_original. B = base_capacity - w. "
        "If B > L (= T-w): no compression. Else if layer_idx >= skip: counts[h] = #head-h entries in the global top "
        "H*B of the [H*L] scores (boundary is strict in every case), floor_capacity = int(B*alpha), capacities[h] "
        "= round_half_even(float32(counts[h]) * float32(1-alpha) + float32(floor_capacity)) computed in float32 "
        "(int64 tensor * python float in torch); else capacities = B. kept[h] = top capacities[h] past tokens of "
        "head h plus the whole window.")))
    return conv, cases, {}


def build_h2o_original():
    cases = []
    for n, (hq, hkv, d, T0, N, hh, rc) in enumerate(H2O_CASES):
        def build(seed):
            inp = Inputs(seed, hq, hkv, T0 + N, d)
            record = sorted({0, 1, 2, 3, N // 2, N})
            steps, gap = h2o_online(inp, T0, N, hh, rc, set(record), f"h2o {n}")
            params = {"hh_size": hh, "recent_size": rc, "prefill_len": T0, "decode_steps": N,
                      "gqa_reduce": "sum" if hq != hkv else None}
            c = case_header(f"h2o_original/{n:02d}", inp, params)
            c["score_granularity"] = "kv_head"
            c["steps"] = steps
            c["checks"] = {"min_rel_gap": gap}
            return c
        cases.append(with_seed_retry(12000 + 10 * n, build)[0])
    conv = conventions(dict(ORIG_CONVENTIONS, policy=(
        "H2O real-drop (H2OKVCache_LayerWise, §6.1), online: the sequence has seq_len = prefill_len + decode_steps "
        "tokens. Prefill: causal attention of all prefill queries, acc[j] = column sum over query rows (no "
        "normalisation); if prefill_len > hh+recent evict. Decode step s (1-based) adds token p = prefill_len+s-1: "
        "append it to the cache with acc 0, add the new query's attention row over the cache (itself included) to "
        "acc, then if the cache holds > hh+recent tokens keep the top hh_size by acc among all but the last "
        "recent_size cache slots, plus those slots (cache kept in ascending position). G > 1 (gqa_reduce 'sum', "
        "spec §6.6 option (a)): one cache and acc per kv head, acc adds the rows of all G query heads. "
        "steps[] records, after the prefill eviction (step 0) and after some decode steps, the kept positions per "
        "kv head and acc at sampled kept positions (scores.tokens are positions, scores.value acc).")))
    return conv, cases, {}


def build_tova_original():
    cases = []
    for n, (hq, hkv, d, T0, N, cs) in enumerate(TOVA_ORIG_CASES):
        def build(seed):
            inp = Inputs(seed, hq, hkv, T0 + N, d)
            record = sorted({0, 1, 2, 3, N // 2, N})
            steps, gap = tova_online(inp, T0, N, cs, set(record), f"tova {n}")
            params = {"cache_size": cs, "prefill_len": T0, "decode_steps": N}
            c = case_header(f"tova_original/{n:02d}", inp, params)
            c["score_granularity"] = "layer"
            c["steps"] = steps
            c["checks"] = {"min_rel_gap": gap}
            return c
        cases.append(with_seed_retry(13000 + 10 * n, build)[0])
    conv = conventions(dict(ORIG_CONVENTIONS, policy=(
        "TOVA original (TOVACache.reduce, §8.1), online, one selection per layer shared by all heads: "
        "s[j] = mean over ALL query heads of the newest query's attention over the cache. Prefill: the last "
        "prompt row (causal, all prefill keys); keep the top cache_size if prefill_len > cache_size. Decode step "
        "s adds token p = prefill_len+s-1 to the cache, computes its row over the cache (itself included) and keeps "
        "the top cache_size (the new token can be evicted). steps[] records per recorded step the scores s used "
        "for that step's decision (at sampled cache positions, before eviction) and the kept set after it "
        "(kept has one entry: the layer's set).")))
    return conv, cases, {}


POLICIES = {
    "snapkv_kvpress": build_snapkv_kvpress,
    "streamingllm_kvpress": build_streamingllm_kvpress,
    "tova_kvpress": build_tova_kvpress,
    "observed_attention_kvpress": build_observed_attention_kvpress,
    "expected_attention_kvpress": build_expected_attention_kvpress,
    "adakv_snapkv_kvpress": build_adakv_snapkv_kvpress,
    "adakv_expected_attention_kvpress": build_adakv_expected_attention_kvpress,
    "pyramidkv_kvpress": build_pyramidkv_kvpress,
    "snapkv_original": build_snapkv_original,
    "pyramidkv_factory": build_pyramidkv_factory,
    "adakv_original": build_adakv_original,
    "h2o_original": build_h2o_original,
    "tova_original": build_tova_original,
    "laq_original": build_laq_original,
}


# ---------------------------------------------------------------------------------------------------------------
# output

def _num(x):
    if isinstance(x, (bool, np.bool_)):
        return "true" if x else "false"
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    x = float(x)
    if math.isnan(x):
        raise ValueError("NaN in fixture")
    if math.isinf(x):
        return "null"  # only min_rel_gap uses it: no selection boundary
    if x == int(x) and abs(x) < 2 ** 53:
        return f"{int(x)}.0"
    return format(x, ".17g")


def _scalar(o):
    return o is None or isinstance(o, (bool, int, float, str, np.integer, np.floating, np.bool_))


def dumps(o, ind=0):
    import json
    pad = "  " * ind
    if o is None:
        return "null"
    if isinstance(o, str):
        return json.dumps(o)
    if _scalar(o):
        return _num(o)
    if isinstance(o, dict):
        if all((_scalar(v) and not (isinstance(v, str) and len(v) > 60 and k != "bitmap"))
               or (isinstance(v, (list, tuple)) and all(_scalar(u) for u in v)) for k, v in o.items()):
            return "{" + ", ".join(f"{json.dumps(k)}: {dumps(v)}" for k, v in o.items()) + "}"
        inner = ",\n".join(f"{pad}  {json.dumps(k)}: {dumps(v, ind + 1)}" for k, v in o.items())
        return "{\n" + inner + "\n" + pad + "}"
    if isinstance(o, (list, tuple)):
        if all(_scalar(v) for v in o):
            return "[" + ", ".join(dumps(v) for v in o) + "]"
        if all(isinstance(v, (list, tuple)) and all(_scalar(u) for u in v) for v in o):
            return "[\n" + ",\n".join(pad + "  " + dumps(v) for v in o) + "\n" + pad + "]"
        return "[\n" + ",\n".join(pad + "  " + dumps(v, ind + 1) for v in o) + "\n" + pad + "]"
    raise TypeError(type(o))


def versions():
    def v(p):
        try:
            return md.version(p)
        except md.PackageNotFoundError:
            return None
    return {"kvpress": v("kvpress"), "torch": torch.__version__, "transformers": v("transformers"),
            "numpy": np.__version__, "python": platform.python_version()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated policy names (default: all)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args()
    names = [x for x in args.only.split(",") if x] or list(POLICIES)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.time()
    for name in names:
        t0 = time.time()
        conv, cases, extra = POLICIES[name]()
        doc = {"format": "kvp-fixtures", "format_version": FORMAT_VERSION, "policy": name,
               "generated_by": "tests/reference/make_fixtures.py", "versions": versions(),
               "rng": {"recipe": R.RECIPE, "spec": "tests/reference/README.md#rng-spec"},
               "conventions": conv}
        doc.update(extra)
        doc["cases"] = cases
        path = out / f"{name}.json"
        path.write_text(dumps(doc) + "\n")
        print(f"{name}: {len(cases)} cases, {path.stat().st_size / 1024:.0f} KiB, {time.time() - t0:.1f} s",
              flush=True)
    print(f"total {time.time() - t_all:.1f} s")


if __name__ == "__main__":
    main()
