"""Writes the seed corpus of fuzz_gguf (tests/fuzz/corpus/fuzz_gguf/) with gguf-py.

Small valid GGUF files: every metadata value type (scalars, strings, nested
arrays), tensors of the types the reader dequantizes (F32, F16, BF16, Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1), version 3, the default and a custom alignment.
Run once outside CI (needs `pip install gguf numpy`); the files are committed.
"""
import pathlib
import sys

import numpy as np
from gguf import GGUFWriter, GGMLQuantizationType, quants

out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent / "corpus" / "fuzz_gguf")
out.mkdir(parents=True, exist_ok=True)
rng = np.random.default_rng(7)


def write(name, tensors, alignment=None, extra=True):
    path = out / name
    w = GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_uint32("general.alignment", alignment)
    if extra:
        w.add_uint8("t.u8", 7)
        w.add_int8("t.i8", -3)
        w.add_uint16("t.u16", 65535)
        w.add_int16("t.i16", -2)
        w.add_uint32("t.u32", 12)
        w.add_int32("t.i32", -12)
        w.add_float32("t.f32", 0.5)
        w.add_uint64("t.u64", 1 << 40)
        w.add_int64("t.i64", -(1 << 40))
        w.add_float64("t.f64", 1e-3)
        w.add_bool("t.bool", True)
        w.add_string("t.str", "héllo")
        w.add_array("t.ints", [1, 2, 3])
        w.add_array("t.strs", ["a", "bc", ""])
        w.add_array("t.nested", [[1, 2], [3]])
    for tname, data, qtype in tensors:
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w.add_tensor(tname, data)
        else:
            q = quants.quantize(data, qtype)
            w.add_tensor(tname, q, raw_shape=q.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


f32 = rng.standard_normal((2, 32)).astype(np.float32)
write("dense.gguf", [("a", f32, GGMLQuantizationType.F32), ("b", f32.astype(np.float16), GGMLQuantizationType.F16)])
blocks = [(f"q{i}", rng.standard_normal((2, 64)).astype(np.float32), t) for i, t in enumerate(
    [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
     GGMLQuantizationType.Q5_1, GGMLQuantizationType.BF16])]
write("blocks.gguf", blocks)
write("aligned64.gguf", blocks[:2], alignment=64)
write("empty.gguf", [], extra=False)
print("wrote", sorted(p.name for p in out.iterdir()))
