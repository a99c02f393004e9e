#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Speed of the kvpolicy-backed presses (kvpolicy.kvpress) against kvpress 0.5.5's own, on CPU at equal threads.

Each side runs the press's whole ``compress`` of one layer at the end of prefill (scores, selection, gathering the
kept keys and values; Ada-KV: the masked indices) on identical tensors. Default shape: 32K tokens, 32 query / 8 kv
heads, head_dim 128, fp16 keys / values / hidden states, window 64, compression ratio 0.5. The attention module is
a stub whose q_proj is the identity, so ``hidden_states`` carries the pre-RoPE queries; the window's RoPE (and for
Expected Attention the pre-RoPE queries of the whole prompt) are computed in torch by both sides alike.
Median wall time of --reps calls after --warmup. ObservedAttention is left out: it needs the (heads, T, T) eager
attention weights, 32 GiB at this shape.

    python python/benchmarks/bench_kvpress.py [--threads 1] [--tokens 32768] [--presses snapkv,adakv,...] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types

import torch
import kvpress
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import kvpolicy
import kvpolicy.kvpress as kp


def make_presses(name: str, r: float, w: int):
    table = {
        "snapkv": (lambda: kvpress.SnapKVPress(compression_ratio=r, window_size=w), lambda: kp.SnapKVPress(compression_ratio=r, window_size=w)),
        "adakv": (lambda: kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=r, window_size=w)),
                  lambda: kp.AdaKVPress(kvpress.SnapKVPress(compression_ratio=r, window_size=w))),
        "pyramidkv": (lambda: kvpress.PyramidKVPress(compression_ratio=r, window_size=w),
                      lambda: kp.PyramidKVPress(compression_ratio=r, window_size=w)),
        "tova": (lambda: kvpress.TOVAPress(compression_ratio=r), lambda: kp.TOVAPress(compression_ratio=r)),
        "streaming_llm": (lambda: kvpress.StreamingLLMPress(compression_ratio=r), lambda: kp.StreamingLLMPress(compression_ratio=r)),
        "expected_attention": (lambda: kvpress.ExpectedAttentionPress(compression_ratio=r),
                               lambda: kp.ExpectedAttentionPress(compression_ratio=r)),
        "knorm": (lambda: kvpress.KnormPress(compression_ratio=r), lambda: kp.KnormPress(compression_ratio=r)),
    }
    if name not in table:
        raise SystemExit(f"unknown press {name}; known: {', '.join(table)}")
    theirs, ours = table[name]
    return theirs(), ours()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presses", default="snapkv,adakv,pyramidkv,tova,streaming_llm,expected_attention")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--num-layers", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    kvpolicy.set_num_threads(a.threads)
    dt = getattr(torch, a.dtype)
    T, hq, hkv, d, w = a.tokens, a.q_heads, a.kv_heads, a.head_dim, a.window
    g = torch.Generator().manual_seed(1234)
    keys = torch.randn(1, hkv, T, d, generator=g).to(dt)
    values = torch.randn(1, hkv, T, d, generator=g).to(dt)
    hidden = torch.randn(1, T, hq * d, generator=g).to(dt)
    cfg = LlamaConfig(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d,
                      num_hidden_layers=a.num_layers, max_position_embeddings=2 * T)
    cfg._attn_implementation = "sdpa"
    rotary = LlamaRotaryEmbedding(config=cfg)
    cos, sin = rotary(hidden, torch.arange(T).unsqueeze(0))
    kwargs = {"position_embeddings": (cos.to(dt), sin.to(dt))}
    module = types.SimpleNamespace(config=cfg, head_dim=d, layer_idx=a.layer, q_proj=torch.nn.Identity(), rotary_emb=rotary)

    def timed(press):
        wall = []
        for i in range(a.warmup + a.reps):
            t0 = time.perf_counter()
            press.compress(module, hidden, keys, values, None, kwargs)
            t1 = time.perf_counter()
            if i >= a.warmup:
                wall.append((t1 - t0) * 1e3)
        return statistics.median(wall), min(wall)

    rows = []
    with torch.inference_mode():
        for name in [p for p in a.presses.split(",") if p]:
            theirs, ours = make_presses(name, a.ratio, w)
            kv_med, kv_min = timed(theirs)
            our_med, our_min = timed(ours)
            row = {"press": name, "tokens": T, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "window": w, "dtype": a.dtype,
                   "threads": a.threads, "reps": a.reps, "torch": torch.__version__, "kvpolicy_isa": kvpolicy.isa,
                   "kvpress_ms": round(kv_med, 2), "kvpress_min_ms": round(kv_min, 2), "kvpolicy_ms": round(our_med, 2),
                   "kvpolicy_min_ms": round(our_min, 2), "speedup": round(kv_med / our_med, 2)}
            rows.append(row)
            if a.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"{name:<19} kvpress {kv_med:9.1f} ms   kvpolicy {our_med:9.1f} ms   speed-up {kv_med / our_med:6.2f}x", flush=True)
    if not a.json:
        print(f"shape: T={T}, {hq}/{hkv} heads, head_dim {d}, window {w}, r={a.ratio}, {a.dtype}; threads={a.threads} "
              f"(torch and kvpolicy); torch {torch.__version__}; kvpolicy ISA {kvpolicy.isa}; median of {a.reps} after {a.warmup} warm-up")
    return 0


if __name__ == "__main__":
    sys.exit(main())
