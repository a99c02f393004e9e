#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Cross-check fixtures of CaM, LOOK-M (pivot merge) and MiniCache, transcribed from the original code.

Writes tests/data/fixtures/merge_original.json, read by tests/policy/merging/test_merge_original_fixtures.cpp.
Never run by CI (the JSON file is committed). Inputs are small, sampled here with numpy on a 1/256 grid (exact in
float32 and in JSON) and stored in the file, so the C++ side needs no generator.

    python3 -m venv /work/.venv-ref
    /work/.venv-ref/bin/pip install torch==2.15.0 numpy==2.4.6
    /work/.venv-ref/bin/python tests/reference/make_merge_original_fixtures.py     # ~3 s, deterministic

The reference arithmetic is re-written here (our own code, no lines copied) from these sources:

CaM (zyxxmu/cam @ fc80e64f460b343be96c87596f2494fc9d319c45), in torch float32 with torch's CPU generator:
  * `cam_streaming`: `generate_task/streaming_llm/kv_cache_cam.py`, `StartRecentKVCache_cam.__call__` + `slicev`.
    Tokens arrive one per step (as in the repository's streaming evaluation); the attention row of the step is
    added to the accumulated attention; once the cache holds start + recent + 1 tokens, the token at cache position
    `start` leaves: p = A[e] / mean(A[e+1 : e+1+16]) (NaN -> 0, then clamp to [0, 1]), m ~ Bernoulli(p) per head,
    V[e+1 : e+1+16] += m V[e] / 16 (fewer than 16 tokens when recent < 16, still divided by 16), then position
    `start` is dropped from the cache and from the accumulated attention. Our CaM is stateless, so the fixture
    calls `torch.manual_seed(seed_base + step)` before each step's `torch.bernoulli` (the original seeds once per
    run; with one seed per step the draws are the ones our policy makes from `MergeInput::seed`).
  * `cam_prefill`: `cam_hf/utils_lm_eval/modify_llama_cam.py::local_cam_mask` (merge_budget = recent), one
    `torch.manual_seed(seed)` before the loop; the in-place cascade over V is kept.
  * Our extensions, transcribed the way cam.hpp documents them (flagged `extension` in the case): GQA (the
    original is MHA; attention is averaged over each kv head's query heads, draws are per kv head); `merge_num`
    other than 16 (a constant in the original); a NaN p in the prefill form (the original has no NaN guard there
    and `torch.bernoulli` raises on NaN: we use the streaming form's NaN -> 0).
  * Attention rows are synthetic non-negative values on a 1/64 grid (not softmax outputs; the merge only reads
    them), so accumulated sums are exact in float32. Every draw is checked to be at least 1e-6 away from its
    probability (recomputed in float64), so a float32 implementation with another summation order makes the
    same draws; seeds are bumped until that holds.

LOOK-M pivot merge (SUSTechBruce/LOOK-M @ ecf0f51a9c416c2d85e47faf2638502f01a6d748,
`LLaVA-mix_merge_v1/llava/model/kv_token_merge/modify_llama.py`, `PivotKVCache_LayerWise.__call__`, the
"before-merge" block), in float64 numpy (the stored expectation) and in torch float32 (checked against it):
  * kept tokens per head in ascending order (the original gathers them with a boolean mask, so K and V rows are the
    same tokens) and the head's evicted tokens, ascending; c = argmax over kept of cos(K[e], K[c]); K~_e =
    (K[e] + K[c]) / 2; K[c] <- mean({K[c]} u {K~_e : e -> c}) (`scatter_reduce` 'mean', include_self); V the same
    with the same c. Ties: the first maximum in ascending kept order, i.e. the earliest kept token
    (`torch.max(dim)` returns the first maximal index); tied cases use exactly duplicated kept keys.
  * This is what lookm.hpp implements. The copy of this code shared by the KVCache-Factory family (`merge_kv`, read
    in noforit/Lookahead_Q-Cache @ 74612bddbae421e5aed443ecaea3ce60e1df892a, `pyramidkv/pyramidkv_utils.py`)
    concatenates keys as [recent, selected] and values as [selected, recent] (K/V rows misaligned) and builds the
    drop set over indices flattened across heads, window tokens included; `verbatim_shared_code` at the top level
    records what that code does on one small input (documentation only; no C++ test reads it).
    Zefan-Cai/KVCache-Factory @ c97f9d706d63d1b56e980f8b81b2a924c21162b3 has since fixed both (aligned
    [selected, recent], per-head drop mask) and agrees with this transcription when `indices` are ascending.
  * Our extension: keep sets of different sizes per head (the original keeps the same number in every head).
  * Head dim is hard-coded to 128 in the original; any head_dim here. Keys are on a 1/256 grid and never zero
    (the original divides by the norm without eps), except in one `zero_evicted_key` extension case (see
    lookm.hpp: it merges into the earliest kept token, as the original's NaN row would); every non-tied argmax has
    a relative gap >= 1e-5.

MiniCache (Liu et al., arXiv 2405.14366): no code by the authors is public. AkideLiu/MiniCache
@ f1baccacba6bc83dc499f5db9257576397bb4ed8 is the project page only (its "Code" link points to itself; its
`static/images/CLKV_Algorithm.jpg` is the method figure, without formulas). The reference is the paper's formulas
as restated in our notes (shared/docs/reference/algorithms-other.md §5.5), in float64 numpy: u = x^{l-1}/|x^{l-1}|,
w = x^l/|x^l|, Omega = arccos(u.w), e = sin((1-t)Omega)/sin Omega u + sin(t Omega)/sin Omega w (normalised lerp
when sin Omega < 1e-6), both norms kept; angular distance d = Omega/pi, a token is retained (stored unmerged) iff
d > d_min + gamma (d_max - d_min) over the head's tokens (evaluated as (1 - gamma) d_min + gamma d_max, exact at
gamma = 0 and 1; gamma = 1 retains nothing); a zero vector takes the other layer's direction (d = 0).
The retention rule and the defaults t = 0.6, gamma = 0.05 are marked unverified in our notes (the paper's §4 text
could not be read here). A third-party re-implementation, Zefan-Cai/KVCache-Factory @ d2a034019eeeff588b4927872e5bb7b39e4ce50a
`pyramidkv/minicache.py`, retains the top ceil(ratio * T) distances instead of thresholding, clamps the cosine to
[-1 + 1e-6, 1 - 1e-6] and renormalises the SLERP result; it is not used as the reference.
"""
from __future__ import annotations

import json
import math
import platform
import sys
from pathlib import Path

import numpy as np
import torch

torch.set_num_threads(1)
OUT = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "merge_original.json"

PROVENANCE = {
    "cam": {
        "repo": "zyxxmu/cam", "commit": "fc80e64f460b343be96c87596f2494fc9d319c45",
        "streaming": "generate_task/streaming_llm/kv_cache_cam.py: StartRecentKVCache_cam.__call__, slicev",
        "prefill": "cam_hf/utils_lm_eval/modify_llama_cam.py: local_cam_mask",
        "rng": "torch CPU generator: torch.manual_seed + torch.bernoulli (float32 p)",
    },
    "lookm": {
        "repo": "SUSTechBruce/LOOK-M", "commit": "ecf0f51a9c416c2d85e47faf2638502f01a6d748",
        "file": "LLaVA-mix_merge_v1/llava/model/kv_token_merge/modify_llama.py: PivotKVCache_LayerWise.__call__ (before-merge block)",
        "shared_copy": "noforit/Lookahead_Q-Cache@74612bddbae421e5aed443ecaea3ce60e1df892a pyramidkv/pyramidkv_utils.py: merge_kv (K/V misaligned, cross-head drop set; see verbatim_shared_code)",
        "fixed_copy": "Zefan-Cai/KVCache-Factory@c97f9d706d63d1b56e980f8b81b2a924c21162b3 pyramidkv/pyramidkv_utils.py: merge_kv (aligned, per-head)",
    },
    "minicache": {
        "paper": "arXiv 2405.14366 (MiniCache), formulas as restated in shared/docs/reference/algorithms-other.md 5.5",
        "code": "none public by the authors: AkideLiu/MiniCache@f1baccacba6bc83dc499f5db9257576397bb4ed8 is a project page",
        "third_party": "Zefan-Cai/KVCache-Factory@d2a034019eeeff588b4927872e5bb7b39e4ce50a pyramidkv/minicache.py (top-k retention; not the reference)",
    },
}


def num(x):
    """A float32 value as its shortest decimal (ints for integers): exact after a float32 round trip."""
    f = np.float32(x)
    if float(f).is_integer() and abs(f) < 2**24:
        return int(f)
    return float(str(f))


def flat(a):
    return [num(x) for x in np.asarray(a, dtype=np.float32).ravel()]


def grid(rs, shape, scale=1.0):
    return (np.round(rs.standard_normal(shape) * scale * 256) / 256).astype(np.float32)


def torch_uniforms(seed, n):
    rs = np.random.RandomState(seed)  # init_genrand(seed): torch.manual_seed(seed)'s mt19937 state
    x = rs.randint(0, 2**32, size=n, dtype=np.uint64)
    return (x & 0xFFFFFF).astype(np.float64) / 2**24


def margin_ok(p64, u):
    """A draw u < p is stable under float32 rounding of p when p is 0, >= 1, or at least 1e-6 away from u."""
    return p64 == 0.0 or p64 >= 1.0 or np.isnan(p64) or abs(u - p64) >= 1e-6


# ----------------------------------------------------------------------------------------------------- CaM
def attention_row(rs, Hq, ids, pattern, importance):
    """One step's attention (Hq, n) over the cache's token ids: a 1/64-grid value times the token's importance
    (a power of two, fixed per token, so that the leaving token is often less attended than its window and
    accumulated sums stay exact), some exact zeros. `pattern[h]` = 'dense' or ('sparse', k): only ids
    divisible by k get weight (zero sums: NaN and inf probabilities)."""
    n = len(ids)
    row = np.zeros((Hq, n), dtype=np.float32)
    for h in range(Hq):
        w = rs.randint(1, 17, size=n).astype(np.float32) / 64 * importance[ids]
        if pattern[h] == "dense":
            w[rs.rand(n) < 0.15] = 0
        else:
            k = pattern[h][1]
            w[[i % k != 0 for i in ids]] = 0
        row[h] = w
    return row


def cam_streaming_case(rs, H, G, S, R, d, steps, seed_base, merge_num=16, patterns=None):
    Hq = H * G
    patterns = patterns or ["dense"] * Hq
    values = grid(rs, (H, steps, d))
    row_seed = rs.randint(2**31)
    importance = (2.0 ** rs.randint(-4, 3, size=steps)).astype(np.float32)
    for _ in range(50):  # bump the seeds until every draw has a margin
        arow = np.random.RandomState(row_seed)
        cache_v = torch.zeros((H, 0, d))
        accum, ids = None, []
        draws, rows, margin, ok = [], [], math.inf, True
        n_clamped = n_nan = 0
        for s in range(steps):
            cache_v = torch.cat([cache_v, torch.from_numpy(values[:, s : s + 1])], dim=1)
            ids.append(s)
            n = cache_v.shape[1]
            row = attention_row(arow, Hq, np.array(ids), patterns, importance)
            rows.append(row)
            r = torch.from_numpy(row)
            accum = r.clone() if accum is None else torch.cat([r[:, : accum.shape[1]] + accum, r[:, accum.shape[1] :]], dim=1)
            if n <= S + R:
                continue
            start = n - R  # = S + 1: the leaving token is at cache position start - 1 = S
            a = accum if G == 1 else accum.view(H, G, n).mean(dim=1)  # GQA: extension
            prob = a[:, start - 1] / a[:, start : start + merge_num].mean(dim=-1)
            prob[torch.isnan(prob)] = 0
            torch.manual_seed(seed_base + s)
            m = torch.bernoulli(prob.clamp(min=0, max=1))
            to_merge = cache_v[:, start - 1] * m[:, None] / merge_num
            cache_v[:, start : start + merge_num] += to_merge[:, None, :]
            # float64 probabilities (the accumulated sums are exact) and the margin of each draw
            acc64 = accum.double().numpy()
            a64 = acc64 if G == 1 else acc64.reshape(H, G, n).mean(axis=1)
            u = torch_uniforms(seed_base + s, H)
            for h in range(H):
                num, den = a64[h, start - 1], a64[h, start : start + merge_num].mean()
                p64 = num / den if den != 0 else (math.nan if num == 0 else math.inf)
                n_nan += bool(np.isnan(p64))
                n_clamped += bool(p64 >= 1)
                ok = ok and margin_ok(p64, u[h])
                if not (p64 == 0 or p64 >= 1 or np.isnan(p64)):
                    margin = min(margin, abs(u[h] - p64))
            draws.append([int(x) for x in m.tolist()])
            accum = torch.cat([accum[:, : start - 1], accum[:, start:]], dim=1)
            cache_v = torch.cat([cache_v[:, :S], cache_v[:, start:]], dim=1)
            ids = ids[:S] + ids[start:]
        if ok:
            break
        seed_base += 1000
    else:
        raise RuntimeError("no seed with stable draws")
    ext = (["gqa"] if G > 1 else []) + (["merge_num"] if merge_num != 16 else [])
    return {
        "kind": "cam_streaming", "H": H, "G": G, "start": S, "recent": R, "merge_num": merge_num, "d": d, "steps": steps,
        "seed_base": seed_base, "extension": ext, "patterns": [p if p == "dense" else f"sparse{p[1]}" for p in patterns],
        "values": flat(values), "attention": [x for r in rows for x in flat(r)],
        "draws": draws, "final_ids": ids, "final_values": flat(cache_v.numpy()),
        "checks": {"min_draw_margin": None if margin == math.inf else float(margin),
                   "p_clamped_to_1": n_clamped, "p_nan_to_0": n_nan},
    }


def cam_prefill_case(rs, H, G, S, R, T, d, seed, zero_block=None):
    Hq = H * G
    values = grid(rs, (H, T, d))
    A = np.zeros((Hq, T, T), dtype=np.float32)
    for q in range(Hq):
        for i in range(T):
            cols = [j for j in range(i + 1) if j < S or j >= i - R]  # the original's sinks + recent band, causal
            A[q, i, cols] = rs.randint(1, 65, size=len(cols)) / 64
            if zero_block is not None and q // G in zero_block[0]:
                A[q, i, :S] = 0
                A[q, i, zero_block[1] : zero_block[2]] = 0
    for _ in range(50):
        V = torch.from_numpy(values.copy())
        At = torch.from_numpy(A)
        Akv = At if G == 1 else At.view(H, G, T, T).mean(dim=1)  # GQA: extension
        torch.manual_seed(seed)
        draws, ok, margin, nan_seen = [], True, math.inf, False
        events = max(T - S - R, 0)
        u = torch_uniforms(seed, events * H).reshape(max(events, 1), H) if events else None
        A64 = A.astype(np.float64) if G == 1 else A.astype(np.float64).reshape(H, G, T, T).mean(axis=1)
        for t in range(S + R, T):
            a = Akv[:, :t, :t].mean(dim=-2)
            ref = torch.cat([a[:, :S], a[:, t - R : t]], dim=-1).max(dim=-1)[0]
            prob = a[:, t - R] / ref
            if torch.isnan(prob).any():  # the original would raise in torch.bernoulli: extension (NaN -> 0)
                nan_seen = True
                prob[torch.isnan(prob)] = 0
            m = torch.bernoulli(prob.clamp(min=0, max=1))
            V[:, t - R + 1 : t - R + R + 1] += (V[:, t - R] * m[:, None] / R)[:, None, :]
            draws.append([int(x) for x in m.tolist()])
            a64 = A64[:, :t, :t].sum(axis=1) / t
            for h in range(H):
                r64 = max(np.max(a64[h, :S]) if S else 0.0, np.max(a64[h, t - R : t]))
                p64 = a64[h, t - R] / r64 if r64 > 0 else (math.nan if a64[h, t - R] == 0 else math.inf)
                if not margin_ok(p64, u[t - S - R, h]):
                    ok = False
                if not (p64 == 0 or p64 >= 1 or np.isnan(p64)):
                    margin = min(margin, abs(u[t - S - R, h] - p64))
        if ok:
            break
        seed += 1000
    else:
        raise RuntimeError("no seed with stable draws")
    n_kept = min(T, S + R)
    kept = list(range(T)) if T <= S + R else list(range(S)) + list(range(T - R, T))
    ext = (["gqa"] if G > 1 else []) + (["nan_p"] if nan_seen else [])
    return {
        "kind": "cam_prefill", "H": H, "G": G, "start": S, "recent": R, "T": T, "d": d, "seed": seed, "extension": ext,
        "values": flat(values), "attention": flat(A), "draws": draws, "kept": kept,
        "kept_values": flat(V.numpy()[:, kept]), "n_kept": n_kept,
        "checks": {"min_draw_margin": None if margin == math.inf else float(margin), "nan_p_seen": nan_seen},
    }


# -------------------------------------------------------------------------------------------------- LOOK-M
def lookm_fp64(K, V, kept):
    """Pivot merge per head in float64; returns targets (slot per evicted, ascending), merged K/V rows, gap, ties."""
    H, T, d = K.shape
    out_t, out_k, out_v, ties, gap = [], [], [], [], math.inf
    for h in range(H):
        kp = list(kept[h])
        ev = [j for j in range(T) if j not in set(kp)]
        Kh, Vh = K[h].astype(np.float64), V[h].astype(np.float64)
        kn = {j: Kh[j] / np.linalg.norm(Kh[j]) for j in range(T)}
        tg = []
        for e in ev:
            sims = [float(np.dot(kn[e], kn[c])) for c in kp]
            best = int(np.argmax(sims))  # first maximum: the earliest kept token
            tied = [i for i, s in enumerate(sims) if s == sims[best] and i != best]
            if tied:
                assert all(np.array_equal(K[h, kp[i]], K[h, kp[best]]) for i in tied), "ties must come from duplicated keys"
                ties.append([h, e])
            others = [s for i, s in enumerate(sims) if not np.array_equal(K[h, kp[i]], K[h, kp[best]])]
            if others:
                gap = min(gap, (sims[best] - max(others)) / abs(sims[best]))
            tg.append(best)
        mk, mv = Kh[kp].copy(), Vh[kp].copy()
        cnt = np.zeros(len(kp))
        sk, sv = np.zeros_like(mk), np.zeros_like(mv)
        for e, c in zip(ev, tg):
            sk[c] += (Kh[e] + Kh[kp[c]]) / 2
            sv[c] += (Vh[e] + Vh[kp[c]]) / 2
            cnt[c] += 1
        mk = (mk + sk) / (1 + cnt)[:, None]
        mv = (mv + sv) / (1 + cnt)[:, None]
        out_t.append(tg)
        out_k.append(mk)
        out_v.append(mv)
    return out_t, out_k, out_v, ties, gap


def lookm_torch(K, V, kept):
    """The original's torch ops in float32, one head at a time (boolean-mask gathers: ascending token order)."""
    H, T, d = K.shape
    res_k, res_v, res_t = [], [], []
    for h in range(H):
        mask = torch.zeros(T, dtype=torch.bool)
        mask[list(kept[h])] = True
        k, v = torch.from_numpy(K[h]), torch.from_numpy(V[h])
        k_rec, v_rec, k_pr, v_pr = k[mask], v[mask], k[~mask], v[~mask]
        if k_pr.shape[0] == 0:
            res_k.append(k_rec.numpy())
            res_v.append(v_rec.numpy())
            res_t.append([])
            continue
        sim = (k_pr / torch.norm(k_pr, dim=-1, keepdim=True)) @ (k_rec / torch.norm(k_rec, dim=-1, keepdim=True)).T
        _, idx = sim.max(dim=-1)
        gi = idx[:, None].expand(-1, d)
        k_m = (k_pr + torch.gather(k_rec, 0, gi)) / 2
        v_m = (v_pr + torch.gather(v_rec, 0, gi)) / 2
        res_k.append(torch.scatter_reduce(k_rec, 0, gi, k_m, reduce="mean", include_self=True).numpy())
        res_v.append(torch.scatter_reduce(v_rec, 0, gi, v_m, reduce="mean", include_self=True).numpy())
        res_t.append(idx.tolist())
    return res_t, res_k, res_v


def lookm_case(rs, H, T, d, n_kept, dup_kept=0, near_dup=0.3, ragged=False, zero_evicted=False):
    for _ in range(100):
        K = grid(rs, (H, T, d))
        V = grid(rs, (H, T, d), scale=2.0)
        kept = []
        for h in range(H):
            c = n_kept + (h % 3 if ragged else 0)
            kept.append(sorted(rs.choice(T, min(c, T), replace=False).tolist()))
        for h in range(H):
            ks = kept[h]
            ev = [j for j in range(T) if j not in set(ks)]
            # several evicted tokens near one kept token: they choose the same partner
            for e in ev:
                if rs.rand() < near_dup and ks:
                    src = ks[rs.randint(len(ks))]
                    K[h, e] = np.round((K[h, src] + 0.25 * rs.standard_normal(d)) * 256) / 256
            # exactly duplicated kept keys: ties, resolved to the earliest kept token
            for _i in range(dup_kept):
                if len(ks) >= 2:
                    a, b = sorted(rs.choice(len(ks), 2, replace=False))
                    K[h, ks[b]] = K[h, ks[a]]
                    if ev:  # an evicted key close to the duplicated pair
                        e = ev[rs.randint(len(ev))]
                        K[h, e] = np.round((K[h, ks[a]] + 0.1 * rs.standard_normal(d)) * 256) / 256
            if zero_evicted and ev:
                K[h, ev[0]] = 0  # not in the original's domain (0/0); see lookm.hpp
        if (np.linalg.norm(K, axis=-1) == 0).any() and not zero_evicted:
            continue
        # zero_evicted: our cosine clamps the norm (1e-8), so a zero evicted key has cos 0 with every kept key and
        # merges into the earliest kept token, which is also what the original's all-NaN row gives (torch.max
        # returns the first NaN's index); the float64 transcription uses the clamped form (lookm_fp64_safe).
        targets, mk, mv, ties, gap = lookm_fp64_safe(K, V, kept)
        if gap < 1e-5:
            continue
        if dup_kept and not ties:
            continue
        if not zero_evicted:
            tt, tk, tv = lookm_torch(K, V, kept)
            assert tt == targets, "torch float32 argmax differs from the float64 transcription"
            for h in range(H):
                scale = max(1e-30, np.abs(mk[h]).max(), np.abs(mv[h]).max())
                assert np.abs(tk[h] - mk[h]).max() <= 2e-6 * scale and np.abs(tv[h] - mv[h]).max() <= 2e-6 * scale
        break
    else:
        raise RuntimeError("no tie-free LOOK-M input")
    ext = (["ragged_keep"] if ragged else []) + (["zero_evicted_key"] if zero_evicted else [])
    return {
        "kind": "lookm_pivot", "H": H, "T": T, "d": d, "extension": ext,
        "keys": flat(K), "values": flat(V), "kept": kept, "targets": targets,
        "merged_keys": [flat(m) for m in mk], "merged_values": [flat(m) for m in mv],
        "ties": ties, "checks": {"min_rel_gap": None if gap == math.inf else float(gap)},
    }


def lookm_fp64_safe(K, V, kept):
    """lookm_fp64 with a zero key mapped to cos 0 (norm clamped), for the zero_evicted extension case."""
    if not (np.linalg.norm(K, axis=-1) == 0).any():
        return lookm_fp64(K, V, kept)
    H, T, d = K.shape
    Kc = K.astype(np.float64)
    out_t, out_k, out_v, ties, gap = [], [], [], [], math.inf
    for h in range(H):
        kp = list(kept[h])
        ev = [j for j in range(T) if j not in set(kp)]
        nrm = lambda x: x / max(np.linalg.norm(x), 1e-8)  # noqa: E731
        tg = []
        for e in ev:
            sims = [float(np.dot(nrm(Kc[h, e]), nrm(Kc[h, c]))) for c in kp]
            best = int(np.argmax(sims))
            others = [s for i, s in enumerate(sims) if not np.array_equal(K[h, kp[i]], K[h, kp[best]])]
            if np.linalg.norm(Kc[h, e]) > 0 and others:
                gap = min(gap, (sims[best] - max(others)) / abs(sims[best]))
            tg.append(best)
        Vh = V[h].astype(np.float64)
        mk, mv = Kc[h, kp].copy(), Vh[kp].copy()
        cnt = np.zeros(len(kp))
        sk, sv = np.zeros_like(mk), np.zeros_like(mv)
        for e, c in zip(ev, tg):
            sk[c] += (Kc[h, e] + Kc[h, kp[c]]) / 2
            sv[c] += (Vh[e] + Vh[kp[c]]) / 2
            cnt[c] += 1
        out_t.append(tg)
        out_k.append((mk + sk) / (1 + cnt)[:, None])
        out_v.append((mv + sv) / (1 + cnt)[:, None])
    return out_t, out_k, out_v, ties, gap


def lookm_verbatim_doc(rs):
    """What the shared KVCache-Factory-family `merge_kv` (LAQ repository) does on one small input, head_dim 128."""
    H, T, d, window = 2, 10, 128, 2
    K = grid(rs, (H, T, d))
    V = grid(rs, (H, T, d))
    # top-k of the non-window prefix, per head (same count per head, different tokens)
    indices = [[1, 4, 6], [0, 4, 7]]
    k, v = torch.from_numpy(K)[None], torch.from_numpy(V)[None]
    idx = torch.tensor(indices)[None]
    gi = idx[..., None].expand(-1, -1, -1, d)
    sel_k, sel_v = k.gather(2, gi), v.gather(2, gi)
    allidx = torch.arange(T)[None, None].expand(1, H, T)
    drop_flat = allidx.flatten()[~torch.isin(allidx.flatten(), idx.flatten())]
    drop = drop_flat.reshape(1, H, -1)
    di = drop[..., None].expand(-1, -1, -1, d)
    kp, vp = k.gather(2, di), v.gather(2, di)
    k_rec = torch.cat([k[:, :, -window:], sel_k], dim=2)  # [recent, selected]
    v_rec = torch.cat([sel_v, v[:, :, -window:]], dim=2)  # [selected, recent]
    sim = (kp / torch.norm(kp, dim=-1, keepdim=True)) @ (k_rec / torch.norm(k_rec, dim=-1, keepdim=True)).transpose(-1, -2)
    _, mi = sim.max(dim=-1)
    key_row_tokens = [[T - window + i for i in range(window)] + indices[h] for h in range(H)]
    value_row_tokens = [indices[h] + [T - window + i for i in range(window)] for h in range(H)]
    # Our per-head, aligned version on the same keep set (selected + window, per head).
    kept = [sorted(indices[h] + list(range(T - window, T))) for h in range(H)]
    targets, _, _, _, _ = lookm_fp64(K, V, kept)
    return {
        "source": PROVENANCE["lookm"]["shared_copy"], "H": H, "T": T, "d": d, "window_size": window, "indices": indices,
        "drop_set_per_head": drop[0].tolist(),
        "note": "the drop set is the tokens no head selected (torch.isin over all heads' indices), window tokens "
                "included (each is its own pivot, cos 1, and counts in its own mean); rows of the merged keys and "
                "values hold different tokens, so V[c] is updated with the pivot chosen for another token's key",
        "key_row_tokens": key_row_tokens, "value_row_tokens": value_row_tokens,
        "verbatim_pivot_rows": mi[0].tolist(),
        "verbatim_pivot_key_tokens": [[key_row_tokens[h][r] for r in mi[0, h].tolist()] for h in range(H)],
        "verbatim_pivot_value_tokens": [[value_row_tokens[h][r] for r in mi[0, h].tolist()] for h in range(H)],
        "per_head_aligned_drop_set": [[j for j in range(T) if j not in kept[h]] for h in range(H)],
        "per_head_aligned_pivot_tokens": [[kept[h][c] for c in targets[h]] for h in range(H)],
    }


# ----------------------------------------------------------------------------------------------- MiniCache
def minicache_fp64(P, Q, t, gamma):
    H, T, d = P.shape
    P64, Q64 = P.astype(np.float64), Q.astype(np.float64)
    npv, nqv = np.linalg.norm(P64, axis=-1), np.linalg.norm(Q64, axis=-1)
    direc = np.zeros((H, T, d))
    dist = np.zeros((H, T))
    lerp = []
    for h in range(H):
        for j in range(T):
            a, b, na, nb = P64[h, j], Q64[h, j], npv[h, j], nqv[h, j]
            if na == 0 and nb == 0:
                continue
            ua = a / na if na > 0 else b / nb
            ub = b / nb if nb > 0 else a / na
            cs = 1.0 if (na == 0 or nb == 0) else float(np.clip(np.dot(ua, ub), -1, 1))
            om = math.acos(cs)
            so = math.sin(om)
            if so >= 1e-6:
                e = math.sin((1 - t) * om) / so * ua + math.sin(t * om) / so * ub
            else:
                lerp.append([h, j])
                e = (1 - t) * ua + t * ub
                n = np.linalg.norm(e)
                e = e / n if n > 0 else e
            direc[h, j] = e
            dist[h, j] = om / math.pi
    retained, margin = [], math.inf
    for h in range(H):
        lo, hi = dist[h].min(), dist[h].max()
        thr = (1 - gamma) * lo + gamma * hi + (1.0 if hi == lo else 0.0)  # = lo + gamma (hi - lo), exact ends
        retained.append([j for j in range(T) if dist[h, j] > thr])
        for j in range(T):
            if (gamma == 0 and dist[h, j] == lo) or (gamma == 1 and dist[h, j] == hi) or hi == lo:
                continue
            margin = min(margin, abs(dist[h, j] - thr))
    return npv, nqv, direc, dist, retained, margin, lerp


def minicache_case(rs, H, T, d, t, gamma, specials=()):
    """Pairs with angles spread over ~5..120 degrees; `specials` add exact cases at fixed tokens:
    'parallel' (cur = 2 prev), 'near' (one coordinate moved by 1/256), 'opposite' (cur = -prev), 'zero_prev'."""
    for _ in range(200):
        P = grid(rs, (H, T, d))
        Q = np.zeros_like(P)
        for h in range(H):
            for j in range(T):
                mix = rs.uniform(0.05, 1.6)
                Q[h, j] = np.round((P[h, j] + mix * rs.standard_normal(d).astype(np.float32)) * rs.uniform(0.5, 2) * 256) / 256
        for h in range(H):
            for k, s in enumerate(specials):
                j = (3 * k + h) % T
                if s == "parallel":
                    Q[h, j] = 2 * P[h, j]
                elif s == "near":
                    Q[h, j] = P[h, j]
                    Q[h, j, 0] += 1 / 256
                elif s == "opposite":
                    Q[h, j] = -P[h, j]
                elif s == "zero_prev":
                    P[h, j] = 0
        if (np.linalg.norm(Q, axis=-1) == 0).any():
            continue
        res = minicache_fp64(P, Q, t, gamma)
        if res[5] >= 1e-3:
            break
    else:
        raise RuntimeError("no MiniCache input with a retention margin")
    npv, nqv, direc, dist, retained, margin, lerp = res
    return {
        "kind": "minicache", "H": H, "T": T, "d": d, "t": t, "gamma": gamma, "specials": list(specials),
        "prev": flat(P), "cur": flat(Q), "norm_prev": flat(npv), "norm_cur": flat(nqv), "direction": flat(direc),
        "distance": flat(dist), "retained": retained, "lerp_fallback": lerp,
        "checks": {"min_retention_margin": None if margin == math.inf else float(margin)},
    }


def main():
    rs = np.random.RandomState(20240512)
    cases = []
    # CaM streaming: (H, G, start, recent, d, steps, seed, merge_num, head patterns)
    for (H, G, S, R, d, steps, seed, M, pat) in [
        (2, 1, 2, 6, 8, 24, 11, 16, None),                                     # recent < 16: short window, / 16
        (3, 1, 4, 20, 4, 34, 12, 16, None),                                    # full 16-token window
        (2, 1, 1, 5, 8, 22, 13, 16, ["dense", ("sparse", 7)]),                 # NaN -> 0 and inf -> 1 (sparse head)
        (4, 1, 0, 4, 4, 18, 14, 16, [("sparse", 3), "dense", ("sparse", 5), "dense"]),  # no sinks
        (2, 2, 2, 5, 4, 20, 15, 16, None),                                     # GQA 4/2 (extension)
        (2, 3, 2, 16, 4, 30, 16, 16, ["dense"] * 5 + [("sparse", 4)]),         # GQA 6/2, window = recent = 16
        (2, 1, 2, 9, 4, 24, 17, 4, None),                                      # merge_num 4 (extension)
    ]:
        c = cam_streaming_case(rs, H, G, S, R, d, steps, seed, M, pat)
        c["id"] = f"cam_streaming/{len([x for x in cases if x['kind'] == 'cam_streaming']):02d}"
        cases.append(c)
    # CaM prefill: (H, G, start, recent, T, d, seed, zero block)
    for (H, G, S, R, T, d, seed, zb) in [
        (2, 1, 2, 4, 20, 8, 21, None),       # recent a power of 2
        (1, 1, 0, 3, 16, 4, 22, None),       # no sinks, recent 3
        (2, 1, 1, 5, 24, 4, 23, None),
        (2, 2, 1, 5, 22, 4, 24, None),       # GQA 4/2 (extension)
        (2, 4, 3, 8, 20, 4, 25, None),       # GQA 8/2 (extension)
        (2, 1, 1, 2, 18, 4, 26, ([1], 8, 14)),  # zero columns in head 1: ref = 0 -> NaN p (extension)
        (2, 1, 2, 4, 6, 4, 27, None),        # T = start + recent: no event
    ]:
        c = cam_prefill_case(rs, H, G, S, R, T, d, seed, zb)
        c["id"] = f"cam_prefill/{len([x for x in cases if x['kind'] == 'cam_prefill']):02d}"
        cases.append(c)
    # LOOK-M: (H, T, d, n_kept, dup_kept, near_dup, ragged, zero_evicted)
    for (H, T, d, nk, dup, near, rag, z) in [
        (1, 8, 4, 3, 0, 0.5, False, False),
        (2, 16, 8, 5, 0, 0.4, False, False),
        (4, 24, 8, 8, 0, 0.3, False, False),
        (2, 28, 12, 10, 0, 0.5, False, False),
        (2, 20, 8, 1, 0, 0.0, False, False),     # one kept token: every evicted token picks it
        (3, 18, 8, 6, 1, 0.3, False, False),     # duplicated kept keys: ties -> earliest kept token
        (2, 24, 16, 8, 2, 0.3, False, False),    # more ties
        (3, 20, 8, 6, 0, 0.4, True, False),      # ragged keep sets (extension)
        (2, 12, 8, 12, 0, 0.0, False, False),    # nothing evicted
        (2, 14, 8, 5, 0, 0.3, False, True),      # a zero evicted key (extension)
    ]:
        c = lookm_case(rs, H, T, d, nk, dup, near, rag, z)
        c["id"] = f"lookm_pivot/{len([x for x in cases if x['kind'] == 'lookm_pivot']):02d}"
        cases.append(c)
    # MiniCache: (H, T, d, t, gamma, specials)
    for (H, T, d, t, g, sp) in [
        (1, 12, 8, 0.6, 0.05, ()),
        (2, 24, 12, 0.6, 0.3, ("parallel", "near")),
        (2, 20, 8, 0.5, 0.5, ("opposite",)),
        (3, 16, 8, 0.25, 0.2, ("opposite", "parallel")),
        (2, 16, 8, 0.0, 0.4, ()),
        (2, 16, 8, 1.0, 0.4, ("near",)),
        (2, 18, 8, 0.6, 0.0, ()),
        (2, 12, 4, 0.6, 1.0, ()),
        (2, 16, 8, 0.6, 0.25, ("zero_prev", "opposite")),
    ]:
        c = minicache_case(rs, H, T, d, t, g, sp)
        c["id"] = f"minicache/{len([x for x in cases if x['kind'] == 'minicache']):02d}"
        cases.append(c)
    doc = {
        "format": "kvp-merge-fixtures", "format_version": 1, "generated_by": "tests/reference/make_merge_original_fixtures.py",
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__},
        "provenance": PROVENANCE,
        "conventions": {
            "layout": "row-major: values/keys/prev/cur (H, T, d); CaM attention: streaming = each step's (H*G, n_step) rows "
                      "concatenated, n_step = min(step + 1, start + recent + 1); prefill = (H*G, T, T)",
            "cam_streaming": "one token per step; draws[k] = the per-kv-head Bernoulli outcomes of the k-th step with an "
                             "eviction (step = start + recent + k), seed = seed_base + step; final_values = the cache after "
                             "the last step (H, start + recent, d), token ids final_ids",
            "cam_prefill": "draws[k] = outcomes of the event t = start + recent + k, one seed; kept = start + recent set; "
                           "kept_values = V at the kept tokens after the cascade (H, n_kept, d)",
            "lookm_pivot": "kept[h] ascending; targets[h][i] = kept slot chosen by the i-th evicted token of head h "
                           "(ascending); merged_keys/values[h] = (n_kept_h, d) rows in kept order (unmerged rows equal "
                           "the input); ties = [head, evicted token] pairs whose argmax was tied (earliest kept wins)",
            "minicache": "norms (H, T), direction (H, T, d) unit vectors (0 for two zero rows), distance = Omega / pi, "
                         "retained[h] ascending token ids; lerp_fallback = [head, token] where sin Omega < 1e-6 in float64",
            "extension": "features beyond the original code, transcribed as our header documents them",
            "tolerance": "CaM streaming: bit-exact (grid inputs; every update is one fp32 add of an exactly scaled value); "
                         "CaM prefill: values within 1e-6 of the row's max |value|, draws exact (margin >= 1e-6); LOOK-M: "
                         "targets exact, merged rows within 2e-6 of the row's max |value| (float64 reference); MiniCache: "
                         "retained sets exact (margin >= 1e-3), norms 1e-6 relative, directions 2e-5 absolute, "
                         "distances 2e-4 absolute (float32 acos near +-1)",
        },
        "verbatim_shared_code": lookm_verbatim_doc(rs),
        "cases": cases,
    }
    OUT.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(cases)} cases)", file=sys.stderr)


if __name__ == "__main__":
    main()
