# SPDX-License-Identifier: Apache-2.0
"""Deterministic fixture inputs, bit-identical to tests/reference/fixture_rng.hpp.

Recipe "kvp-fixture-v1" (the normative description is in tests/reference/README.md, section "RNG spec"):

* splitmix64 finaliser, all arithmetic mod 2**64;
  hash(seed, stream, index) = sm(sm(sm(seed) ^ stream) ^ index).
* Every float is an integer times a power of two, built in integer arithmetic and converted once, so numpy and
  C++ produce the same float32 bits whatever the compiler does (no rounding happens anywhere).
* Tensors are (head, token, dim), row-major; the element hash index is (head * tokens + token) * dim + c.

Only numpy is needed here (no torch), so the C++ side can be checked without the kvpress environment.
"""
from __future__ import annotations

import numpy as np

RECIPE = "kvp-fixture-v1"
MASK64 = (1 << 64) - 1

# stream ids
STREAM_QUERY_NOISE = 1
STREAM_KEY_NOISE = 2
STREAM_VALUE_NOISE = 3
STREAM_DIRECTION = 4
STREAM_KEY_TOKEN = 5
STREAM_QUERY_HEAD = 6
STREAM_VALUE_TOKEN = 7
STREAM_SAMPLE = 100  # sample positions (Python only; the positions are written into the fixtures)

KEY_EXPONENT = (-1, 0, 0, 0, 0, 0, 1, 1)  # indexed by hash >> 61
VALUE_EXPONENT = (-1, 0, 0, 1)  # indexed by hash >> 62
NOISE_FRAC_BITS = 21  # noise() = integer * 2**-21


def splitmix64_int(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def _sm_np(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def stream_key(seed: int, stream: int) -> int:
    return splitmix64_int(splitmix64_int(seed & MASK64) ^ stream)


def hash_int(seed: int, stream: int, index: int) -> int:
    return splitmix64_int(stream_key(seed, stream) ^ (index & MASK64))


def hash_np(seed: int, stream: int, index: np.ndarray) -> np.ndarray:
    return _sm_np(np.uint64(stream_key(seed, stream)) ^ index.astype(np.uint64))


def uniform24(h: np.ndarray) -> np.ndarray:
    """Top 24 bits -> float32 in [-1, 1), multiples of 2**-23."""
    m = (h >> np.uint64(40)).astype(np.int64) - (1 << 23)
    return np.ldexp(m.astype(np.float32), -23).astype(np.float32)


def noise_int(h: np.ndarray) -> np.ndarray:
    """Sum of three centred 21-bit fields (bits 43..63, 22..42, 1..21): an int in [-3*2**20, 3*2**20)."""
    f = np.uint64(0x1FFFFF)
    a = ((h >> np.uint64(43)) & f).astype(np.int64)
    b = ((h >> np.uint64(22)) & f).astype(np.int64)
    c = ((h >> np.uint64(1)) & f).astype(np.int64)
    return a + b + c - 3 * (1 << 20)


def _element_index(heads: int, tokens: int, dim: int, t0: int, t1: int) -> np.ndarray:
    h = np.arange(heads, dtype=np.uint64)[:, None, None]
    t = np.arange(t0, t1, dtype=np.uint64)[None, :, None]
    c = np.arange(dim, dtype=np.uint64)[None, None, :]
    return (h * np.uint64(tokens) + t) * np.uint64(dim) + c


def direction_int(seed: int, num_kv_heads: int, dim: int) -> np.ndarray:
    """dir[g][c] = +-0.5, returned as the integer +-2**20 (units of 2**-21)."""
    idx = np.arange(num_kv_heads * dim, dtype=np.uint64)
    h = hash_np(seed, STREAM_DIRECTION, idx)
    sign = np.where((h >> np.uint64(63)) == 1, -1, 1).astype(np.int64)
    return (sign << 20).reshape(num_kv_heads, dim)


def key_token_params(seed: int, num_kv_heads: int, tokens: int, t0: int = 0, t1: int | None = None):
    """(exponent, heavy level) per (kv head, token)."""
    t1 = tokens if t1 is None else t1
    g = np.arange(num_kv_heads, dtype=np.uint64)[:, None]
    t = np.arange(t0, t1, dtype=np.uint64)[None, :]
    h = hash_np(seed, STREAM_KEY_TOKEN, g * np.uint64(tokens) + t)
    exp = np.asarray(KEY_EXPONENT, dtype=np.int64)[(h >> np.uint64(61)).astype(np.int64)]
    heavy = ((h >> np.uint64(55)) & np.uint64(63)) < 2
    level = np.where(heavy, 1 + ((h >> np.uint64(53)) & np.uint64(3)).astype(np.int64), 0)
    return exp, level


def query_head_params(seed: int, num_q_heads: int):
    """(exponent in {0,1}, alignment quarter a in {0,1,2,3}) per query head; alignment = a * 0.25."""
    h = hash_np(seed, STREAM_QUERY_HEAD, np.arange(num_q_heads, dtype=np.uint64))
    align = ((h >> np.uint64(62)) & np.uint64(3)).astype(np.int64)
    exp = ((h >> np.uint64(61)) & np.uint64(1)).astype(np.int64)
    return exp, align


def gen_keys(seed: int, num_kv_heads: int, tokens: int, dim: int, t0: int = 0, t1: int | None = None) -> np.ndarray:
    """keys[g][t][c] = (noise + level[g][t] * dir[g][c]) * 2**exp[g][t]; shape (Hkv, t1-t0, d) float32."""
    t1 = tokens if t1 is None else t1
    n = noise_int(hash_np(seed, STREAM_KEY_NOISE, _element_index(num_kv_heads, tokens, dim, t0, t1)))
    exp, level = key_token_params(seed, num_kv_heads, tokens, t0, t1)
    d = direction_int(seed, num_kv_heads, dim)
    x = n + level[:, :, None] * d[:, None, :]
    return np.ldexp(x.astype(np.float32), (exp - NOISE_FRAC_BITS)[:, :, None].astype(np.int32)).astype(np.float32)


def gen_queries(seed: int, num_q_heads: int, num_kv_heads: int, tokens: int, dim: int, t0: int = 0,
                t1: int | None = None) -> np.ndarray:
    """queries[h][t][c] = (noise + align[h] * 0.25 * dir[h/G][c]) * 2**exp[h]; shape (Hq, t1-t0, d) float32."""
    t1 = tokens if t1 is None else t1
    group = num_q_heads // num_kv_heads
    n = noise_int(hash_np(seed, STREAM_QUERY_NOISE, _element_index(num_q_heads, tokens, dim, t0, t1)))
    exp, align = query_head_params(seed, num_q_heads)
    d = direction_int(seed, num_kv_heads, dim)[np.arange(num_q_heads) // group]  # (Hq, d), units 2**-21
    x = n + (align[:, None] * (d >> 2))[:, None, :]  # align * 0.125 * sign, in units of 2**-21: align * sign * 2**18
    return np.ldexp(x.astype(np.float32), (exp - NOISE_FRAC_BITS)[:, None, None].astype(np.int32)).astype(np.float32)


def gen_values(seed: int, num_kv_heads: int, tokens: int, dim: int, t0: int = 0, t1: int | None = None) -> np.ndarray:
    """values[g][t][c] = noise * 2**vexp[g][t]; shape (Hkv, t1-t0, d) float32."""
    t1 = tokens if t1 is None else t1
    n = noise_int(hash_np(seed, STREAM_VALUE_NOISE, _element_index(num_kv_heads, tokens, dim, t0, t1)))
    g = np.arange(num_kv_heads, dtype=np.uint64)[:, None]
    t = np.arange(t0, t1, dtype=np.uint64)[None, :]
    h = hash_np(seed, STREAM_VALUE_TOKEN, g * np.uint64(tokens) + t)
    exp = np.asarray(VALUE_EXPONENT, dtype=np.int64)[(h >> np.uint64(62)).astype(np.int64)]
    return np.ldexp(n.astype(np.float32), (exp - NOISE_FRAC_BITS)[:, :, None].astype(np.int32)).astype(np.float32)


def tensor_check(x: np.ndarray, n_first: int = 8) -> dict:
    """What fixture_reader's self-test compares: exact float64 sum (exact for these dyadic values: every element is
    a multiple of 2**-22 below 8 in magnitude, so any summation order gives the same double for < 2**28
    elements), a position-sensitive checksum of the float32 bit patterns, and the first values."""
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    bits = flat.view(np.uint32).astype(np.uint64)
    weights = np.arange(flat.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    with np.errstate(over="ignore"):
        chk = int(np.sum(bits * weights, dtype=np.uint64))
    return {
        "sum": float(np.sum(flat.astype(np.float64))),
        "bits_checksum": f"0x{chk:016x}",
        "first": [float(v) for v in flat[:n_first]],
    }


if __name__ == "__main__":  # a tiny smoke print
    print(gen_keys(1, 2, 5, 4))
    print(gen_queries(1, 4, 2, 5, 4))
    print(gen_values(1, 2, 5, 4))
