#!/usr/bin/env python3
"""Golden vectors of the fp8 formats (e4m3fn, e5m2) from ml_dtypes (the numpy fp8 types JAX uses).

Writes tests/data/fixtures/fp8.bin (read by tests/quant/test_fp8.cpp). Never run by CI.

    /work/.venv-ref/bin/pip install ml_dtypes numpy
    /work/.venv-ref/bin/python tests/reference/make_fp8_fixtures.py

Layout (little endian): header line "kvpolicy-fp8-fixtures v1 <versions>\\n"; per format (e4m3fn, e5m2):
f32 decoded[256] (every code), u32 n, f32 x[n], u8 code[n] (ml_dtypes' round-to-nearest-even cast of x; only
|x| <= max, where saturation does not apply).
"""
import struct
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

OUT = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "fp8.bin"


def values(t, rng):
    codes = np.arange(256, dtype=np.uint8)
    dec = codes.view(t).astype(np.float32)
    pos = np.sort(dec[np.isfinite(dec) & (dec >= 0)])
    mid = ((pos[:-1].astype(np.float64) + pos[1:]) / 2).astype(np.float32)  # exact in fp32
    up = np.nextafter(mid, np.float32(np.inf))
    down = np.nextafter(mid, np.float32(0))
    mx = float(pos[-1])
    rnd = (10.0 ** rng.uniform(-12, np.log10(mx), 4000)).astype(np.float32)
    tiny = np.array([1e-45, 1e-40, 1e-38, 2 ** -20, 2 ** -17, 2 ** -10], dtype=np.float32)
    x = np.concatenate([pos, mid, up, down, rnd, tiny, [0.0]]).astype(np.float32)
    x = np.concatenate([x, -x])
    x = x[np.abs(x) <= mx]
    return dec, x, x.astype(t).view(np.uint8)


def main():
    rng = np.random.default_rng(8)
    parts = [f"kvpolicy-fp8-fixtures v1 python {sys.version.split()[0]} numpy {np.__version__} ml_dtypes {ml_dtypes.__version__}\n".encode()]
    for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
        dec, x, c = values(t, rng)
        parts += [dec.tobytes(), struct.pack("<I", x.size), x.tobytes(), c.tobytes()]
    OUT.write_bytes(b"".join(parts))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
