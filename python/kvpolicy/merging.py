# SPDX-License-Identifier: Apache-2.0
"""Merging policies: fold the tokens an eviction drops into the kept ones.

Each policy's ``merge(keys, values, keep, ...)`` reads one sequence's keys / values (kv_heads, kv_len, head_dim),
float32 or float16, in place, and a :class:`kvpolicy.KeepSet` (any eviction's decision, one row per kv head, or
``KeepSet(indptr, indices)`` built from int32 arrays), and returns a :class:`MergePlan`. :func:`merge_contiguous`
(or ``plan.apply(...)``) writes the merged rows into a contiguous cache in place, compacting it to the keep set.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from . import _core

__all__ = ["MergePlan", "KvpressMerging", "KvpressCAM", "CaM", "LookMPivot", "NearestKeptMerge", "NearestKeptState", "D2O",
           "D2OState", "MiniCache", "MiniCacheStore", "merge_contiguous"]


class MergePlan:
    """A merge decision: row ``h`` (a kv head) folds evicted token ``src[e]`` into kept slot ``dst[e]`` (a position in
    the keep row) with coefficient ``weight[e]``, for e in ``[indptr[h], indptr[h + 1])``.

    ``merged_keys`` / ``merged_values``: float32 (kv_heads, slots, head_dim), the merged row of kept slot c of head h
    at ``[h, c]``; only slots some entry targets are written (the others are NaN). None where the policy does not
    merge that half (kvpress MergingPress merges values only) or it was not asked for. ``keep`` is the KeepSet the
    plan was made for.
    """

    __slots__ = ("indptr", "dst", "src", "weight", "merged_keys", "merged_values", "keep")

    def __init__(self, indptr: Any, dst: Any, src: Any, weight: Any, merged_keys: Any, merged_values: Any,
                 keep: Any) -> None:
        self.indptr, self.dst, self.src, self.weight = indptr, dst, src, weight
        self.merged_keys, self.merged_values, self.keep = merged_keys, merged_values, keep

    @property
    def num_rows(self) -> int:
        return len(self.indptr) - 1

    def row(self, r: int):
        """(dst, src, weight) of row r (views)."""
        b, e = int(self.indptr[r]), int(self.indptr[r + 1])
        return self.dst[b:e], self.src[b:e], self.weight[b:e]

    def apply(self, keys: Any, values: Any, kv_len: int, *, compact: bool = True, positions: Any = None):
        """:func:`merge_contiguous` with this plan."""
        return merge_contiguous(keys, values, kv_len, self, compact=compact, positions=positions)

    def __repr__(self) -> str:
        return f"MergePlan(rows={self.num_rows}, entries={int(self.indptr[-1]) if self.num_rows >= 0 else 0})"


def _plan(t: tuple, keep: Any) -> MergePlan:
    return MergePlan(*t, keep)


def merge_contiguous(keys: Any, values: Any, kv_len: int, plan: MergePlan, *, compact: bool = True,
                     positions: Any = None) -> Optional[np.ndarray]:
    """Writes the plan's merged rows into a contiguous cache in place (keys / values (kv_heads, capacity, head_dim),
    any strides; either may be None when the plan does not merge it). ``compact=True`` (the library's
    ``merge_and_compact_contiguous``): the cache (and positions, (kv_heads, capacity) int32) is compacted to the plan's
    keep set, the merged rows land in the kept slots, and the new length per head (int64) is returned.
    ``compact=False`` (``merge_contiguous``): the rows are written at the kept tokens' original slots, nothing moves,
    None is returned. kv_len: the length before eviction. Everything is validated before the first write."""
    k = plan.keep
    return _core.merge_contiguous(keys, values, kv_len, k.indptr, k.indices, plan.indptr, plan.dst, plan.src,
                                  plan.weight, plan.merged_keys, plan.merged_values, compact, positions)


class KvpressMerging:
    """kvpress 0.5.5 ``MergingPress``'s merge: each evicted value folds into the kept token of most similar key (cosine),
    weighted by similarity and value norms, gated by ``similarity_threshold`` and ``merge_fraction``. Values only."""

    name = "kvpress_merging"

    def __init__(self, *, similarity_threshold: float = 0.0, merge_fraction: float = 1.0) -> None:
        self.similarity_threshold, self.merge_fraction = float(similarity_threshold), float(merge_fraction)

    def merge(self, keys: Any, values: Any, keep: Any) -> MergePlan:
        return _plan(_core.kvpress_merge(self.similarity_threshold, self.merge_fraction, keys, values, keep.indptr,
                                         keep.indices), keep)


class KvpressCAM:
    """kvpress 0.5.5 ``CAMPress``'s merge step (Cache Merging batched over a decode interval): ``evict(scores,
    target_size)`` keeps the top ``target_size`` tokens by head-mean score (the same in every kv head);
    ``merge(values, keep, attention_sums=, scores=, new_tokens=-1, seed=0)`` spreads each merge candidate's value over
    the next ``merge_budget`` kept tokens with Bernoulli draws equal to torch's CPU generator after
    ``torch.manual_seed(seed)``. Values only; ``keys`` may be None."""

    name = "kvpress_cam"

    def __init__(self, *, merge_budget: int = 32) -> None:
        self.merge_budget = int(merge_budget)

    def evict(self, scores: Any, target_size: int):
        """Keep set (one row per kv head, identical rows) from the base press's scores (kv_heads, kv_len) float32."""
        from . import KeepSet
        ip, ids = _core.cam_evict(self.merge_budget, scores, int(target_size))
        return KeepSet(ip, ids)

    def merge(self, values: Any, keep: Any, *, attention_sums: Any, scores: Any = None, new_tokens: int = -1,
              seed: int = 0, keys: Any = None) -> MergePlan:
        """attention_sums: (kv_heads or q_heads, kv_len) float32, the attention summed over the interval; scores
        (kv_heads, kv_len) float32, needed when new_tokens is below the evicted count (-1: every evicted token)."""
        return _plan(_core.cam_merge(self.merge_budget, keys, values, keep.indptr, keep.indices, attention_sums, scores,
                                     int(new_tokens), int(seed)), keep)


class CaM:
    """CaM (Zhang et al., ICML 2024; zyxxmu/cam): values of evicted tokens merged into kept ones with Bernoulli draws
    (torch's CPU generator after ``torch.manual_seed(seed)``, one draw per (event, kv head)); keys of evicted tokens
    are dropped. ``form="streaming"`` (the decode step, ``slicev``): each evicted token e spreads ``V[e] / merge_num``
    over the next ``merge_num`` kept tokens with probability clamp(A[e] / mean A[window], 0, 1), A the accumulated
    attention ``attention_sums`` (kv_heads or q_heads, kv_len) float32. ``form="prefill"`` (``local_cam_mask``): a
    start + recent cache simulated over the prompt's full attention ``attention`` (q_heads, kv_len, kv_len) float32;
    the keep set must be that start + recent set (``kvpolicy.StreamingLLM(sinks=start, tokens=start + recent)``)."""

    name = "cam"

    def __init__(self, *, form: str = "streaming", merge_num: int = 16, start: int = 4, recent: int = 512) -> None:
        self.form, self.merge_num, self.start, self.recent = str(form), int(merge_num), int(start), int(recent)

    def merge(self, values: Any, keep: Any, *, attention_sums: Any = None, attention: Any = None, seed: int = 0,
              keys: Any = None) -> MergePlan:
        return _plan(_core.cam_orig_merge(self.form, self.merge_num, self.start, self.recent, keys, values, keep.indptr,
                                          keep.indices, attention_sums, attention, int(seed)), keep)


class MiniCacheStore:
    """MiniCache's merged store of one half (keys or values) of a layer pair: ``direction`` (kv_heads, T, head_dim)
    unit SLERP directions, ``norm_prev`` / ``norm_cur`` (kv_heads, T) the two layers' norms, and the retained tokens
    (``retained``: a KeepSet of ascending token ids per kv head; ``retained_prev`` / ``retained_cur``: their original
    rows (retained count, head_dim), in that order); float32 arrays owned by the store."""

    __slots__ = ("direction", "norm_prev", "norm_cur", "retained", "retained_prev", "retained_cur")

    def __init__(self, direction: Any, norm_prev: Any, norm_cur: Any, retained: Any, retained_prev: Any,
                 retained_cur: Any) -> None:
        self.direction, self.norm_prev, self.norm_cur = direction, norm_prev, norm_cur
        self.retained, self.retained_prev, self.retained_cur = retained, retained_prev, retained_cur

    def __repr__(self) -> str:
        h, t, d = self.direction.shape
        return f"MiniCacheStore(kv_heads={h}, tokens={t}, head_dim={d}, retained={int(self.retained.indptr[-1])})"


class MiniCache:
    """MiniCache (Liu et al., NeurIPS 2024, arXiv 2405.14366): the caches of two adjacent layers l-1 and l merged in
    depth. ``merge(prev, cur)`` reads one half (keys or values, (kv_heads, T, head_dim), float32 / float16 /
    bfloat16, in place) of both layers and returns a :class:`MiniCacheStore`: per token the SLERP (parameter ``t``)
    of the two directions and both norms; tokens whose angular distance exceeds d_min + gamma (d_max - d_min) are
    retained unmerged. ``restore(store, layer, out=None)`` rebuilds layer l-1 (``layer=0``) or l (``layer=1``)."""

    name = "minicache"

    def __init__(self, *, t: float = 0.6, gamma: float = 0.05) -> None:
        self.t, self.gamma = float(t), float(gamma)

    @staticmethod
    def bytes_per_token(head_dim: int, retained_fraction: float) -> float:
        """Bytes per (token, kv head) of the pair in the fp32 store, for a retained fraction."""
        return 4.0 * (head_dim + 2.0) + retained_fraction * 8.0 * head_dim

    def merge(self, prev: Any, cur: Any) -> MiniCacheStore:
        from . import KeepSet
        d, np_, nc, rip, rid, rp, rc = _core.minicache_merge(self.t, self.gamma, prev, cur)
        return MiniCacheStore(d, np_, nc, KeepSet(rip, rid), rp, rc)

    def restore(self, store: MiniCacheStore, layer: int, out: Any = None, dtype: Any = np.float32) -> Any:
        """Layer l-1 (0) or l (1) as (kv_heads, T, head_dim): norm x direction, retained rows the originals; into a
        new array of ``dtype`` or the caller's ``out`` (float32 / float16 / bfloat16, any strides)."""
        if out is None:
            out = np.empty(store.direction.shape, dtype=dtype)
        r = store.retained
        _core.minicache_restore(store.direction, store.norm_prev, store.norm_cur, r.indptr, r.indices, store.retained_prev,
                                store.retained_cur, int(layer), out)
        return out


class LookMPivot:
    """LOOK-M's pivot merge: each evicted token is averaged with its most similar kept token (its pivot) and the
    pivot becomes the mean of itself and those averages; keys and values share the assignment."""

    name = "lookm_pivot"

    def merge(self, keys: Any, values: Any, keep: Any, *, merge_keys: bool = True, merge_values: bool = True) -> MergePlan:
        return _plan(_core.lookm_merge(keys, values, keep.indptr, keep.indices, merge_keys, merge_values), keep)


class NearestKeptState:
    """NearestKeptMerge's caller-owned per-slot masses: ``weights`` (kv_heads, capacity) float32, > 0."""

    def __init__(self, kv_heads: int, capacity: int, weight: float = 1.0) -> None:
        if not (np.isfinite(weight) and weight > 0):
            raise ValueError(f"nearest_kept: initial weight {weight} must be finite and > 0")
        self.weights = np.full((kv_heads, capacity), weight, dtype=np.float32)

    def init(self, head: int, begin: int, end: int, weight: float = 1.0) -> None:
        """Slots [begin, end) of a head get mass `weight` (fresh tokens)."""
        if not (np.isfinite(weight) and weight > 0):
            raise ValueError(f"nearest_kept: initial weight {weight} must be finite and > 0")
        h, c = self.weights.shape
        if not (0 <= head < h and 0 <= begin <= end <= c):
            raise ValueError(f"nearest_kept: slots [{begin}, {end}) of head {head} are outside the state ({h}, {c})")
        self.weights[head, begin:end] = weight


class NearestKeptMerge:
    """The library's nearest-kept weighted merge with persistent per-slot masses (a :class:`NearestKeptState`): every
    evicted token with cosine >= ``threshold`` folds into its most similar kept token as a running weighted mean; on
    success the state's weights are re-packed in kept order (as a compaction with the same keep set)."""

    name = "nearest_kept"

    def __init__(self, *, threshold: float = -1.0, scale_by_similarity: bool = False) -> None:
        self.threshold, self.scale_by_similarity = float(threshold), bool(scale_by_similarity)

    def new_state(self, kv_heads: int, capacity: int, weight: float = 1.0) -> NearestKeptState:
        return NearestKeptState(kv_heads, capacity, weight)

    def merge(self, keys: Any, values: Any, keep: Any, state: NearestKeptState, *, merge_keys: bool = True,
              merge_values: bool = True) -> MergePlan:
        return _plan(_core.nearest_merge(self.threshold, self.scale_by_similarity, keys, values, keep.indptr,
                                         keep.indices, state.weights, merge_keys, merge_values), keep)


class D2OState:
    """D2O's caller-owned EMA threshold of one (layer, sequence): ``tau``, ``initialised``."""

    __slots__ = ("tau", "initialised")

    def __init__(self, tau: float = 0.0, initialised: bool = False) -> None:
        self.tau, self.initialised = float(tau), bool(initialised)

    def __repr__(self) -> str:
        return f"D2OState(tau={self.tau!r}, initialised={self.initialised})"


class D2O:
    """D2O's token level (Wan et al., ICLR 2025): ``evict(scores)`` keeps the sinks, the top-``heavy`` of the older
    tokens by accumulated attention and the last ``recent``; ``merge(keys, values, keep, state)`` folds the i-th
    evicted token of every head into its nearest kept token when the head-mean similarity reaches the EMA threshold
    (``state``, updated only on success). ``weighting``: ``"as_coded"`` (divide by the count, as D2O's code) or
    ``"normalized"`` (by the weight sum)."""

    name = "d2o"

    def __init__(self, *, heavy: int = 128, recent: int = 128, sinks: int = 4, alpha: float = 0.5, beta: float = 0.5,
                 weighting: str = "as_coded") -> None:
        self._args = (int(heavy), int(recent), int(sinks), float(alpha), float(beta), str(weighting))

    def new_state(self) -> D2OState:
        return D2OState()

    def evict(self, scores: Any):
        """Keep set (one row per kv head) from accumulated attention ``scores`` (kv_heads, kv_len) float32."""
        from . import KeepSet
        ip, ids = _core.d2o_evict(*self._args, scores)
        return KeepSet(ip, ids)

    def merge(self, keys: Any, values: Any, keep: Any, state: D2OState, *, merge_keys: bool = True,
              merge_values: bool = True) -> MergePlan:
        t, tau, init = _core.d2o_merge(*self._args, keys, values, keep.indptr, keep.indices, state.tau,
                                       state.initialised, merge_keys, merge_values)
        state.tau, state.initialised = tau, init
        return _plan(t, keep)
