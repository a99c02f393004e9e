#!/usr/bin/env python3
"""Golden vectors of KIVI's key and value quantization, from the reference's torch arithmetic.

Writes tests/data/fixtures/kivi.bin (read by tests/quant/test_kivi.cpp). Never run by CI.

    /work/.venv-kvpress/bin/python tests/reference/make_kivi_fixtures.py     # any venv with torch

KIVI (jy-yuan/KIVI, quant/new_pack.py: quant_and_pack_kcache / quant_and_pack_vcache and their
unpack_and_dequant_* inverses) quantizes fp16 tensors with fp16 torch operations, in this order:
mn = min, mx = max over the group; scale = (mx - mn) / (2^b - 1); data = (x - mn) / scale; clamp to
[0, 2^b - 1]; round (half to even); pack 32 / b codes per int32, code j of a word at bits b*j; decode
q.to(fp16) * scale + mn. The functions below redo those steps with the same torch operations on CPU fp16
tensors (they are written here because the reference module imports triton at the top). One documented
deviation: a constant group (scale 0) makes 0 / 0 = NaN, whose integer cast is arbitrary in the reference;
the library and this generator store code 0 there (nan_to_num before the clamp).

With KIVI_NEW_PACK=/path/to/KIVI/quant/new_pack.py the generator first imports the reference module itself
(triton stubbed: only its torch functions run) and checks that these functions give the same codes and
dequantized values on random inputs, for both roles and 2, 4, 8 bits.

Layout (little endian): the ASCII header line "kvpolicy-kivi-fixtures v1 torch=<version>\\n", u32 n_cases, then
per case: u32 role (0 keys, 1 values), u32 bits, u32 group, u32 heads, u32 tokens, u32 head_dim,
u16 input[heads][tokens][head_dim] (fp16 bits), i32 codes[...] in the reference's shape (keys
[heads][tokens / (32/b)][head_dim], values [heads][tokens][head_dim / (32/b)]), u16 scale[...] and u16 mn[...]
(keys [heads][tokens / group][head_dim], values [heads][tokens][head_dim / group]), u16 dequantized[heads][tokens][head_dim].
"""
import os
import struct
from pathlib import Path

import numpy as np
import torch

OUT = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "kivi.bin"


def pack(codes, bits, dim):
    """int32 codes -> int32 words, 32 / bits codes per word along `dim`, code j at bits [bits*j, bits*j + bits)."""
    f = 32 // bits
    codes = codes.movedim(dim, -1)
    shape = codes.shape
    grouped = codes.reshape(*shape[:-1], shape[-1] // f, f).to(torch.int64)
    shifts = torch.arange(f, dtype=torch.int64) * bits
    words = (grouped << shifts).sum(-1)  # disjoint bit fields: the sum is the OR
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim)


def quantize(x, group, bits, role):
    """x: (1, H, T, D) fp16. Returns codes (reference packing), scale, mn (keepdim shapes squeezed), dequantized."""
    B, H, T, D = x.shape
    max_int = 2**bits - 1
    if role == 0:  # keys: groups of `group` tokens per channel
        data = x.view(B, H, T // group, group, D)
        mn = torch.min(data, dim=-2, keepdim=True)[0]
        mx = torch.max(data, dim=-2, keepdim=True)[0]
    else:  # values: groups of `group` channels per token
        data = x.view(B, H, T, D // group, group)
        mn = torch.min(data, dim=-1, keepdim=True)[0]
        mx = torch.max(data, dim=-1, keepdim=True)[0]
    scale = (mx - mn) / max_int
    q = data - mn
    q = q / scale
    q = torch.nan_to_num(q, nan=0.0, posinf=float("inf"), neginf=float("-inf"))
    q = q.clamp(0, max_int).round().to(torch.int32)
    deq = (q.to(torch.float16) * scale + mn).view(B, H, T, D)
    q = q.view(B, H, T, D)
    codes = pack(q, bits, 2 if role == 0 else 3)
    if role == 0:
        return codes[0], scale[0, :, :, 0, :], mn[0, :, :, 0, :], deq[0]
    return codes[0], scale[0, :, :, :, 0], mn[0, :, :, :, 0], deq[0]


def inputs(rng, H, T, D, role, group):
    x = rng.standard_normal((H, T, D)) * 10.0 ** rng.uniform(-2, 2, (H, 1, D if role == 0 else 1))
    x = x.astype(np.float32)
    if role == 0:
        x[0, :group, 3] = 0.625  # a constant group (scale 0)
        x[1, :group, 5] = np.linspace(0, 3, group)  # exact grid: many .5 ties at 2 bits
        x[0, group:2 * group, 7] = rng.standard_normal(group) * 1e-7  # scale underflows fp16
        x[1, :group, 9] = np.round(rng.standard_normal(group) * 8) / 2  # half-integers
    else:
        x[0, 0, :group] = -1.25
        x[1, 1, :group] = np.linspace(-1, 2, group)
        x[0, 2, group:2 * group] = rng.standard_normal(group) * 1e-7
        x[1, 2, :] = np.round(rng.standard_normal(D) * 8) / 2
    return x.astype(np.float16)


def cross_check(path):
    import importlib.util
    import sys
    import unittest.mock
    sys.modules.setdefault("triton", unittest.mock.MagicMock())
    sys.modules.setdefault("triton.language", unittest.mock.MagicMock())
    spec = importlib.util.spec_from_file_location("kivi_new_pack", path)
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    rng = np.random.default_rng(1)
    for role in (0, 1):
        for bits in (2, 4, 8):
            x = torch.from_numpy((rng.standard_normal((1, 2, 64, 64)) * 3).astype(np.float16))
            if role == 0:
                c, s, m = ref.quant_and_pack_kcache(x.clone(), 32, bits)
                d = ref.unpack_and_dequant_kcache(c, s, m, 32, bits)
            else:
                c, s, m = ref.quant_and_pack_vcache(x.clone(), 32, bits)
                d = ref.unpack_and_dequant_vcache(c, s, m, 32, bits)
            c2, _, _, d2 = quantize(x, 32, bits, role)
            assert torch.equal(c[0], c2) and torch.equal(d[0].reshape(d2.shape), d2), (role, bits)
    print("cross-check against", path, ": identical")


def main():
    if os.environ.get("KIVI_NEW_PACK"):
        cross_check(os.environ["KIVI_NEW_PACK"])
    rng = np.random.default_rng(20261201)
    cases = []
    for role in (0, 1):
        for bits in (2, 4, 8):
            for group, T, D in ((32, 64, 64), (64, 128, 128), (16 if bits >= 4 else 32, 64, 128)):
                if role == 1 and T > 8:
                    T = 6
                x = inputs(rng, 2, T, D, role, group)
                codes, scale, mn, deq = quantize(torch.from_numpy(x)[None], group, bits, role)
                cases.append((role, bits, group, x, codes, scale, mn, deq))
    with open(OUT, "wb") as f:
        f.write(f"kvpolicy-kivi-fixtures v1 torch={torch.__version__}\n".encode())
        f.write(struct.pack("<I", len(cases)))
        for role, bits, group, x, codes, scale, mn, deq in cases:
            H, T, D = x.shape
            f.write(struct.pack("<6I", role, bits, group, H, T, D))
            f.write(x.view(np.uint16).tobytes())
            f.write(codes.numpy().astype("<i4").tobytes())
            f.write(scale.contiguous().numpy().view(np.uint16).tobytes())
            f.write(mn.contiguous().numpy().view(np.uint16).tobytes())
            f.write(deq.contiguous().numpy().view(np.uint16).tobytes())
    print(f"wrote {OUT} ({len(cases)} cases)")


if __name__ == "__main__":
    main()
