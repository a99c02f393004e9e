#!/usr/bin/env python3
"""PyTorch on the same GPU and shapes as benchmarks/bench_cuda_policies.cpp.

- snapkv/T: kvpress's SnapKV scoring as kvpress 0.5.5 computes it (repeat_kv,
  q.kT / sqrt(d) in the cache dtype, causal mask on the window, fp32 softmax,
  mean over the window, avg_pool1d(5), mean over the group), then topk of
  int(T * 0.5) minus the window. One difference, in the reference's favour:
  the window is padded with +inf instead of kvpress's `scores.max().item()`,
  which would synchronise the stream.
- topk/n/pct: torch.topk(sorted=False) of 8 rows of n fp32 scores.
- h2o_step/C: one H2O decode step (32 query heads, 8 kv heads, C slots):
  group sums of the step's probabilities added to the state, the lowest slot
  of the candidates dropped per head and the state re-packed (a gather, no
  boolean mask, so no synchronisation); CUDA-graph replay.
- quest/B: Quest's bounds for B sequences of 32K tokens (page 16, fp16
  metadata gathered through a shuffled page table, fp32 products, max of
  q*M and q*m summed over head_dim) and topk(127) per query head; graph replay.

Times are medians of CUDA-event timings after warm-up. Writes JSON to argv[1].
"""
import json
import math
import statistics
import sys

import torch
import torch.nn.functional as F


def median_ms(fn, reps=30, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_ms(fn):
    """Median time of a CUDA-graph replay of fn (captured after warm-up on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return median_ms(g.replay)


def snapkv_kvpress(q, k, window, kernel, n_keep):
    hq, _, d = q.shape
    hkv, t, _ = k.shape
    g = hq // hkv
    kr = k.repeat_interleave(g, dim=0)
    attn = torch.matmul(q, kr.transpose(-1, -2)) / math.sqrt(d)
    mask = torch.full((window, window), float("-inf"), device=q.device, dtype=attn.dtype).triu(1)
    attn[..., -window:] += mask
    attn = torch.softmax(attn, dim=-1, dtype=torch.float32)
    scores = attn[..., :-window].mean(dim=-2)
    scores = F.avg_pool1d(scores, kernel_size=kernel, padding=kernel // 2, stride=1)
    scores = scores.view(hkv, g, t - window).mean(1)
    scores = F.pad(scores, (0, window), value=float("inf"))
    return scores.topk(n_keep, dim=-1).indices


def main():
    out_path = sys.argv[1]
    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cases": {}}
    gen = torch.Generator(device=dev).manual_seed(1)
    hq, hkv, d, w = 32, 8, 128, 64
    for t in (4096, 32768):
        q = torch.randn(hq, w, d, device=dev, generator=gen, dtype=torch.float16)
        k = torch.randn(hkv, t, d, device=dev, generator=gen, dtype=torch.float16)
        n_keep = int(t * 0.5)
        res["cases"][f"snapkv/{t}"] = {"median_ms": median_ms(lambda: snapkv_kvpress(q, k, w, 5, n_keep))}
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                snapkv_kvpress(q, k, w, 5, n_keep)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            snapkv_kvpress(q, k, w, 5, n_keep)
        res["cases"][f"snapkv_graph/{t}"] = {"median_ms": median_ms(g.replay)}
    for c in (4096, 32768):
        state = torch.rand(8, c + 1, device=dev, generator=gen)
        probs = torch.rand(32, 1, c + 1, device=dev, generator=gen)
        recent = c - c // 2
        ar = torch.arange(c, device=dev)[None, :]

        def h2o_step():
            col = probs[:, 0, :].view(8, 4, c + 1).sum(1)
            state[:, :c] += col[:, :c]
            state[:, c] = col[:, c]
            victim = state[:, : c + 1 - recent].argmin(-1)
            idx = ar + (ar >= victim[:, None]).to(ar.dtype)
            state[:, :c] = torch.gather(state, 1, idx)

        res["cases"][f"h2o_step/{c}"] = {"median_ms": graph_ms(h2o_step)}
    for b in (1, 16):
        pages, hkv, g, d = 2048, 8, 4, 128
        meta = torch.randn(b * pages, hkv, 2, d, device=dev, generator=gen).half()
        ids = torch.randperm(b * pages, device=dev, generator=gen).view(b, pages)
        q = torch.randn(b, hkv, g, d, device=dev, generator=gen)

        def quest():
            m = meta[ids[:, :-1]].float()  # (b, n-1, hkv, 2, d)
            mx, mn = m[..., 0, :].permute(0, 2, 1, 3), m[..., 1, :].permute(0, 2, 1, 3)  # (b, hkv, n-1, d)
            qq = q[:, :, :, None, :]
            bound = torch.maximum(qq * mx[:, :, None], qq * mn[:, :, None]).sum(-1)  # (b, hkv, g, n-1)
            return bound.topk(127, dim=-1, sorted=False).indices

        res["cases"][f"quest/{b}"] = {"median_ms": graph_ms(quest)}
    for n in (8192, 32768, 131072):
        x = torch.rand(8, n, device=dev, generator=gen)
        for pct in (1, 50):
            kk = max(1, n * pct // 100)
            res["cases"][f"topk/{n}/{pct}"] = {"median_ms": median_ms(lambda: torch.topk(x, kk, dim=-1, sorted=False))}
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
