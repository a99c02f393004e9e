#!/usr/bin/env python3
"""Re-check the golden vectors of algorithms-eviction.md §11 against the installed kvpress.

Run with the fixture venv (see README.md):  /work/venv/bin/python tests/reference/verify_spec_golden.py
Prints every value that differs from the spec by more than 1e-9 (the spec rounds to 10 decimals) and exits
non-zero on any disagreement.
"""
import importlib.metadata
import math
import sys
import types

import torch

from kvpress import (AdaKVPress, ExpectedAttentionPress, ObservedAttentionPress, PyramidKVPress, SnapKVPress,
                     StreamingLLMPress, TOVAPress)

torch.set_default_dtype(torch.float64)
B, HQ, HKV, T, D = 1, 4, 2, 12, 4
G = HQ // HKV


def rope_tables(positions, d, base=10000.0):
    inv = torch.tensor([base ** (-2.0 * i / d) for i in range(d // 2)], dtype=torch.float64)
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


qpre = torch.tensor([[[math.sin(0.25 * (h + 1) * (t + 1) - 0.4 * c) for c in range(D)] for t in range(T)]
                     for h in range(HQ)])
kpre = torch.tensor([[[math.cos(0.5 * (g + 1) + 0.3 * t * (c + 1)) for c in range(D)] for t in range(T)]
                     for g in range(HKV)])
vals = torch.tensor([[[math.sin(0.2 * (g + 1) * (t + 1) + 0.9 * c) + 1.5 for c in range(D)] for t in range(T)]
                     for g in range(HKV)])
cos, sin = rope_tables(torch.arange(T), D)
q = apply_rope(qpre, cos, sin)
k = apply_rope(kpre, cos, sin)
logits = torch.einsum("htc,hsc->hts", q, k.repeat_interleave(G, dim=0)) / math.sqrt(D)
mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
attn = torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1)[None]  # [1,Hq,T,T]
keys, values = k[None], vals[None]
hidden = qpre.transpose(0, 1).reshape(1, T, HQ * D)


class Rotary:
    def __call__(self, x, position_ids):
        c, s = rope_tables(position_ids[0], D)
        return c[None].to(x.dtype), s[None].to(x.dtype)


qproj = torch.nn.Linear(HQ * D, HQ * D, bias=False)
with torch.no_grad():
    qproj.weight.copy_(torch.eye(HQ * D))
module = types.SimpleNamespace(
    layer_idx=0, head_dim=D, q_proj=qproj, rotary_emb=Rotary(), masked_key_indices=None,
    config=types.SimpleNamespace(num_attention_heads=HQ, num_key_value_heads=HKV, num_hidden_layers=32,
                                 _attn_implementation="sdpa"))
kwargs = {"position_embeddings": (cos[None], sin[None])}

bad = 0


def check(name, got, want, tol=1e-9):
    global bad
    got = [float(x) for x in got]
    diff = max(abs(a - b) for a, b in zip(got, want)) if len(got) == len(want) else float("inf")
    ok = diff <= tol
    bad += not ok
    print(f"{'OK  ' if ok else 'DIFF'} {name}: max|diff| = {diff:.3g}")
    if not ok:
        print("   got :", " ".join(f"{x:.10f}" for x in got))
        print("   want:", " ".join(f"{x:.10f}" for x in want))


def parse(s):
    return [float(x) for x in s.split()]


with torch.no_grad():
    snap = SnapKVPress(compression_ratio=0.5, window_size=3, kernel_size=3)
    s_att = snap.score(module, hidden, keys, values, attn, {})
    want = [parse("0.0601205206 0.0919918344 0.092666697 0.0944700379 0.0923056415 0.0875673948 0.08966102 "
                  "0.0882648537 0.0589748768 1.1022074042 1.1022074042 1.1022074042"),
            parse("0.0563088626 0.08301497 0.0814580114 0.0842922597 0.0862682352 0.0891448109 0.0955356365 "
                  "0.1022074042 0.0706560419 1.1022074042 1.1022074042 1.1022074042")]
    for h in range(HKV):
        check(f"SnapKV attentions-path h{h}", s_att[0, h], want[h])
    s_rec = snap.score(module, hidden, keys, values, None, kwargs)
    for h in range(HKV):
        check(f"SnapKV recompute-path h{h}", s_rec[0, h], want[h], tol=1e-8)
    kept = [sorted(snap.score(module, hidden, keys, values, attn, {})[0, h].topk(6).indices.tolist())
            for h in range(HKV)]
    check("SnapKV kept h0", kept[0], [2, 3, 4, 9, 10, 11], 0)
    check("SnapKV kept h1", kept[1], [5, 6, 7, 9, 10, 11], 0)

    tova = TOVAPress(compression_ratio=0.5).score(module, hidden, keys, values, attn, {})
    want_t = parse("0.0904457321 0.0709299595 0.0787085502 0.0838177183 0.0739060762 0.0741375382 0.0907305992 "
                   "0.1035822777 0.0719727796 0.1057962784 0.0846636382 1.1057962784")
    for h in range(HKV):
        check(f"TOVA attentions-path h{h}", tova[0, h], want_t)
    tova_r = TOVAPress(compression_ratio=0.5).score(module, hidden, keys, values, None, kwargs)
    check("TOVA recompute-path h0", tova_r[0, 0], want_t, tol=1e-8)

    obs = ObservedAttentionPress(compression_ratio=0.5).score(module, hidden, keys, values, attn, {})
    want_o = [parse("0.3133542671 0.1964031608 0.1330593796 0.1106263298 0.1122726602 0.1166411026 0.1041945946 "
                    "0.0990454093 0.0927701534 0.0992288506 0.0889577072 0.071337068"),
              parse("0.2906092943 0.1605619693 0.1458722449 0.1480351373 0.1217043402 0.107857301 0.1165745607 "
                    "0.1115094058 0.1033133463 0.1067771476 0.0824862177 0.0712806368")]
    for h in range(HKV):
        check(f"ObservedAttention h{h}", obs[0, h], want_o[h])

    st = StreamingLLMPress(compression_ratio=0.5, n_sink=2).score(module, hidden, keys, values, None, {})
    for h in range(HKV):
        check(f"StreamingLLM h{h}", st[0, h], parse("1 1 0 0 0 0 0 0 1 1 1 1"), 0)

    ea = ExpectedAttentionPress(compression_ratio=0.5, n_future_positions=4, n_sink=2).score(
        module, hidden, keys, values, None, {})
    want_e = [parse("1.5267607596 1.5267607596 0.3256754954 0.3214761585 0.3434124955 0.3562943172 0.334817277 "
                    "0.2790828787 0.2600226625 0.3444271409 0.5267607596 0.3404162507"),
              parse("1.5267607596 1.5267607596 0.395012741 0.3314230975 0.3063121061 0.2619584812 0.2113299292 "
                    "0.187134118 0.1875310504 0.2633950249 0.3543833242 0.3002442649")]
    for h in range(HKV):
        check(f"ExpectedAttention h{h}", ea[0, h], want_e[h])

    for path, att, kw in (("attentions", attn, {}), ("recompute", None, kwargs)):
        ada = AdaKVPress(SnapKVPress(compression_ratio=0.5, window_size=3, kernel_size=3), alpha_safeguard=0.2)
        module.masked_key_indices = None
        ada.compress(module, hidden, keys, values, att, kw)
        b_idx, h_idx, t_idx = module.masked_key_indices
        masked = [sorted(t_idx[h_idx == h].tolist()) for h in range(HKV)]
        check(f"AdaKV({path}) masked h0", masked[0], [0, 5, 6, 7, 8], 0)
        check(f"AdaKV({path}) masked h1", masked[1], [0, 1, 2, 3, 4, 5, 8], 0)

    pyr = PyramidKVPress(compression_ratio=0.5, window_size=64, beta=20)
    budgets = []
    for layer in range(32):
        m = types.SimpleNamespace(layer_idx=layer, config=types.SimpleNamespace(num_hidden_layers=32))
        budgets.append(pyr.get_layer_budget(m, 1024))
    check("PyramidKV budgets T=1024 r=.5 w=64 NL=32", budgets, parse(
        "960 931 902 873 844 815 787 758 729 700 671 642 613 584 555 526 498 469 440 411 382 353 324 295 266 237 "
        "209 180 151 122 93 64"), 0)
    m = types.SimpleNamespace(layer_idx=5, config=types.SimpleNamespace(num_hidden_layers=32))
    check("PyramidKV fallback T=1024 r=.9", [PyramidKVPress(compression_ratio=0.9, window_size=64).get_layer_budget(
        m, 1024)], [102], 0)
    from kvpress.utils import compute_n_kept
    check("n_kept(1000, 0.8) == 199", [compute_n_kept(1000, 0.8)], [199], 0)

print(f"kvpress {importlib.metadata.version('kvpress')}, torch {torch.__version__}: "
      f"{'all §11 vectors agree' if not bad else f'{bad} disagreement(s)'}")
sys.exit(1 if bad else 0)
