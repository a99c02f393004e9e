# SPDX-License-Identifier: Apache-2.0
"""The bindings on torch CPU tensors (skipped without torch): fp32 / fp16 / bf16 through DLPack, zero-copy."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvpolicy  # noqa: E402
from kvpolicy import _core  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_keys_read_in_place_every_dtype(dtype):
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 512, 64, generator=g).to(dtype)  # (batch, kv_heads, kv_len, head_dim), HF's layout
    q = torch.randn(1, 8, 64, 64, generator=g).to(dtype)
    p = kvpolicy.SnapKV(compression_ratio=0.5)
    keep = p.evict(queries=q, keys=keys)
    assert _core._last_view_pointers()["keys"] == keys.data_ptr()
    if dtype == torch.float32:
        assert _core._last_view_pointers()["queries"] == q.data_ptr()
    ref = p.evict(queries=q.float().numpy(), keys=keys.float().numpy())
    assert np.array_equal(keep.indices, ref.indices)  # widening is exact; scores are computed in fp32 either way
    assert keep.dense().shape == (1, 2, 256)


def test_strided_torch_views_and_inplace_compaction():
    cache = torch.randn(2, 4, 1024, 32)  # capacity 1024, 600 tokens filled
    keys = cache[:, :, :600]
    assert not keys.is_contiguous()
    keep = kvpolicy.StreamingLLM(tokens=100, sinks=4).evict(keys=keys)
    assert _core._last_view_pointers()["keys"] == cache.data_ptr()
    before = cache.clone()
    lens = kvpolicy.compact_contiguous(cache, 600, keep)
    assert lens.shape == (2, 4) and (lens == 100).all()
    kept = torch.from_numpy(keep.dense()).long()
    assert torch.equal(cache[:, :, :100], before.gather(2, kept.unsqueeze(-1).expand(-1, -1, -1, 32)))


def test_bad_torch_inputs():
    p = kvpolicy.SnapKV(compression_ratio=0.5)
    keys = torch.randn(2, 300, 32)
    q = torch.randn(4, 64, 32)
    with pytest.raises(TypeError, match="keys has dtype int32|keys has dtype"):
        p.evict(queries=q, keys=torch.zeros(2, 300, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="last axis"):
        p.evict(queries=q, keys=torch.randn(2, 32, 300).transpose(1, 2))
    with pytest.raises(ValueError, match="rank"):
        p.evict(queries=q, keys=keys.reshape(-1))
    with pytest.raises(TypeError, match="keys is None"):
        p.evict(queries=q, keys=None)
