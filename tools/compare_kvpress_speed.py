#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Side-by-side speed of the same policy in kvpress (PyTorch, CPU) and kvpolicy.

Both sides make the eviction *decision* of one layer at the end of prefill on identical shapes
(default: 32K tokens, 32 query / 8 kv heads, head_dim 128, fp16 keys and queries, window 64,
compression ratio 0.5) with the same number of threads, and report the median wall time of
`--reps` calls after `--warmup` calls (wall time; the process CPU time per call is printed beside it, which
on a shared machine shows how much of the wall time each process actually ran):

  snapkv     kvpress: SnapKVPress.score(...) followed by scores.topk(n_kept) (what ScorerPress.compress
             does before gathering keys and values);
             kvpolicy: SnapKV::select (KeepSet written, ascending).
  adakv      kvpress: AdaKVPress(SnapKVPress).compress(...) (its decision is module.masked_key_indices);
             kvpolicy: AdaKV<SnapKV>::select with AdaKVParams::kvpress.
  pyramidkv  kvpress: PyramidKVPress.score(...) then topk(get_layer_budget(module, T)) at --layer;
             kvpolicy: PyramidKV::select with PyramidKVParams::kvpress.
  tova       kvpress: TOVAPress.score(...) (the last query's attention, recomputed) then topk(n_kept);
             kvpolicy: TOVA with TOVAParams::kvpress (registry spec tova:compression_ratio=r,protect_last=true).
  expected_attention
             kvpress: ExpectedAttentionPress.score(...) (query statistics over all T pre-RoPE queries, averaged
             RoPE over 512 future positions, covariance and value norms) then topk(n_kept);
             kvpolicy: ExpectedAttention with its kvpress defaults, from the same T pre-RoPE queries and the values.
  observed_attention
             kvpress: ObservedAttentionPress needs the prompt's attention matrix (attn_implementation="eager"):
             its timed work here is what eager attention must produce for it, softmax(Q K^T / sqrt(d) + causal
             mask) in fp32 cast to the model dtype as HF's eager path does, then .score(...) and topk(n_kept);
             kvpolicy: ObservedAttention::kvpress from the T post-RoPE queries (blocked, no T x T matrix).
             Run at --obs-tokens (default 4096): the (q_heads, T, T) matrix takes 6 bytes per entry (fp32
             softmax + fp16 copy), 192 GiB at 32K tokens, which no machine here holds.

kvpress runs its recompute path (attentions=None, as with SDPA/flash attention): the stub module's
q_proj is the identity, so `hidden_states` carries the pre-RoPE queries of the window; RoPE of the 64
window queries is part of kvpress's timed work (kvpolicy receives post-RoPE queries; that step is
negligible). `--torch-dtype float32` re-runs kvpress on fp32 tensors (its fastest CPU path) for
reference. The kvpolicy side is tools/kvp_speed_driver.cpp (built by benchmarks/scoring.cmake).

Usage:
  /work/venv/bin/python tools/compare_kvpress_speed.py --driver build/benchmarks/kvp_speed_driver \
      [--policies snapkv,adakv,pyramidkv] [--threads 1] [--reps 7] [--tokens 32768]

Needs torch and kvpress (pip install kvpress, in a virtual environment outside the repository);
Debian's python3-torch is not a fair baseline (old, without the oneDNN kernels of the PyPI wheels).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
import types


def kvpress_decision(policy: str, args, torch, presses):
    """Returns a zero-argument callable that makes kvpress's decision once."""
    dtype = getattr(torch, args.torch_dtype)
    T, hq, hkv, d, w = args.tokens, args.q_heads, args.kv_heads, args.head_dim, args.window
    gen = torch.Generator().manual_seed(1234)
    keys = torch.randn(1, hkv, T, d, generator=gen).to(dtype)
    values = torch.randn(1, hkv, T, d, generator=gen).to(dtype)
    # hidden_states: (1, T, hq*d); only the last w rows are read (q_proj = identity), the rest stays untouched memory.
    hidden = torch.empty(1, T, hq * d, dtype=dtype)
    hidden[:, -w:] = torch.randn(1, w, hq * d, generator=gen).to(dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    pos = torch.arange(T - w, T, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = torch.empty(1, T, d, dtype=dtype)
    sin = torch.empty(1, T, d, dtype=dtype)
    cos[:, -w:] = emb.cos().to(dtype)
    sin[:, -w:] = emb.sin().to(dtype)
    kwargs = {"position_embeddings": (cos, sin)}
    config = types.SimpleNamespace(num_attention_heads=hq, num_key_value_heads=hkv, num_hidden_layers=args.num_layers,
                                   _attn_implementation="sdpa")
    module = types.SimpleNamespace(config=config, head_dim=d, layer_idx=args.layer, q_proj=torch.nn.Identity())

    n_kept = int(T * (1 - args.ratio))

    def score_then_topk(press, hidden_states, k):
        """What ScorerPress.compress does before gathering keys and values: the press's scores, then the k best per head."""

        def run():
            scores = press.score(module, hidden_states, keys, values, None, kwargs)
            return scores.topk(k, dim=-1).indices

        return run

    if policy == "snapkv":
        run = score_then_topk(presses.SnapKVPress(compression_ratio=args.ratio, window_size=w, kernel_size=args.kernel), hidden, n_kept)
    elif policy == "adakv":
        press = presses.AdaKVPress(presses.SnapKVPress(compression_ratio=args.ratio, window_size=w, kernel_size=args.kernel),
                                   alpha_safeguard=args.alpha)

        def run():
            press.compress(module, hidden, keys, values, None, kwargs)
            return module.masked_key_indices
    elif policy == "pyramidkv":
        press = presses.PyramidKVPress(compression_ratio=args.ratio, window_size=w, kernel_size=args.kernel)
        run = score_then_topk(press, hidden, press.get_layer_budget(module, T))
    elif policy == "tova":
        run = score_then_topk(presses.TOVAPress(compression_ratio=args.ratio), hidden, n_kept)
    elif policy == "expected_attention":
        # Every prompt row is a pre-RoPE query (q_proj = identity); the averaged RoPE needs module.rotary_emb.
        hidden_all = torch.randn(1, T, hq * d, generator=gen).to(dtype)
        module.rotary_emb = HfRotary(d, torch)
        run = score_then_topk(presses.ExpectedAttentionPress(compression_ratio=args.ratio), hidden_all, n_kept)
    elif policy == "observed_attention":
        q_all = torch.randn(1, hq, T, d, generator=gen).to(dtype)  # post-RoPE queries of every prompt position
        press = presses.ObservedAttentionPress(compression_ratio=args.ratio)
        mask = torch.full((T, T), float("-inf")).triu(1)

        def run():
            # What HF's eager attention computes for the press: repeat_kv, scaled logits + causal mask,
            # softmax in fp32, cast back to the model dtype.
            k = keys.repeat_interleave(hq // hkv, dim=1)
            logits = torch.matmul(q_all, k.transpose(2, 3)) / math.sqrt(d) + mask
            attentions = torch.softmax(logits, dim=-1, dtype=torch.float32).to(dtype)
            del logits
            scores = press.score(module, None, keys, values, attentions, kwargs)
            return scores.topk(n_kept, dim=-1).indices
    else:
        raise SystemExit(f"unknown policy {policy}")
    return run


class HfRotary:
    """module.rotary_emb as HF's default RoPE computes it (fp32 angles, cos / sin cast to the input dtype)."""

    def __init__(self, d: int, torch, base: float = 10000.0):
        self.torch = torch
        self.inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))

    def __call__(self, x, position_ids):
        t = self.torch
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]
        emb = t.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def driver_policy(policy: str, args) -> tuple[str, int, int]:
    """kvp_speed_driver's --policy, --tokens and --window for a comparison row."""
    r = args.ratio
    if policy == "tova":
        return f"tova:compression_ratio={r},protect_last=true", args.tokens, args.window
    if policy == "expected_attention":
        return f"expected_attention:compression_ratio={r}", args.tokens, args.tokens  # every prompt query
    if policy == "observed_attention":
        return f"observed_attention:compression_ratio={r}", args.obs_tokens, args.obs_tokens
    return policy, args.tokens, args.window


def time_calls(fn, reps: int, warmup: int) -> tuple[list[float], list[float]]:
    """Wall and process-CPU milliseconds of each timed call."""
    wall, cpu = [], []
    for i in range(warmup + reps):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        t1, c1 = time.perf_counter(), time.process_time()
        if i >= warmup:
            wall.append((t1 - t0) * 1e3)
            cpu.append((c1 - c0) * 1e3)
    return wall, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--driver", required=True, help="path to the kvp_speed_driver executable")
    ap.add_argument("--policies", default="snapkv,adakv,pyramidkv,tova,expected_attention,observed_attention")
    ap.add_argument("--obs-tokens", type=int, default=4096, help="prompt length of the observed_attention row")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--kernel", type=int, default=5)
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--alpha", type=float, default=0.2)
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--num-layers", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--torch-dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                    help="dtype of kvpress's tensors (kvpolicy always reads fp16 keys)")
    ap.add_argument("--json", action="store_true", help="print one JSON line per policy instead of the table")
    args = ap.parse_args()

    import torch
    import kvpress as presses  # SnapKVPress, AdaKVPress, PyramidKVPress

    torch.set_num_threads(args.threads)

    results = []
    for policy in [p for p in args.policies.split(",") if p]:
        spec, tokens, window = driver_policy(policy, args)
        row_args = argparse.Namespace(**{**vars(args), "tokens": tokens})
        with torch.inference_mode():
            fn = kvpress_decision(policy, row_args, torch, presses)
            kv_ms, kv_cpu = time_calls(fn, args.reps, args.warmup)
            del fn
        cmd = [args.driver, "--policy", spec, "--tokens", str(tokens), "--q-heads", str(args.q_heads),
               "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim), "--window", str(window),
               "--kernel", str(args.kernel), "--ratio", str(args.ratio), "--alpha", str(args.alpha),
               "--layer", str(args.layer), "--num-layers", str(args.num_layers), "--threads", str(args.threads),
               "--reps", str(args.reps), "--warmup", str(args.warmup)]
        ours = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        kv_med = statistics.median(kv_ms)
        row = {"policy": policy, "tokens": tokens, "q_heads": args.q_heads, "kv_heads": args.kv_heads,
               "head_dim": args.head_dim, "window": window, "threads": args.threads, "reps": args.reps,
               "kvpress_dtype": args.torch_dtype, "torch": torch.__version__,
               "kvpress_median_ms": round(kv_med, 3), "kvpress_min_ms": round(min(kv_ms), 3),
               "kvpress_cpu_median_ms": round(statistics.median(kv_cpu), 3),
               "kvpolicy_median_ms": ours["median_ms"], "kvpolicy_min_ms": ours["min_ms"],
               "kvpolicy_cpu_median_ms": ours["cpu_median_ms"], "kvpolicy_isa": ours["isa"],
               "speedup": round(kv_med / ours["median_ms"], 2) if ours["median_ms"] > 0 else math.inf,
               "speedup_cpu_time": round(statistics.median(kv_cpu) / ours["cpu_median_ms"], 2) if ours["cpu_median_ms"] > 0 else math.inf}
        results.append(row)
        if args.json:
            print(json.dumps(row), flush=True)

    if not args.json:
        print(f"shapes: T={args.tokens}, {args.q_heads}/{args.kv_heads} heads, head_dim {args.head_dim}, window {args.window}, "
              f"r={args.ratio}; threads={args.threads}; kvpress on torch {torch.__version__} ({args.torch_dtype}); "
              f"median of {args.reps} calls after {args.warmup} warm-up")
        print(f"{'policy':<19} {'tokens':>6} {'kvpress ms':>11} {'kvpolicy ms':>12} {'speedup':>8}   {'cpu-time ms: kvpress':>21} "
              f"{'kvpolicy':>9} {'ratio':>7}  (kvpolicy ISA)")
        for r in results:
            print(f"{r['policy']:<19} {r['tokens']:>6} {r['kvpress_median_ms']:>11.1f} {r['kvpolicy_median_ms']:>12.1f} {r['speedup']:>7.2f}x   "
                  f"{r['kvpress_cpu_median_ms']:>21.1f} {r['kvpolicy_cpu_median_ms']:>9.1f} {r['speedup_cpu_time']:>6.2f}x"
                  f"  ({r['kvpolicy_isa']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
