# SPDX-License-Identifier: Apache-2.0
"""Prefetch policies over a paged cache given as arrays, with caller-owned per-layer state objects.

A prefetcher predicts which physical pages of the pool the next observation of a layer reads, so an offloading
engine can copy them to the device ahead of time. Every policy here works on the key page pool (``k_pages``,
(num_pages, page_size, kv_heads, head_dim) for ``layout="NHD"`` or (num_pages, kv_heads, page_size, head_dim) for
``"HND"``, float32 / float16 / bfloat16, read in place) and the FlashInfer CSR page table (int32 ``indptr``,
``indices``, ``last_page_len``):

* ``state = policy.new_state(...)``: one per layer; its buffers are numpy arrays it owns (``state.history``, the
  policy's own: SpeCache ``codes``, ShadowKV ``landmarks`` / ``outlier``, InfiniGen ``skew`` / ``channels`` /
  ``partial_keys``).
* ``policy.on_append(state, k_pages, indptr, indices, last_page_len, append_len=None)`` after the engine writes keys
  (SpeCache, ShadowKV, InfiniGen; Quest lookahead reads Quest's own metadata, kept current by ``Quest.on_append``).
* ``pages, priority = policy.predict(state, queries, indptr, indices, last_page_len, page_size=, layer=)``: the
  request (distinct physical pages, most urgent first) from ``queries`` (batch, num_q_heads, head_dim), post-RoPE.
* ``policy.observe(state, indptr, indices)`` with the pages the step actually read (CSR rows of physical page ids,
  e.g. a :class:`kvpolicy.PageSelection`'s ``indptr`` / ``indices``): returns that step's counters and adds them to
  ``state.counters`` (hits, misses, wasted, ..., ``prediction_recall``, ``buffer_hit_rate``, ``late_miss_rate``).

:class:`OffloadSim` replays requests and reads against a finite device buffer and a link model (bytes, stalls and
the timed hit rates), for a prefetcher against fetch-on-miss and all-resident baselines.
Errors are ``ValueError`` with the library's message; nothing is written when one is raised.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from . import _core

__all__ = ["QuestLookahead", "SpeCache", "ShadowKV", "InfiniGen", "OffloadSim"]


def _spec(name: str, **params: Any) -> str:
    from . import spec_string
    return spec_string(name, **params)


def _f32(a: Any) -> Any:
    if isinstance(a, np.ndarray) and a.dtype != np.float32:
        return a.astype(np.float32)
    if hasattr(a, "dtype") and str(getattr(a, "dtype", "")) in ("torch.float16", "torch.bfloat16", "torch.float64"):
        return a.float()
    return a


class _Prefetcher:
    _core_cls: Any = None
    policy_name = ""

    def __init__(self, **params: Any) -> None:
        self._spec_text = _spec(self.policy_name, **params)
        self._impl = type(self)._core_cls(self._spec_text)

    @property
    def spec(self) -> str:
        return self._spec_text

    def predict(self, state: Any, queries: Any, indptr: Any, indices: Any, last_page_len: Any, *, page_size: int,
                layer: int = 0) -> Tuple[np.ndarray, np.ndarray]:
        """The request for the next observation of ``layer``: (pages int32, priority float32), most urgent first."""
        return self._impl.predict(state, _f32(queries), indptr, indices, last_page_len, int(page_size), int(layer))

    def observe(self, state: Any, indptr: Any, indices: Any) -> dict:
        """Counts the pages a step read (CSR rows of physical page ids) into ``state``; returns this step's counters."""
        return self._impl.observe(state, indptr, indices)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._spec_text!r})"


class _Appending(_Prefetcher):
    def on_append(self, state: Any, k_pages: Any, indptr: Any, indices: Any, last_page_len: Any, *,
                  append_len: Any = None, layout: str = "NHD") -> None:
        """The appended tokens' state (``append_len`` int32 per sequence; None: every token of the table)."""
        self._impl.on_append(state, k_pages, indptr, indices, last_page_len, append_len, layout)

    def new_state(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int) -> Any:
        """The state of one layer over a pool of ``num_pages`` pages."""
        return self._impl.new_state(int(num_pages), int(page_size), int(num_kv_heads), int(head_dim))


class QuestLookahead(_Prefetcher):
    """Quest-page lookahead (next step): the pages whose Quest upper bound for the current query is highest (a
    ``page_budget`` per row, last page included), plus (``reuse_previous``) the pages the previous step read, at
    priority 0. Its state reads a float32 :class:`kvpolicy.QuestState` (kept current by ``Quest.on_append``)."""

    _core_cls = _core.QuestLookaheadPolicy
    policy_name = "quest_lookahead"

    def __init__(self, *, page_budget: Optional[int] = None, reuse_previous: Optional[bool] = None,
                 dense_layers: Optional[int] = None, gqa: Optional[str] = None) -> None:
        super().__init__(page_budget=page_budget, reuse_previous=reuse_previous, dense_layers=dense_layers, gqa=gqa)

    def new_state(self, quest_state: Any) -> Any:
        """A state over Quest's page metadata (a float32 QuestState, or its ``data`` array; not copied)."""
        return self._impl.new_state(getattr(quest_state, "data", quest_state))


class SpeCache(_Appending):
    """SpeCache (next token): a low-bit ggml copy of every key (``type``, q4_0 by default) on the fast tier; the
    speculative query's GQA-mean softmax over the copy, top ``topk`` tokens per kv head, their pages requested."""

    _core_cls = _core.SpeCachePolicy
    policy_name = "specache"

    def __init__(self, *, type: Optional[str] = None, topk: Optional[int] = None, dense_layers: Optional[int] = None) -> None:
        super().__init__(type=type, topk=topk, dense_layers=dense_layers)

    def row_bytes(self, head_dim: int) -> int:
        return self._impl.row_bytes(int(head_dim))


class ShadowKV(_Appending):
    """ShadowKV-style landmarks: per chunk of ``chunk_size`` tokens the mean key and the min cosine (outliers kept
    resident), the local tail, the top ``chunk_budget`` chunks by softmax over landmarks, and the previous step's
    pages (priority -1)."""

    _core_cls = _core.ShadowKVPolicy
    policy_name = "shadowkv"

    def __init__(self, *, chunk_size: Optional[int] = None, chunk_budget: Optional[int] = None,
                 outlier_chunks: Optional[int] = None, local_chunks: Optional[int] = None,
                 reuse_previous: Optional[bool] = None, dense_layers: Optional[int] = None) -> None:
        super().__init__(chunk_size=chunk_size, chunk_budget=chunk_budget, outlier_chunks=outlier_chunks,
                         local_chunks=local_chunks, reuse_previous=reuse_previous, dense_layers=dense_layers)


class InfiniGen(_Appending):
    """InfiniGen (next layer): ``prepare`` computes per kv head the skewing matrix and the partial channels from the
    prompt's queries and the partial keys; ``predict`` takes the speculative query of layer ``layer`` (the caller's
    projection of the previous layer's attention input) and requests the pages of the tokens within ``alpha`` of
    the best partial logit (one k for all heads, at most ``max_num_kv``)."""

    _core_cls = _core.InfiniGenPolicy
    policy_name = "infinigen"

    def __init__(self, *, alpha: Optional[float] = None, partial_ratio: Optional[float] = None,
                 max_num_kv: Optional[int] = None, dense_layers: Optional[int] = None, skew: Optional[bool] = None) -> None:
        super().__init__(alpha=alpha, partial_ratio=partial_ratio, max_num_kv=max_num_kv, dense_layers=dense_layers,
                         skew=skew)

    def prepare(self, state: Any, queries: Any, k_pages: Any, indptr: Any, indices: Any, last_page_len: Any, *,
                layout: str = "NHD") -> None:
        """Prefill: ``queries`` (num_q_heads, W, head_dim) post-RoPE prompt queries; every token of the table."""
        self._impl.prepare(state, _f32(queries), k_pages, indptr, indices, last_page_len, layout)


class OffloadSim:
    """The offload simulator: a device buffer of ``device_pages`` pages per layer, a link of ``bandwidth_gb_s`` with
    ``latency_us`` per copy batch, pages of ``page_bytes``; ``mode`` "prefetch" (the requests, then demand fetches),
    "fetch_on_miss" or "all_resident". ``step(layer, request, needed, overlap_us)`` returns the step's report
    (hits, late, demand, bytes, stall_us, ...); ``totals`` sums them with the timed hit rates."""

    def __init__(self, *, page_bytes: float, device_pages: int, num_layers: int, pool_pages: int, mode: str = "prefetch",
                 bandwidth_gb_s: float = 25.0, latency_us: float = 10.0) -> None:
        self._impl = _core.OffloadSim(float(bandwidth_gb_s), float(latency_us), float(page_bytes), int(device_pages), mode,
                                      int(num_layers), int(pool_pages))

    def step(self, layer: int, request: Any, needed: Any, overlap_us: float = 0.0) -> dict:
        return self._impl.step(int(layer), request, needed, float(overlap_us))

    @property
    def totals(self) -> dict:
        return self._impl.totals

    @property
    def mode(self) -> str:
        return self._impl.mode

    def resident(self, layer: int) -> int:
        return self._impl.resident(int(layer))
