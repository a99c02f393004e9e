# SPDX-License-Identifier: Apache-2.0
"""kvpolicy for Python: the library's KV-cache policies on numpy arrays and torch tensors.

Arrays are read in place (DLPack / the buffer protocol, no copy of keys or values): float32, float16 and
bfloat16 (bfloat16 through torch), any strides with a contiguous last axis. Decisions come back as a
:class:`KeepSet` (CSR rows of kept token ids, one row per (sequence, kv head)).

    import numpy as np, kvpolicy
    keys = np.random.randn(8, 4096, 128).astype(np.float16)          # (kv_heads, kv_len, head_dim)
    queries = np.random.randn(32, 64, 128).astype(np.float32)        # (q_heads, window, head_dim), post-RoPE
    keep = kvpolicy.SnapKV(compression_ratio=0.5, window=64).evict(queries=queries, keys=keys)
    print(keep.dense().shape)                                        # (8, 2048): kept ids per kv head, ascending

Every policy of the registry is listed by :func:`policies` and built by :func:`make` (``make("snapkv",
compression_ratio=0.5, window=64)``) or by its class (:class:`SnapKV`, ...); keyword parameters are the ones the
C++ ``Params::fields()`` declare, and errors raise ``ValueError`` with the library's message.

Quantization (:class:`Quantizer`, :class:`KiviCache`), Quest's page selection over a paged cache given as arrays
(:class:`Quest`) and cache compaction (:func:`compact_contiguous`, :func:`compact_paged`) work on the caller's arrays
the same way.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from . import _core
from ._core import HeadShard, KiviCache, Quantizer, QuestState, get_num_threads, set_num_threads

__version__: str = _core.__version__
#: The CPU backend's instruction set chosen at run time (avx512, avx2 or sse2; KVP_CPU_ISA forces one).
isa: str = _core.isa

__all__ = [
    "__version__", "isa", "policies", "PolicyInfo", "Param", "make", "spec_string", "KeepSet", "Policy",
    "EvictionPolicy", "H2O", "H2OState", "compact_contiguous", "set_num_threads", "get_num_threads",
    "Quantizer", "KiviCache", "make_quantizer", "make_quantizers", "Quest", "QuestState", "PageSelection",
    "compact_paged", "MixedPrecision", "HeadShard", "quantize_paged_append", "quantized_page_meta_append",
    "quantized_paged_decode_attention",
]


@dataclasses.dataclass(frozen=True)
class Param:
    """One keyword parameter: its key, its default in spec syntax and its doc."""

    name: str
    default: str
    doc: str


@dataclasses.dataclass(frozen=True)
class PolicyInfo:
    """A registry entry: name (spec name), family, paper, params, and the Python class that builds it."""

    name: str
    family: str
    paper: str
    params: Tuple[Param, ...]
    cls: Optional[type]
    bound: bool  # whether this build's Python layer can call it

    @property
    def doc(self) -> str:
        return f"{self.name} ({self.family}): {self.paper}"


def _format_value(key: str, v: Any) -> str:
    if isinstance(v, (bool, np.bool_)):
        return "true" if v else "false"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        return repr(float(v))
    if isinstance(v, str):
        if any(c in v for c in ",:="):
            raise ValueError(f"parameter {key}={v!r}: a value may not contain ',', ':' or '='")
        return v
    raise TypeError(f"parameter {key}: expected bool, int, float or str, got {type(v).__name__}")


def spec_string(name: str, **params: Any) -> str:
    """The registry spec ``name:key=value,...`` of keyword parameters (None values are left out)."""
    items = [f"{k}={_format_value(k, v)}" for k, v in params.items() if v is not None]
    return name + (":" + ",".join(items) if items else "")


class KeepSet:
    """An eviction decision: row ``r`` (= seq * rows_per_seq + head) keeps ``indices[indptr[r]:indptr[r + 1]]``, ascending.

    ``indptr`` (rows + 1) and ``indices`` (total kept) are int32 numpy arrays (or the caller's own output arrays);
    ``batch`` is the leading batch extent of a batched call (None: one sequence).
    """

    __slots__ = ("indptr", "indices", "batch")

    def __init__(self, indptr: Any, indices: Any, batch: Optional[int] = None) -> None:
        self.indptr = indptr
        self.indices = indices
        self.batch = batch

    @property
    def num_rows(self) -> int:
        return len(self.indptr) - 1

    def __len__(self) -> int:
        return self.num_rows

    def row(self, r: int) -> Any:
        """The kept token ids of row r (a view)."""
        if not -self.num_rows <= r < self.num_rows:
            raise IndexError(f"KeepSet row {r} out of range [0, {self.num_rows})")
        r %= self.num_rows
        return self.indices[int(self.indptr[r]):int(self.indptr[r + 1])]

    def counts(self) -> np.ndarray:
        """Tokens kept per row (int64)."""
        p = np.asarray(self.indptr, dtype=np.int64)
        return p[1:] - p[:-1]

    @property
    def uniform(self) -> bool:
        c = self.counts()
        return bool(c.size == 0 or (c == c[0]).all())

    def dense(self) -> np.ndarray:
        """Kept ids as one (rows, n) int32 array (batched: (batch, rows_per_seq, n)); rows must keep equal counts."""
        if not self.uniform:
            raise ValueError("KeepSet rows keep different numbers of tokens (per-head budgets); use row(r) or mask(kv_len)")
        n = int(self.counts()[0]) if self.num_rows else 0
        out = np.asarray(self.indices[:n * self.num_rows]).reshape(self.num_rows, n)
        return out if self.batch is None else out.reshape(self.batch, self.num_rows // self.batch, n)

    def mask(self, kv_len: int) -> np.ndarray:
        """(rows, kv_len) bool: True where a token is kept."""
        m = np.zeros((self.num_rows, kv_len), dtype=bool)
        rows = np.repeat(np.arange(self.num_rows), self.counts())
        m[rows, np.asarray(self.indices[:len(rows)])] = True
        return m

    def __repr__(self) -> str:
        c = self.counts()
        return f"KeepSet(rows={self.num_rows}, kept={int(c.sum())}, per_row={'%d' % c[0] if self.uniform and c.size else 'ragged'})"


class Policy:
    """Base of every policy object: ``name`` and ``spec`` (the registry spec string it was built from)."""

    policy_name: str = ""

    @property
    def spec(self) -> str:
        return self._spec  # type: ignore[attr-defined]

    @property
    def name(self) -> str:
        return self.policy_name or self._spec.split(":", 1)[0]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._spec!r})"


class EvictionPolicy(Policy):
    """A one-shot eviction policy of the registry (every erased entry), built from a spec string.

    ``evict`` reads, per sequence, keys (num_kv_heads, kv_len, head_dim) and as the policy needs them queries
    (num_q_heads, q_len, head_dim; post-RoPE, the last q_len positions), values (like keys), attention
    (num_q_heads, q_len, kv_len) or column_sums (num_q_heads, kv_len); a leading batch axis on every array gives a
    batch. Immutable; safe to share between threads.
    """

    def __init__(self, spec: str) -> None:
        self._spec = spec
        self._impl = _core.EvictionPolicy(spec)

    def kept_count(self, kv_len: int) -> int:
        """Tokens kept per row for a sequence of kv_len tokens (-1 when invalid)."""
        return self._impl.kept_count(kv_len)

    def protected_tokens(self, kv_len: int) -> int:
        """Tokens kept by rule (observation window, sinks)."""
        return self._impl.protected_tokens(kv_len)

    @property
    def has_scores(self) -> bool:
        """Whether :meth:`score` gives per-token scores (every erased policy but StreamingLLM, which is positional)."""
        return self._impl.has_scores

    def score(self, queries: Any = None, keys: Any = None, values: Any = None, *, attention: Any = None,
              column_sums: Any = None, lookahead: int = 0, backend: str = "cpu", out: Any = None) -> np.ndarray:
        """Per-token scores, float32 (num_kv_heads, kv_len) (a batch: (batch, num_kv_heads, kv_len)), from the same
        arrays as :meth:`evict`: higher = keep, protected tokens (window, sinks) ``+inf``. :meth:`evict` keeps each
        row's ``kept_count`` best (equal scores: the later token). Ada-KV and PyramidKV give their SnapKV scorer's map.
        ``out``: a caller-owned writable float32 array of that shape (any strides), written only on success.
        ``ValueError`` for a policy without scores (StreamingLLM)."""
        return self._impl.score(keys, queries, values, attention, column_sums, lookahead, backend, out)

    def evict(self, queries: Any = None, keys: Any = None, values: Any = None, *, attention: Any = None,
              column_sums: Any = None, lookahead: int = 0, backend: str = "cpu",
              out: Optional[Tuple[Any, Any]] = None, shard: Optional[HeadShard] = None) -> KeepSet:
        """The decision as a :class:`KeepSet`. ``out=(indptr, indices)``: caller-owned int32 outputs, written in place.
        ``shard``: a :class:`HeadShard` when the arrays hold this rank's heads of a tensor-parallel layer; Ada-KV's
        layer-wide budget is then decided together with the other ranks (:mod:`kvpolicy.distributed`)."""
        indptr, indices = (None, None) if out is None else out
        ip, ids = self._impl.evict(keys, queries, values, attention, column_sums, lookahead, backend, indptr, indices, shard)
        batch = keys.shape[0] if keys is not None and len(keys.shape) == 4 else None
        if out is None:
            ids = ids[:int(ip[-1])]
        return KeepSet(ip, ids, batch)


class H2OState:
    """H2O's caller-owned state of one sequence (one layer): accumulated attention per cache slot."""

    def __init__(self, rows: int, capacity: int) -> None:
        self._impl = _core.H2OState(rows, capacity)

    @property
    def scores(self) -> np.ndarray:
        """(rows, capacity) float32 accumulated attention (a view of the state)."""
        return self._impl.scores

    @property
    def length(self) -> int:
        return self._impl.length

    @property
    def prompt_len(self) -> int:
        return self._impl.prompt_len

    @property
    def capacity(self) -> int:
        return self._impl.capacity

    def reset(self) -> None:
        self._impl.reset()


class H2O(Policy):
    """H2O (online eviction; Zhang et al. 2023, arXiv 2306.14048): heavy hitters + recent slots, caller-owned state.

    Per forward call: ``update(state, ...)`` with the call's attention (num_q_heads, q_len, kv_len), its column sums
    (num_q_heads, kv_len) or its queries and the cached keys; then ``evict(state)`` gives the kept slots per state row
    (and re-packs the state) for the caller to compact its cache with (:func:`compact_contiguous`).
    """

    policy_name = "h2o"

    def __init__(self, *, hh_size: Optional[int] = None, heavy_ratio: Optional[float] = None,
                 recent_size: Optional[int] = None, recent_ratio: Optional[float] = None,
                 group_reduce: Optional[str] = None, granularity: Optional[str] = None,
                 scale: Optional[float] = None) -> None:
        self._spec = spec_string("h2o", hh_size=hh_size, heavy_ratio=heavy_ratio, recent_size=recent_size,
                                 recent_ratio=recent_ratio, group_reduce=group_reduce, granularity=granularity,
                                 scale=scale)
        self._impl = _core.H2OPolicy(self._spec)

    @classmethod
    def _from_spec(cls, spec: str) -> "H2O":
        self = cls.__new__(cls)
        self._spec = spec
        self._impl = _core.H2OPolicy(spec)
        return self

    def cache_size(self, prompt_len: int = 0) -> int:
        """hh + recent: the cache size an evict trims to."""
        return self._impl.cache_size(prompt_len)

    def new_state(self, num_q_heads: int, num_kv_heads: int, capacity: int) -> H2OState:
        """A zeroed state for a cache of at most `capacity` slots."""
        return H2OState(self._impl.state_rows(num_q_heads, num_kv_heads), capacity)

    def update(self, state: H2OState, *, keys: Any = None, queries: Any = None, attention: Any = None,
               column_sums: Any = None) -> None:
        self._impl.update(state._impl, keys, queries, attention, column_sums)

    def evict(self, state: H2OState, num_coming: int = 0) -> KeepSet:
        ip, ids = self._impl.evict(state._impl, num_coming)
        return KeepSet(ip, ids[:int(ip[-1])])


class PageSelection:
    """A page selection (Quest): row ``r`` (= seq * heads_per_seq + head) attends the physical pages
    ``indices[indptr[r]:indptr[r + 1]]`` (ascending logical order, the sequence's last page last), the last of them
    holding ``last_page_len[r]`` tokens; ``logical`` gives each entry's page position in its sequence. The arrays are a
    FlashInfer ``kv_indptr`` / ``kv_indices`` / ``kv_last_page_len`` request as they are (int32 numpy arrays).
    """

    __slots__ = ("indptr", "indices", "last_page_len", "logical")

    def __init__(self, indptr: Any, indices: Any, last_page_len: Any, logical: Any) -> None:
        self.indptr, self.indices, self.last_page_len, self.logical = indptr, indices, last_page_len, logical

    @property
    def num_rows(self) -> int:
        return len(self.indptr) - 1

    def __len__(self) -> int:
        return self.num_rows

    def row(self, r: int) -> Any:
        """The physical page ids of row r (a view)."""
        if not -self.num_rows <= r < self.num_rows:
            raise IndexError(f"PageSelection row {r} out of range [0, {self.num_rows})")
        r %= self.num_rows
        return self.indices[int(self.indptr[r]):int(self.indptr[r + 1])]

    def logical_row(self, r: int) -> Any:
        """The logical page positions of row r (a view)."""
        r %= self.num_rows
        return self.logical[int(self.indptr[r]):int(self.indptr[r + 1])]

    def __repr__(self) -> str:
        return f"PageSelection(rows={self.num_rows}, pages={int(self.indptr[-1]) if self.num_rows else 0})"


class Quest(Policy):
    """Quest (query-aware page selection; Tang et al. 2024, arXiv 2406.10774) over a paged cache given as arrays.

    The cache is a key page pool ``k_pages`` ((num_pages, page_size, kv_heads, head_dim) for ``layout="NHD"``,
    (num_pages, kv_heads, page_size, head_dim) for ``"HND"``; any strides with contiguous rows) and a FlashInfer CSR
    page table (int32 ``indptr`` (batch + 1), ``indices``, ``last_page_len`` (batch)). The page metadata (channel max /
    min of each page's keys) lives in a :class:`QuestState` the caller owns: ``new_state``, then ``on_append`` after
    keys are written, then ``select`` per decode step. Nothing is evicted; ``select`` says which pages to attend.
    """

    policy_name = "quest"

    def __init__(self, *, token_budget: Optional[int] = None, keep_ratio: Optional[float] = None,
                 compression_ratio: Optional[float] = None, page_budget: Optional[int] = None,
                 dense_layers: Optional[int] = None, gqa: Optional[str] = None) -> None:
        self._spec = spec_string("quest", token_budget=token_budget, keep_ratio=keep_ratio,
                                 compression_ratio=compression_ratio, page_budget=page_budget,
                                 dense_layers=dense_layers, gqa=gqa)
        self._impl = _core.QuestPolicy(self._spec)

    @classmethod
    def _from_spec(cls, spec: str) -> "Quest":
        self = cls.__new__(cls)
        self._spec = spec
        self._impl = _core.QuestPolicy(spec)
        return self

    @property
    def dense_layers(self) -> int:
        return self._impl.dense_layers

    def page_budget(self, page_size: int, seq_tokens: int = 0) -> int:
        """Pages attended per head (the last page included) for a sequence of seq_tokens tokens."""
        return self._impl.page_budget(page_size, seq_tokens)

    def new_state(self, num_pages: int, num_kv_heads: int, head_dim: int, dtype: Any = "float32") -> QuestState:
        """Empty metadata for a pool of num_pages pages: float32, or float16 for float16 keys."""
        return QuestState(num_pages, num_kv_heads, head_dim, np.dtype(dtype).name)

    def on_append(self, state: QuestState, k_pages: Any, indptr: Any, indices: Any, last_page_len: Any, *,
                  append_len: Any = None, layout: str = "NHD") -> None:
        """Folds the keys just written into the metadata. The table already counts them; ``append_len`` (int32,
        per sequence) says how many tokens are new (None: rebuild every page the table references)."""
        self._impl.on_append(state, k_pages, indptr, indices, last_page_len, append_len, layout)

    def select(self, state: QuestState, queries: Any, indptr: Any, indices: Any, last_page_len: Any, *,
               page_size: int, layer: int) -> PageSelection:
        """One decode step's pages: queries (batch, num_q_heads, head_dim), post-RoPE. Rows are one per query head
        (gqa=per_query_head, the default) or per kv head (union, group_max, group_sum)."""
        ip, ids, lp, lg = self._impl.select(state, queries, indptr, indices, last_page_len, page_size, layer)
        n = int(ip[-1])
        return PageSelection(ip, ids[:n], lp, lg[:n])


def _f32(a: Any) -> Any:
    """numpy queries widened to float32 (other arrays pass as they are: the extension takes float32 only)."""
    return a.astype(np.float32) if isinstance(a, np.ndarray) and a.dtype != np.float32 else a


class MixedPrecision(Policy):
    """Mixed precision on one byte budget (the library's ``MixedPrecision<SnapKV, Q>``): SnapKV ranks each kv head's
    tokens, the best stay in full precision, the next are stored in the per-token format Q (ggml, fp8 or int4, from a
    quantization spec; its keys half), the rest are evicted.

    ``scorer``: a :class:`SnapKV` object or a ``"snapkv:..."`` spec. Budget per kv head and role: ``bytes`` bytes, or
    (bytes=0) ``ratio`` of the full-precision cache; ``full_share`` of it is spent on full-precision tokens:
    ``n_full = min(T, floor(full_share * budget / Bf))``, ``n_low = min(T - n_full, floor((budget - n_full Bf) / Bq))``
    with Bf = head_dim * the key element's bytes, Bq = the format's ``bytes_per_token``; when every token fits, the
    spare bytes buy precision. One sequence per call.
    """

    policy_name = "mixed_precision"

    def __init__(self, scorer: Any, quant_spec: str, *, ratio: float = 0.25, bytes: float = 0.0,
                 full_share: float = 0.5) -> None:
        scorer_spec = scorer if isinstance(scorer, str) else scorer.spec
        if scorer_spec.split(":", 1)[0].strip() != "snapkv":
            raise ValueError(f"mixed_precision: scorer '{scorer_spec}' is not SnapKV (the only scorer bound)")
        self.scorer_spec, self.quant_spec = scorer_spec, quant_spec
        self._spec = f"mixed_precision({scorer_spec}, {quant_spec}, ratio={ratio}, bytes={bytes}, full_share={full_share})"
        self._impl = _core.MixedPrecisionPolicy(scorer_spec, quant_spec, float(ratio), float(bytes), float(full_share))

    def split(self, kv_len: int, head_dim: int, elem_bytes: int = 2) -> Tuple[int, int]:
        """(n_full, n_low) for a row of kv_len tokens whose keys have elem_bytes bytes per value."""
        return self._impl.split(kv_len, head_dim, elem_bytes)

    def bytes_per_token(self, head_dim: int) -> float:
        """Bq: the quantized format's bytes per token."""
        return self._impl.bytes_per_token(head_dim)

    def scores(self, queries: Any, keys: Any) -> np.ndarray:
        """The scorer's (kv_heads, kv_len) float32 scores (SnapKV's window +inf) that the tiers rank."""
        return self._impl.run(_f32(queries), keys, True)

    def decide(self, queries: Any, keys: Any) -> Tuple[KeepSet, np.ndarray]:
        """(keep, full): the kept tokens per kv head (a :class:`KeepSet`, ascending) and, parallel to keep.indices,
        uint8 flags (1: full precision, 0: quantize with Q). queries (num_q_heads, window, head_dim): float32 (numpy
        arrays of another dtype are widened); keys (num_kv_heads, kv_len, head_dim) float32 / float16 / bfloat16 are read in place."""
        ip, ids, full = self._impl.run(_f32(queries), keys, False)
        return KeepSet(ip, ids), full


def make_quantizer(spec: str, role: Optional[str] = None) -> Quantizer:
    """A K or V :class:`Quantizer` from a quantization spec (ggml, fp8, int4, kivi): ``make_quantizer("ggml:type=q4_0")``.

    ``role="keys"`` / ``"values"`` takes that half of a ``"K_SPEC|V_SPEC"`` spec, with the role the library assigns
    (ggml / int4: the rotation block; kivi: the grouping axis); without a role the spec is used as written.
    """
    return Quantizer(spec, role)


def make_quantizers(spec: str) -> Tuple[Quantizer, Quantizer]:
    """The (keys, values) quantizers of a spec ``"SPEC"`` or ``"K_SPEC|V_SPEC"``, as the library's visit_quant_spec builds them."""
    return Quantizer(spec, "keys"), Quantizer(spec, "values")


def compact_contiguous(keys: Any, kv_len: int, keep: KeepSet, *, values: Any = None, positions: Any = None,
                       row0: int = 0) -> np.ndarray:
    """Applies a KeepSet to a contiguous cache in place (keys / values (kv_heads, capacity, head_dim), or with a
    leading batch axis; any strides): per kv head the kept rows move to the front, positions ((kv_heads, capacity)
    int32) are permuted alongside. Returns the new length per head (int64). Nothing is written on error."""
    return _core.compact_contiguous(keys, kv_len, keep.indptr, keep.indices, values, row0, positions)


def compact_paged(k_pages: Any, indptr: Any, indices: Any, last_page_len: Any, keep: KeepSet, *, v_pages: Any = None,
                  positions: Any = None, layout: str = "NHD") -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Applies a KeepSet (rows ``b * kv_heads + h``, equal counts across a sequence's heads) to a paged cache in place.

    k_pages / v_pages: the page pools ((num_pages, page_size, kv_heads, head_dim) for ``layout="NHD"``,
    (num_pages, kv_heads, page_size, head_dim) for ``"HND"``); indptr / indices / last_page_len: the int32 FlashInfer
    page table (page ids distinct within and across sequences); positions: optional (num_pages, kv_heads, page_size)
    int32 logical positions, moved with the tokens. Kept tokens move to the front of each sequence's own pages.
    Returns ``(indptr, indices, last_page_len, freed_pages)``: the compacted table (each sequence keeps a prefix of its
    page list) and the ids of the pages it no longer uses, new int32 arrays. Nothing is written on error.
    """
    return _core.compact_paged(k_pages, indptr, indices, last_page_len, keep.indptr, keep.indices, v_pages, positions,
                               layout)


def _q(q: Any) -> Quantizer:
    return q if isinstance(q, Quantizer) else Quantizer(q)


def quantize_paged_append(quantizer: Any, pages: Any, indptr: Any, indices: Any, last_page_len: Any, seq: int, rows: Any, *,
                          layout: str = "NHD") -> None:
    """Quantize-on-append into a paged cache of code rows, in place: ``rows`` (kv_heads, n, head_dim; float32 / float16 /
    bfloat16) are the last n tokens of sequence ``seq`` (its length from the page table) and are written in the
    quantizer's format (a :class:`Quantizer` or a spec; ggml, fp8, int4 - not kivi) at their slots of ``pages``, a uint8
    pool (num_pages, page_size, kv_heads, quantizer.row_bytes(head_dim)) for ``"NHD"`` or (num_pages, kv_heads,
    page_size, row_bytes) for ``"HND"``, any strides with contiguous rows. Keys and values are two such pools."""
    _core.quantize_paged_append(_q(quantizer), pages, indptr, indices, last_page_len, seq, rows, layout)


def quantized_page_meta_append(quantizer: Any, state: Any, k_pages: Any, indptr: Any, indices: Any, last_page_len: Any,
                               head_dim: int, *, append_len: Any = None, layout: str = "NHD") -> None:
    """Quest's page metadata from a quantized key pool (decoded a page at a time): ``state`` is a float32
    :class:`QuestState` (or its ``data`` array), updated in place exactly as :meth:`Quest.on_append` on the decoded
    pool; ``append_len``: int32 tokens appended per sequence (None: every page of the table)."""
    meta = state.data if isinstance(state, QuestState) else state
    _core.quantized_page_meta_append(_q(quantizer), meta, k_pages, indptr, indices, last_page_len, head_dim, append_len, layout)


def quantized_paged_decode_attention(key_quantizer: Any, value_quantizer: Any, k_pages: Any, v_pages: Any, indptr: Any,
                                     indices: Any, last_page_len: Any, queries: Any, *, scale: float = 0.0,
                                     layout: str = "NHD", out: Any = None) -> Tuple[np.ndarray, np.ndarray]:
    """Exact softmax decode attention of ``queries`` (batch, num_q_heads, head_dim) float32 over every sequence's
    tokens of a quantized pool (no dequantized cache is built: one page of rows at a time), GQA groups of
    num_q_heads / kv_heads. Returns ``(out, lse)``: (batch, num_q_heads, head_dim) and (batch, num_q_heads) float32
    (``out=``: a caller-owned contiguous float32 array). ``scale`` 0: 1/sqrt(head_dim)."""
    return _core.quantized_paged_decode_attention(_q(key_quantizer), _q(value_quantizer), k_pages, v_pages, indptr, indices,
                                                  last_page_len, queries, scale, layout, out)


from . import merging  # noqa: E402
from .merging import (CaM, D2O, D2OState, KvpressCAM, KvpressMerging, LookMPivot, MergePlan, MiniCache,  # noqa: E402
                      MiniCacheStore, NearestKeptMerge, NearestKeptState, merge_contiguous)

__all__ += merging.__all__

from . import prefetch  # noqa: E402  (QuestLookahead, SpeCache, ShadowKV, InfiniGen, OffloadSim: kvpolicy.prefetch.*)

from ._policies import *  # noqa: E402,F401,F403  (one class per registry policy, generated)
from ._policies import _CLASSES  # noqa: E402

__all__ += [c.__name__ for c in _CLASSES.values()]

_NOT_BOUND: dict = {}
_QUANT_FORMATS = ("ggml", "fp8", "int4", "kivi")  # the formats visit_quant_spec builds (kvpolicy.Quantizer)


def policies() -> list:
    """Every policy of the registry: :class:`PolicyInfo` (name, family, paper, params, cls, bound)."""
    out = []
    for p in _core.registry():
        cls = (Quantizer if p["name"] in _QUANT_FORMATS else Quest if p["name"] == "quest" else H2O if p["name"] == "h2o"
               else _CLASSES.get(p["name"]))
        bound = p["erased"] or p["name"] in ("h2o", "quest") or p["name"] in _QUANT_FORMATS
        out.append(PolicyInfo(p["name"], p["family"], p["paper"], tuple(Param(*a) for a in p["params"]),
                              cls if bound else None, bound))
    return out


def make(name: str, **params: Any) -> Any:
    """A policy of the registry by name with keyword parameters: ``make("snapkv", compression_ratio=0.5, window=64)``.

    Also accepts a whole spec string (``make("snapkv:window=32")``). Unknown names and keys raise ValueError with
    the library's message (which lists the valid ones).
    """
    spec = spec_string(name, **params) if params else name
    base = spec.split(":", 1)[0].strip()
    if base == "h2o":
        return H2O._from_spec(spec)
    if base == "quest":
        return Quest._from_spec(spec)
    if base in _QUANT_FORMATS:
        return Quantizer(spec)
    info = next((p for p in _core.registry() if p["name"] == base), None)
    if info is not None and not info["erased"]:
        raise NotImplementedError(f"{base}: {_NOT_BOUND.get(info['family'], 'not bound in Python yet')}")
    cls = _CLASSES.get(base, EvictionPolicy)
    obj = cls.__new__(cls)
    EvictionPolicy.__init__(obj, spec)
    return obj
