"""Write the fixtures the C++ engine tests compare against (tests/data/engine/).

    /work/venv/bin/python tools/model/export_fixtures.py [--model models/kvp-tiny]

  logits.json    for a few prompts: PyTorch fp32 logits at a few prompt positions, the greedy continuation and the
                 logits of each greedy decode step (computed by full recomputation, model.greedy_decode);
  eval_set.json  the fixed evaluation set (tasks.make_eval_set: seed 1234, 100 samples per task, 1024 tokens) with
                 the PyTorch full-cache correctness of every sample and the per-task accuracy.
Both record the sha256 of model.safetensors so a test can tell stale fixtures from a changed model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import BOS, load_model  # noqa: E402
import tasks  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read())
    return h.hexdigest()


def text_of(ids: list[int]) -> str:
    assert ids[0] == BOS and all(0 <= t < 128 for t in ids[1:])
    return bytes(ids[1:]).decode("ascii")


@torch.no_grad()
def logits_fixture(model, filler):
    rng = random.Random(4321)
    prompts = [
        ("short", [BOS] + list(b"the quick brown fox jumps over the lazy dog. the pass key is ")),
        ("passkey_256", tasks.make_sample(filler, rng, "passkey", 256)[0].prompt),
        ("multikey_640", tasks.make_sample(filler, rng, "multikey", 640, n_keys=6)[0].prompt),
        ("copy_1024", tasks.make_sample(filler, rng, "copy", 1024)[0].prompt),
    ]
    n_new, n_step_logits = 8, 4
    out = []
    for name, ids in prompts:
        T = len(ids)
        logits = model(torch.tensor([ids]))[0]
        positions = sorted({0, 1, T // 2, T - 1})
        seq = list(ids)
        gen, step_logits = [], []
        for i in range(n_new):
            lg = model(torch.tensor([seq]))[0, -1]
            if 0 < i <= n_step_logits:  # logits after feeding generated token i-1 (a decode step)
                step_logits.append(lg.tolist())
            t = int(torch.argmax(lg))
            gen.append(t)
            seq.append(t)
        out.append({"name": name, "prompt": text_of(ids), "positions": positions,
                    "logits": [logits[p].tolist() for p in positions], "greedy": gen,
                    "decode_step_logits": step_logits})
    return out


@torch.no_grad()
def eval_fixture(model, filler):
    samples = tasks.make_eval_set(filler)
    correct = []
    for s in samples:
        seq = s.prompt + s.answer
        lg = model(torch.tensor([seq]))[0]
        p = len(s.prompt)
        pred = lg[p - 1:p - 1 + len(s.answer)].argmax(-1).tolist()
        correct.append(pred == s.answer)
    acc = {}
    for t in tasks.TASKS:
        idx = [i for i, s in enumerate(samples) if s.task == t]
        acc[t] = {"correct": sum(correct[i] for i in idx), "count": len(idx)}
    rows = [{"task": s.task, "prompt": text_of(s.prompt), "answer": bytes(s.answer).decode("ascii"),
             "needle_pos": s.needle_pos, "torch_correct": bool(c)} for s, c in zip(samples, correct)]
    return rows, acc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "kvp-tiny"))
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "data", "engine"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = load_model(args.model)
    filler = tasks.Filler()
    sha = sha256_file(os.path.join(args.model, "model.safetensors"))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "logits.json"), "w") as f:
        json.dump({"model_sha256": sha, "torch": torch.__version__, "prompts": logits_fixture(model, filler)}, f)
    rows, acc = eval_fixture(model, filler)
    with open(os.path.join(args.out, "eval_set.json"), "w") as f:
        json.dump({"model_sha256": sha, "seed": 1234, "per_task": 100, "length": 1024, "filler_sha256": filler.sha256,
                   "torch_accuracy": acc, "samples": rows}, f, indent=0)
    print(json.dumps(acc))


if __name__ == "__main__":
    main()
