#!/usr/bin/env python3
"""Golden vectors of the ggml block formats, from gguf-py's reference quantizers.

Writes tests/data/fixtures/ggml_quants.bin (read by tests/quant/test_ggml.cpp). Never run by CI.

    python3 -m venv /work/.venv-ref && /work/.venv-ref/bin/pip install gguf==0.19.0 numpy
    /work/.venv-ref/bin/python tests/reference/make_quant_fixtures.py

Layout (little endian): the ASCII header line "kvpolicy-ggml-fixtures v1 <versions>\\n", then
u32 n_blocks, u32 n_types, f32 inputs[n_blocks][32]; per type: u32 type id (GgmlType order), u32 block bytes,
u8 quantized[n_blocks][block bytes] (the reference's bytes for the inputs), u32 n_raw, u8 raw[n_raw][block bytes]
(arbitrary blocks with finite scales), f32 raw_dequantized[n_raw][32] (gguf-py's dequantization of them).

q8_0, q4_0, q4_1, q5_0, q5_1 are quantized by gguf-py (`gguf.quants`). gguf-py has no iq4_nl quantizer:
`iq4_nl_quantize` below transcribes ggml-quants.c's `quantize_row_iq4_nl_impl` with ntry = -1 and no importance
weights (the path `quantize_row_iq4_nl_ref` takes), in numpy float32 scalars, sums in order; its bytes are
checked against gguf-py's dequantizer here (the dequantization of the bytes must reproduce the codes' values).
"""
import struct
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf import quants

OUT = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "ggml_quants.bin"
TYPES = [(0, T.Q8_0, quants.Q8_0), (1, T.Q4_0, quants.Q4_0), (2, T.Q4_1, quants.Q4_1),
         (3, T.Q5_0, quants.Q5_0), (4, T.Q5_1, quants.Q5_1), (5, T.IQ4_NL, quants.IQ4_NL)]
KV = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def inputs(rng):
    b = []
    for _ in range(150):  # random blocks over twelve decades
        b.append(rng.standard_normal(32) * 10.0 ** rng.uniform(-7, 5))
    for _ in range(20):  # skewed, one-sided
        b.append(np.abs(rng.standard_normal(32)) * 3.0 + rng.uniform(-1, 1))
    b.append(np.zeros(32))
    b.append(np.full(32, 0.75))
    b.append(np.full(32, -3.5))
    h = np.arange(32) - 15.5  # half-integers: .5 ties after scaling
    b.append(np.concatenate([[127.0], h[1:]]))  # q8_0 d = 1: x * id lands on .5
    b.append(np.concatenate([[-8.0], (np.arange(31) % 16) - 7.5]))  # q4_0 d = 1
    b.append(np.concatenate([[-16.0], (np.arange(31) % 32) - 15.5]))  # q5_0 d = 1
    b.append(np.concatenate([[0.0, 15.0], (np.arange(30) % 16) + 0.5 - 0.5 * (np.arange(30) % 2)]))  # q4_1 ties
    b.append(np.concatenate([[5.0, -5.0], rng.uniform(-4, 4, 30)]))  # max twice, opposite signs
    b.append(np.concatenate([[-5.0, 5.0], rng.uniform(-4, 4, 30)]))
    b.append(rng.standard_normal(32) * 1e-6)  # scales in the fp16 subnormal range
    b.append(rng.standard_normal(32) * 3e-8)
    b.append(rng.standard_normal(32) * 1e-16)  # below iq4_nl's 1e-15 threshold
    b.append(rng.standard_normal(32) * 1e9)  # scale above the fp16 range: an infinite scale
    mids = (KV[:-1].astype(np.float64) + KV[1:]) / 2  # iq4_nl: x / d0 on exact midpoints (d0 = 1)
    b.append(np.concatenate([[-127.0], mids, mids, [113.0]]))
    b.append(np.concatenate([[-127.0], KV[1:].astype(np.float64), KV[:16].astype(np.float64)]))
    for _ in range(10):  # integers: many exact products
        b.append(rng.integers(-20, 21, 32).astype(np.float64))
    assert all(len(v) == 32 for v in b), [i for i, v in enumerate(b) if len(v) != 32]
    return np.stack(b).astype(np.float32)


def iq4_nl_quantize(blocks):
    out = np.zeros((blocks.shape[0], 18), dtype=np.uint8)
    f = np.float32
    for i, x in enumerate(blocks):
        amax, mx = f(0), f(0)
        for v in x:
            if abs(v) > amax:
                amax, mx = abs(v), v
        q = np.zeros(32, dtype=np.uint8)
        d = f(0)
        if not amax < f(1e-15):
            d0 = f(mx / f(KV[0]))
            idv = f(f(1) / d0)
            sqx, sq2 = f(0), f(0)
            for j, v in enumerate(x):
                al = f(idv * v)
                if al <= KV[0]:
                    l = 0
                elif al >= KV[15]:
                    l = 15
                else:
                    lo, hi = 0, 15
                    while hi - lo > 1:
                        mid = (lo + hi) // 2
                        if al < KV[mid]:
                            hi = mid
                        else:
                            lo = mid
                    l = hi - 1 if al - f(KV[hi - 1]) < f(KV[hi]) - al else hi
                q[j] = l
                w = f(v * v)
                sqx = f(sqx + f(f(w * f(KV[l])) * v))
                sq2 = f(sq2 + f(f(w * f(KV[l])) * f(KV[l])))
            d = f(sqx / sq2)
        out[i, 0:2] = np.array([d], dtype=np.float32).astype(np.float16).view(np.uint8)
        out[i, 2:] = q[:16] | (q[16:] << 4)
    return out


def raw_blocks(rng, cls, bb, n=64):
    raw = rng.integers(0, 256, (n, bb), dtype=np.uint8)
    nscale = 2 if cls in (quants.Q4_1, quants.Q5_1) else 1
    for k in range(nscale):  # finite fp16 scales (and mins)
        s = (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 2, n)).astype(np.float16)
        raw[:, 2 * k:2 * k + 2] = s.view(np.uint8).reshape(n, 2)
    return raw


def main():
    rng = np.random.default_rng(20261201)
    x = inputs(rng)
    with np.errstate(all="ignore"):
        parts = [f"kvpolicy-ggml-fixtures v1 python {sys.version.split()[0]} numpy {np.__version__} "
                 f"gguf {getattr(gguf, '__version__', '0.19.0')}\n".encode(), struct.pack("<II", x.shape[0], len(TYPES)), x.tobytes()]
        for tid, qt, cls in TYPES:
            bb = gguf.GGML_QUANT_SIZES[qt][1]
            q = iq4_nl_quantize(x) if cls is quants.IQ4_NL else cls.quantize_blocks(x.copy())
            q = np.ascontiguousarray(q, dtype=np.uint8)
            assert q.shape == (x.shape[0], bb)
            if cls is quants.IQ4_NL:  # gguf-py decodes the transcription's bytes to table values times the scale
                y = cls.dequantize_blocks(q.copy())
                d = q[:, :2].copy().view(np.float16).astype(np.float32)
                codes = np.concatenate([q[:, 2:] & 15, q[:, 2:] >> 4], axis=1)
                assert np.array_equal(y, d * KV[codes].astype(np.float32), equal_nan=True)
            raw = raw_blocks(rng, cls, bb)
            ry = cls.dequantize_blocks(raw.copy()).astype(np.float32)
            parts += [struct.pack("<II", tid, bb), q.tobytes(), struct.pack("<I", raw.shape[0]), raw.tobytes(), ry.tobytes()]
    OUT.write_bytes(b"".join(parts))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {x.shape[0]} blocks, {len(TYPES)} types)")


if __name__ == "__main__":
    main()
