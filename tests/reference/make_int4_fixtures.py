#!/usr/bin/env python3
"""Golden vectors of token-wise INT4 / INT8 (SAW-INT4's writer) and of the block-diagonal Hadamard rotation.

Writes tests/data/fixtures/int4.bin (read by tests/quant/test_int4.cpp). Never run by CI.

    /work/.venv-ref/bin/python tests/reference/make_int4_fixtures.py     # any venv with numpy

INT4: SAW-INT4's Triton kernel (`_quantized_set_kv_int4_kernel`, togethercomputer/saw-int4 SGLang fork) per
(token, kv head): mn, mx over the head vector; scale = max(mx - mn, 1e-8) / 15; zero = -mn / scale;
q = uint8(x / scale + zero + 0.5); packed[d] = q[d] | q[d + D/2] << 4; decode (q - zero) * scale. Transcribed here
in numpy float32, one rounding per operation in that order; INT8 divides by 255 and does not pack.
Rotation: R = diag(H_n, ...), the Sylvester Hadamard matrix over 1/sqrt(n), applied as a float64 matrix product.

Layout (little endian): the ASCII header line "kvpolicy-int4-fixtures v1 numpy=<version>\\n"; u32 n_quant; per case:
u32 bits, u32 rows, u32 head_dim, f32 x[rows][head_dim], u8 row_bytes[rows][head_dim*bits/8 + 8] (codes, f32 scale,
f32 zero), f32 decoded[rows][head_dim]; then u32 n_rot; per case: u32 n, u32 rows, u32 head_dim, f32 x[rows][head_dim],
f64 rotated[rows][head_dim].
"""
import struct
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "int4.bin"
f32 = np.float32


def quant_row(x, bits):
    top = f32(2**bits - 1)
    mn, mx = x.min(), x.max()
    scale = f32(max(f32(mx - mn), f32(1e-8)) / top)
    zero = f32(-mn / scale)
    q = np.trunc(((x / scale).astype(f32) + zero).astype(f32) + f32(0.5)).astype(f32)
    q = np.clip(q, 0, top).astype(np.uint8)
    if bits == 4:
        h = len(x) // 2
        codes = (q[:h] | (q[h:] << 4)).astype(np.uint8)
    else:
        codes = q
    dec = ((q.astype(f32) - zero).astype(f32) * scale).astype(f32)
    return codes.tobytes() + struct.pack("<ff", scale, zero), dec


def sylvester(n):
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def main():
    rng = np.random.default_rng(4)
    quant = []
    for bits in (4, 8):
        for d in (64, 128):
            rows = [rng.standard_normal(d) * 10.0 ** rng.uniform(-3, 3) for _ in range(40)]
            rows.append(np.full(d, 0.375))  # constant: the 1e-8 floor
            rows.append(np.linspace(-1, 1, d))
            rows.append(np.round(rng.standard_normal(d) * 4) / 2)
            rows.append(np.abs(rng.standard_normal(d)) + 5.0)  # one-sided
            rows.append(rng.standard_normal(d) * 1e-9)  # range below 1e-8
            x = np.stack(rows).astype(f32)
            out = [quant_row(r, bits) for r in x]
            quant.append((bits, x, b"".join(o[0] for o in out), np.stack([o[1] for o in out])))
    rot = []
    for n, d in ((16, 128), (64, 128), (128, 128), (64, 64), (64, 576)):
        x = (rng.standard_normal((8, d)) * 3).astype(f32)
        r = np.kron(np.eye(d // n), sylvester(n))
        rot.append((n, x, x.astype(np.float64) @ r.T))
    with open(OUT, "wb") as f:
        f.write(f"kvpolicy-int4-fixtures v1 numpy={np.__version__}\n".encode())
        f.write(struct.pack("<I", len(quant)))
        for bits, x, rb, dec in quant:
            f.write(struct.pack("<3I", bits, x.shape[0], x.shape[1]))
            f.write(x.astype("<f4").tobytes())
            f.write(rb)
            f.write(dec.astype("<f4").tobytes())
        f.write(struct.pack("<I", len(rot)))
        for n, x, y in rot:
            f.write(struct.pack("<3I", n, x.shape[0], x.shape[1]))
            f.write(x.astype("<f4").tobytes())
            f.write(y.astype("<f8").tobytes())
    print(f"wrote {OUT}: {len(quant)} quantization cases, {len(rot)} rotation cases")


if __name__ == "__main__":
    main()
