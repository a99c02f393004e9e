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
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from . import _core
from ._core import get_num_threads, set_num_threads

__version__: str = _core.__version__
#: The CPU backend's instruction set chosen at run time (avx512, avx2 or sse2; KVP_CPU_ISA forces one).
isa: str = _core.isa

__all__ = [
    "__version__", "isa", "policies", "PolicyInfo", "Param", "make", "spec_string", "KeepSet", "Policy",
    "EvictionPolicy", "H2O", "H2OState", "compact_contiguous", "set_num_threads", "get_num_threads",
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
    bound: bool  # whether this build's Python layer can call it (every eviction policy; selection / quantization not yet)

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

    def evict(self, queries: Any = None, keys: Any = None, values: Any = None, *, attention: Any = None,
              column_sums: Any = None, lookahead: int = 0, backend: str = "cpu",
              out: Optional[Tuple[Any, Any]] = None) -> KeepSet:
        """The decision as a :class:`KeepSet`. ``out=(indptr, indices)``: caller-owned int32 outputs, written in place."""
        indptr, indices = (None, None) if out is None else out
        ip, ids = self._impl.evict(keys, queries, values, attention, column_sums, lookahead, backend, indptr, indices)
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


def compact_contiguous(keys: Any, kv_len: int, keep: KeepSet, *, values: Any = None, positions: Any = None,
                       row0: int = 0) -> np.ndarray:
    """Applies a KeepSet to a contiguous cache in place (keys / values (kv_heads, capacity, head_dim), or with a
    leading batch axis; any strides): per kv head the kept rows move to the front, positions ((kv_heads, capacity)
    int32) are permuted alongside. Returns the new length per head (int64). Nothing is written on error."""
    return _core.compact_contiguous(keys, kv_len, keep.indptr, keep.indices, values, row0, positions)


from ._policies import *  # noqa: E402,F401,F403  (one class per registry policy, generated)
from ._policies import _CLASSES  # noqa: E402

__all__ += [c.__name__ for c in _CLASSES.values()]

_NOT_BOUND = {
    "selection": "the selection family (Quest: plan / on_append / select over a paged cache) is not bound in Python yet",
    "quantization": "the quantization family (quantize / dequantize) is not bound in Python yet",
}


def policies() -> list:
    """Every policy of the registry: :class:`PolicyInfo` (name, family, paper, params, cls, bound)."""
    out = []
    for p in _core.registry():
        cls = _CLASSES.get(p["name"])
        bound = p["erased"] or p["name"] == "h2o"
        out.append(PolicyInfo(p["name"], p["family"], p["paper"], tuple(Param(*a) for a in p["params"]),
                              cls if bound else None, bound))
    return out


def make(name: str, **params: Any) -> Policy:
    """A policy of the registry by name with keyword parameters: ``make("snapkv", compression_ratio=0.5, window=64)``.

    Also accepts a whole spec string (``make("snapkv:window=32")``). Unknown names and keys raise ValueError with
    the library's message (which lists the valid ones).
    """
    spec = spec_string(name, **params) if params else name
    base = spec.split(":", 1)[0].strip()
    if base == "h2o":
        return H2O._from_spec(spec)
    info = next((p for p in _core.registry() if p["name"] == base), None)
    if info is not None and not info["erased"]:
        raise NotImplementedError(f"{base}: {_NOT_BOUND.get(info['family'], 'not bound in Python yet')}")
    cls = _CLASSES.get(base, EvictionPolicy)
    obj = cls.__new__(cls)
    EvictionPolicy.__init__(obj, spec)
    return obj
