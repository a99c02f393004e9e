# SPDX-License-Identifier: Apache-2.0
"""Quantization from Python: Quantizer (ggml, fp8, int4, kivi one-shot) and KiviCache (KIVI's streaming residual rule)."""
import numpy as np
import pytest

import kvpolicy
from kvpolicy import _core

RNG = np.random.default_rng(77)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


GGML_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "iq4_nl": 18}


# ---- bytes: the C++ rules -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", sorted(GGML_BLOCK_BYTES))
def test_ggml_bytes(t):
    q = kvpolicy.make_quantizer(f"ggml:type={t}")
    assert q.format == "ggml" and q.layout == t and q.role == "keys"
    for d in (32, 64, 128):
        assert q.row_bytes(d) == d // 32 * GGML_BLOCK_BYTES[t]
        assert q.bytes_per_token(d) == d // 32 * GGML_BLOCK_BYTES[t]
        assert q.scales_row_bytes(d) == 0 and q.code_rows(17) == 17


def test_fp8_int4_kivi_bytes():
    assert kvpolicy.Quantizer("fp8").row_bytes(128) == 128 + 16  # per_token_head: 16-byte trailer with the fp32 scale
    assert kvpolicy.Quantizer("fp8:scales=per_tensor").row_bytes(128) == 128
    assert kvpolicy.Quantizer("int4").row_bytes(128) == 128 * 4 // 8 + 8
    assert kvpolicy.Quantizer("int4:bits=8").bytes_per_token(64) == 64 + 8
    for role in ("keys", "values"):
        for bits in (2, 4, 8):
            q = kvpolicy.Quantizer(f"kivi:role={role},bits={bits},group=32,residual=64")
            d = 128
            assert q.bytes_per_token(d) == d * bits / 8 + 4 * d / 32
            if role == "keys":
                assert q.row_bytes(d) == d * 32 * bits // 8 and q.scales_row_bytes(d) == 4 * d
                assert q.code_rows(65) == 3
            else:
                assert q.row_bytes(d) == d * bits // 8 and q.scales_row_bytes(d) == 4 * (d // 32)
                assert q.code_rows(65) == 65


def test_k_v_spec_and_roles():
    k, v = kvpolicy.make_quantizers("int4:rotation=llama_cpp|int4:rotation=none,bits=8")
    assert (k.role, v.role) == ("keys", "values")
    assert k.bits == 4 and v.bits == 8
    assert kvpolicy.Quantizer("kivi:role=values").role == "values"  # no role given: the spec as written
    assert kvpolicy.Quantizer("kivi:role=values", role="keys").role == "keys"  # visit_quant_spec's keys half
    assert kvpolicy.make("ggml:type=q4_0").layout == "q4_0"
    infos = {p.name: p for p in kvpolicy.policies()}
    for name in ("ggml", "fp8", "int4", "kivi"):
        assert infos[name].bound and infos[name].cls is kvpolicy.Quantizer


# ---- round trips --------------------------------------------------------------------------------------------------


def test_ggml_q8_0_block_error_bound():
    x = rand(2, 40, 128)
    q = kvpolicy.Quantizer("ggml:type=q8_0")
    codes = q.quantize(x)
    assert codes.shape == (2, 40, 136) and codes.dtype == np.uint8
    y = q.dequantize(codes)
    assert y.shape == x.shape and y.dtype == np.float32
    amax = np.abs(x.reshape(2, 40, 4, 32)).max(-1, keepdims=True)
    err = np.abs((y - x).reshape(2, 40, 4, 32))
    assert (err <= 0.6 * amax / 127 + 1e-7).all()  # half a step, plus the fp16 scale's rounding


@pytest.mark.parametrize("spec,rel", [("ggml:type=q4_0", 0.12), ("ggml:type=q4_1", 0.1), ("ggml:type=q5_1", 0.05),
                                      ("ggml:type=iq4_nl", 0.1), ("ggml:type=q8_0,rotation=llama_cpp", 0.01),
                                      ("fp8", 0.05), ("fp8:format=e5m2", 0.1), ("int4", 0.12), ("int4:bits=8", 0.01),
                                      ("int4:rotation=none", 0.12), ("kivi:role=values,bits=4", 0.12),
                                      ("kivi:role=keys,bits=4", 0.12), ("kivi:role=keys,bits=2", 0.5)])
def test_round_trip_relative_rms(spec, rel):
    x = rand(3, 64, 128)
    q = kvpolicy.Quantizer(spec)
    out = q.quantize(x)
    y = q.dequantize(*out) if isinstance(out, tuple) else q.dequantize(out)
    assert y.shape == x.shape
    r = np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2))
    assert r < rel, r


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_dtypes_and_out_arrays_in_place(dtype):
    x = rand(2, 16, 64, dtype=dtype)
    q = kvpolicy.Quantizer("ggml:type=q4_0")
    codes = np.full((2, 20, q.row_bytes(64)), 0xAB, np.uint8)  # room for more tokens than written
    ret = q.quantize(x, out=codes)
    assert ret is codes
    assert _core._last_view_pointers()["rows"] == x.__array_interface__["data"][0]  # read in place
    assert (codes[:, 16:] == 0xAB).all()
    ref = q.quantize(x.astype(np.float32))
    assert np.array_equal(codes[:, :16], ref)  # fp16 rows widen exactly
    out = np.zeros((2, 16, 64), np.float16)
    assert q.dequantize(codes, out=out) is out  # tokens from out's shape
    assert np.array_equal(out, q.dequantize(codes[:, :16]).astype(np.float16))
    assert q.dequantize(codes, tokens=16, dtype=np.float16).dtype == np.float16


def test_fp8_per_head_scales():
    q = kvpolicy.Quantizer("fp8:scales=per_head")
    x = rand(2, 8, 32) * np.array([1.0, 100.0], np.float32)[:, None, None]
    s = np.array([1.0 / 64, 100.0 / 64], np.float32)
    y = q.dequantize(q.quantize(x, head_scales=s), head_scales=s)
    assert np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2)) < 0.05
    with pytest.raises(ValueError, match="per_head scales has 0 entries"):
        q.quantize(x)


# ---- gguf-py: the same bytes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_ggml_codes_equal_gguf(t):
    gguf = pytest.importorskip("gguf")
    qt = getattr(gguf.GGMLQuantizationType, t.upper())
    x = rand(2, 33, 128) * 3
    codes = kvpolicy.Quantizer(f"ggml:type={t}").quantize(x)
    ref = gguf.quants.quantize(x, qt)
    assert ref.shape == codes.shape
    assert np.array_equal(codes, ref)
    assert np.array_equal(kvpolicy.Quantizer(f"ggml:type={t}").dequantize(codes), gguf.quants.dequantize(ref, qt))


# ---- errors: the library's message, nothing written ----------------------------------------------------------------


def test_errors_leave_outputs_untouched():
    q = kvpolicy.Quantizer("ggml:type=q8_0")
    x = rand(2, 8, 64)
    x[1, 5, 7] = np.nan
    codes = np.full((2, 8, q.row_bytes(64)), 0x5C, np.uint8)
    with pytest.raises(ValueError, match="ggml: rows head 1 token 5 channel 7 is not finite"):
        q.quantize(x, out=codes)
    assert (codes == 0x5C).all()
    with pytest.raises(ValueError, match=r"ggml: codes is \(2, 8, 68\), expected \(2 kv heads, >= 9 tokens"):
        q.quantize(rand(2, 9, 64), out=codes)
    assert (codes == 0x5C).all()
    with pytest.raises(ValueError, match="head_dim 48 is not a multiple"):
        q.quantize(rand(2, 4, 48))
    with pytest.raises(ValueError, match="known formats: ggml, fp8, int4, kivi"):
        kvpolicy.Quantizer("gptq")
    with pytest.raises(ValueError, match="unknown parameter 'typ'"):
        kvpolicy.Quantizer("ggml:typ=q4_0")
    with pytest.raises(ValueError, match="pass role="):
        kvpolicy.Quantizer("int4|int4:bits=8")
    with pytest.raises(ValueError, match="K and V name different formats"):
        kvpolicy.make_quantizers("int4|fp8")
    with pytest.raises(ValueError, match="kivi: keys rows has 40 tokens, not a multiple of group 32"):
        kvpolicy.Quantizer("kivi:role=keys").quantize(rand(1, 40, 64))
    with pytest.raises(TypeError, match="codes must be uint8"):
        q.dequantize(np.zeros((2, 4, 68), np.int32))


# ---- KIVI's streaming cache -----------------------------------------------------------------------------------------


def test_kivi_keys_residual_rule():
    H, d, R, G = 2, 64, 64, 32
    c = kvpolicy.KiviCache(f"kivi:role=keys,bits=2,group={G},residual={R}", H, d, 512)
    assert c.codes.shape == (H, 512 // G, d * G * 2 // 8) and c.scales.shape == (H, 512 // G, 4 * d)
    assert c.residual.shape == (H, R, d) and c.residual.dtype == np.float16
    x = rand(H, 150, d)
    c.append(x)  # the prompt: T - T mod R tokens quantized
    assert (c.tokens, c.residual_len) == (128, 22)
    assert np.array_equal(c.residual[:, :22], x[:, 128:].astype(np.float16))
    seq = [x]
    for step in range(42):  # decode: the block is quantized the moment the residual reaches R
        r = rand(H, 1, d)
        seq.append(r)
        c.append(r)
        assert (c.tokens, c.residual_len) == ((128, 22 + step + 1) if step < 41 else (192, 0))
    full = np.concatenate(seq, axis=1)
    y = c.dequantize()
    assert y.shape == (H, 192, d)
    assert np.sqrt(np.mean((y - full) ** 2) / np.mean(full ** 2)) < 0.5
    # one-shot quantize of the same tokens gives the same codes (the prompt's blocks and the flushed block)
    codes, scales = c.quantizer.quantize(full)
    assert np.array_equal(c.codes[:, :6], codes) and np.array_equal(c.scales[:, :6], scales)


def test_kivi_values_residual_rule_and_errors():
    H, d, R = 2, 64, 16
    c = kvpolicy.KiviCache(kvpolicy.Quantizer(f"kivi:role=values,bits=4,group=32,residual={R}"), H, d, 64)
    x = rand(H, 40, d)
    c.append(x)  # every token but the last R
    assert (c.tokens, c.residual_len, c.length) == (24, 16, 40)
    for i in range(5):
        c.append(rand(H, 1, d))
        assert (c.tokens, c.residual_len) == (25 + i, 16)
    y = c.dequantize(include_residual=False)
    assert y.shape == (H, 29, d)
    assert np.sqrt(np.mean((y[:, :24] - x[:, :24]) ** 2) / np.mean(x[:, :24] ** 2)) < 0.12
    assert np.array_equal(c.dequantize()[:, 29:], c.residual[:, :16].astype(np.float32))
    # errors: nothing changes
    before = (c.codes.copy(), c.scales.copy(), c.residual.copy(), c.tokens, c.residual_len)
    bad = rand(H, 3, d)
    bad[0, 2, 1] = np.inf
    with pytest.raises(ValueError, match="kivi: rows head 0 token 2 channel 1 is inf, not finite in fp16"):
        c.append(bad)
    with pytest.raises(ValueError, match=r"kivi: codes is \(2, 64, 32\), expected \(2 kv heads, >= 65 tokens"):
        c.append(rand(H, 36, d))  # past the capacity
    with pytest.raises(ValueError, match="the cache has 2 kv heads"):
        c.append(rand(3, 1, d))
    after = (c.codes, c.scales, c.residual, c.tokens, c.residual_len)
    for a, b in zip(before, after):
        assert np.array_equal(a, b)
    c.reset()
    assert (c.tokens, c.residual_len) == (0, 0)
    with pytest.raises(ValueError, match="not kivi"):
        kvpolicy.KiviCache(kvpolicy.Quantizer("int4"), H, d, 64)


def test_torch_bfloat16_in_and_out():
    torch = pytest.importorskip("torch")
    x = torch.randn(2, 8, 64).to(torch.bfloat16)
    q = kvpolicy.Quantizer("int4:bits=8")
    codes = q.quantize(x)
    assert _core._last_view_pointers()["rows"] == x.data_ptr()
    assert np.array_equal(codes, q.quantize(x.float().numpy()))  # bf16 widens exactly
    out = torch.empty(2, 8, 64, dtype=torch.bfloat16)
    q.dequantize(codes, out=out)
    assert torch.equal(out, torch.from_numpy(q.dequantize(codes)).to(torch.bfloat16))
    k = kvpolicy.KiviCache("kivi:role=values,residual=8", 2, 64, 32)
    k.append(x)
    assert (k.tokens, k.residual_len) == (0, 8)
    assert np.array_equal(k.residual, x.float().numpy().astype(np.float16))
