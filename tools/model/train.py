"""Train kvp-tiny on the retrieval mixture (tools/model/tasks.py), on CPU, reproducibly.

    tools/model/train_kvp_tiny.sh                              # the committed model: the exact sequence of runs
    /work/venv/bin/python tools/model/train.py [options]       # one run (phase 1 [+ phase 2]); --help
    /work/venv/bin/python tools/model/train.py --resume ...    # continue from the checkpoint in --ckpt

Determinism: one torch thread by default, torch.manual_seed(seed) for the initialisation, a random.Random(seed)
stream for the data; the checkpoint stores the data RNG state, so a run resumed with --resume sees the same batches
(same seed + torch version + thread count -> same weights; other BLAS builds may differ in the last bits).

Phase 1 (--steps): a curriculum of increasing sequence length at a constant 4096 tokens per step:
  first 15 % of the steps: length 128, batch 32    15-35 %: length 256, batch 16
  35-55 %: length 512, batch 8                      last 45 %: length 1024, batch 4
Batch rows cycle through passkey, multikey, copy and an auxiliary "induction" sequence (a random string of
upper-case letters and digits written twice back to back in filler, the repeat supervised -- tasks.make_induction).
Training copy strings are 8..min(48, length/4) letters (evaluation: 16) and multikey samples are queried several
times, so most sequences carry tens of answer tokens. AdamW(lr 2e-3, betas (0.9, 0.95), weight decay 0.01 on
matrices), 100 warm-up steps, cosine decay to 10 %, gradient clipping at 1.0.
Phase 2 (--finetune-steps N, after the --steps of phase 1; resuming with --steps equal to the checkpoint's step
starts it at once): --ft-length / --ft-batch / --ft-mix (row kinds cycled; default one passkey and two multikey
rows, the fourth cycling multikey/passkey/copy/induction), lr --ft-lr (20 warm-up steps, cosine to 10 %).
--stop-at ends a run at a step (the checkpoint is saved there), which is how the phases of
train_kvp_tiny.sh hand over.
Loss: the answer tokens' cross-entropy -- with --balanced-loss (default) the mean over the row kinds present of
each kind's mean, weighted by --task-weights -- plus 0.1 x the mean cross-entropy of every other next-token
prediction (a weak language-model term on the filler).
Data options: --dense-keys (multikey samples with up to min(12, length/20) keys and queries filling up to a third
of the sequence; induction strings of random length), --min-keys (fewest keys per multikey sample), --copy-marker
(the '@' copy format, tasks.py).

What the phases are for (models/kvp-tiny/README.md has the numbers): phase-1 training learns passkey and copy
quickly but not multi-key recall. Its induction strings all have the same length at a given sequence length, so
"attend 63 tokens back" solves them without looking at content (the model scored 98 % on them and 2 % on
random-length ones); multi-key recall then stays at "copy the digits after some key" (1 / number of keys).
Random-length strings alone (--ft-mix induction) make content-based induction form within ~600 steps; dense
multi-key samples afterwards teach the key lookup; passkey and copy are then re-learned through it.
(Earlier history: a 3-layer model trained only with phase 1 for 2500 steps reached passkey 8 %, multikey 0 %,
copy 100 %; separating the two copies of the induction string by filler never left the initial plateau in 700
steps -- the back-to-back repeat is what breaks it -- and an older multikey format with " is " between key and
value reached 13 %.)

Every --save-every steps the weights go to <out>/model.safetensors + config.json and the resumable state to
<ckpt>/state.pt. At the end the fixed evaluation set (tasks.make_eval_set: seed 1234, 100 samples per task,
length 1024, in the run's task formats) is scored and written to --results. Exact match under teacher forcing
equals exact match of greedy decoding (if every forced argmax equals the answer token, greedy decoding produces
exactly the answer), so one forward pass per sample scores it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import PAD, Config, TinyLlama, state_dict_for_export  # noqa: E402
import tasks  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# (fraction of the run at which the stage starts, length, batch): 4096 tokens per step throughout
STAGES = ((0.0, 128, 32), (0.15, 256, 16), (0.35, 512, 8), (0.55, 1024, 4))


def stage_of(step: int, total: int) -> tuple[int, int]:
    p = step / total
    length, batch = STAGES[0][1:]
    for start, L, B in STAGES:
        if p >= start:
            length, batch = L, B
    return length, batch


def finetune_lr(i: int, total: int, base: float = 1e-3, warmup: int = 20, floor: float = 0.1) -> float:
    if i < warmup:
        return base * (i + 1) / warmup
    p = (i - warmup) / max(1, total - warmup)
    return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def lr_at(step: int, total: int, base: float, warmup: int = 100, floor: float = 0.1) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


MAIN_MIX = tasks.TASKS + ("induction",)


def finetune_mix(step: int) -> tuple[str, ...]:
    """Phase 2: per batch one passkey and two multikey sequences, the fourth cycling multikey/passkey/copy/induction."""
    return ("passkey", "multikey", "multikey", ("multikey", "passkey", "copy", "induction")[step % 4])


def make_batch(filler, rng, length, batch, mix=MAIN_MIX, min_keys=1, dense_keys=False, copy_marker=True):
    """Token ids [batch, length], the answer mask and the task of every row."""
    ids = torch.empty(batch, length, dtype=torch.long)
    ans = torch.zeros(batch, length, dtype=torch.bool)  # marks target positions (predicting ids[t]) inside answers
    for b in range(batch):
        task = mix[b % len(mix)]
        if task == "induction":
            seq, spans = tasks.make_induction(filler, rng, length, random_len=dense_keys)
        elif task == "multikey":
            if dense_keys:
                # Dense multi-query recall: up to 12 keys (length/20), queries filling up to a third of the
                # sequence; with many keys, "copy the digits after some key" scores 1/n_keys, so only matching
                # the queried key's letters pays.
                n_keys = rng.randint(min_keys, max(min_keys, min(12, length // 20)))
                room = (length - 13 * n_keys) // 19
                n_queries = rng.randint(1, max(1, min(8, room // 3)))
            else:
                n_keys = rng.randint(min_keys, max(min_keys, min(8, length // 64)))
                n_queries = rng.randint(1, min(8, length // 64))
            _, seq, spans = tasks.make_sample(filler, rng, task, length, n_keys=n_keys, n_queries=n_queries,
                                              copy_marker=copy_marker)
        elif task == "copy":
            _, seq, spans = tasks.make_sample(filler, rng, task, length, copy_len=rng.randint(8, min(48, length // 4)),
                                              copy_marker=copy_marker)
        else:
            _, seq, spans = tasks.make_sample(filler, rng, task, length, copy_marker=copy_marker)
        ids[b] = torch.tensor(seq)
        for s, e in spans:
            ans[b, s:e] = True
    return ids, ans, [mix[b % len(mix)] for b in range(batch)]


def answer_loss(ce, m, row_tasks, balanced, weights=None):
    """Mean cross-entropy over answer tokens; balanced: the weighted mean over task kinds of each kind's mean."""
    if not balanced:
        return ce[m].mean()
    parts, ws = [], []
    for t in dict.fromkeys(row_tasks):
        rows = torch.tensor([r == t for r in row_tasks])
        mt = m & rows[:, None]
        if mt.any():
            parts.append(ce[mt].mean())
            ws.append((weights or {}).get(t, 1.0))
    w = torch.tensor(ws)
    return (torch.stack(parts) * w).sum() / w.sum()


@torch.no_grad()
def evaluate(model, samples, chunk=8):
    """Per-task exact-match accuracy (teacher-forced argmax == answer for every answer token)."""
    model.eval()
    correct = {t: 0 for t in tasks.TASKS}
    count = {t: 0 for t in tasks.TASKS}
    for i in range(0, len(samples), chunk):
        group = samples[i:i + chunk]
        L = max(len(s.prompt) + len(s.answer) for s in group)
        ids = torch.full((len(group), L), PAD, dtype=torch.long)
        for b, s in enumerate(group):
            seq = s.prompt + s.answer
            ids[b, :len(seq)] = torch.tensor(seq)
        logits = model(ids)
        for b, s in enumerate(group):
            p = len(s.prompt)
            pred = logits[b, p - 1:p - 1 + len(s.answer)].argmax(-1).tolist()
            correct[s.task] += int(pred == s.answer)
            count[s.task] += 1
    model.train()
    return {t: correct[t] / max(1, count[t]) for t in tasks.TASKS}


def save_weights(model, out_dir):
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, "model.safetensors.tmp")
    save_file(state_dict_for_export(model), tmp, metadata={"format": "pt", "model": "kvp-tiny"})
    os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        f.write(model.c.to_json() + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--finetune-steps", type=int, default=0)
    ap.add_argument("--ft-length", type=int, default=1024)
    ap.add_argument("--ft-mix", default="", help="comma-separated row kinds of a phase-2 batch, cycled (default: finetune_mix)")
    ap.add_argument("--stop-at", type=int, default=0, help="end the run after this step (checkpoint saved), 0: run to the end")
    ap.add_argument("--ft-batch", type=int, default=4)
    ap.add_argument("--ft-lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--out", default=os.path.join(ROOT, "models", "kvp-tiny"))
    ap.add_argument("--ckpt", default=os.path.join(ROOT, "_engine_train"))
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--balanced-loss", type=int, default=1)
    ap.add_argument("--min-keys", type=int, default=1, help="fewest needles in a multikey training sample")
    ap.add_argument("--copy-marker", type=int, default=1, help="copy format with the '@' marker (tasks.py)")
    ap.add_argument("--dense-keys", type=int, default=0, help="dense multikey samples and random-length induction strings")
    ap.add_argument("--task-weights", default="", help="answer-loss weights, e.g. multikey=2 (default 1 each)")
    ap.add_argument("--results", default=os.path.join(ROOT, "tools", "model", "eval_results.json"))
    args = ap.parse_args()

    weights = {k: float(v) for k, v in (kv.split("=") for kv in args.task_weights.split(",") if kv)}
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    filler = tasks.Filler()
    cfg = Config(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                 head_dim=args.d_model // args.heads, ffn_hidden=args.ffn)
    model = TinyLlama(cfg)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    rng = random.Random(args.seed)
    step, elapsed = 0, 0.0
    os.makedirs(args.ckpt, exist_ok=True)
    state_path = os.path.join(args.ckpt, "state.pt")
    if args.resume and os.path.exists(state_path):
        st = torch.load(state_path, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        rng.setstate(st["rng"])
        torch.set_rng_state(st["torch_rng"])
        step, elapsed = st["step"], st["elapsed"]
        print(f"resumed at step {step}", flush=True)

    quick_eval = tasks.make_eval_set(filler, seed=999, per_task=8, length=1024, copy_marker=bool(args.copy_marker))
    log = open(os.path.join(args.ckpt, "train_log.txt"), "a")
    t_last = time.time()
    model.train()
    total = args.steps + args.finetune_steps
    if args.stop_at:
        total = min(total, args.stop_at)
    while step < total:
        if step < args.steps:
            length, batch = stage_of(step, args.steps)
            lr = lr_at(step, args.steps, args.lr)
            mix = MAIN_MIX
        else:
            length, batch = args.ft_length, args.ft_batch
            lr = finetune_lr(step - args.steps, args.finetune_steps, base=args.ft_lr)
            mix = tuple(args.ft_mix.split(",")) if args.ft_mix else finetune_mix(step)
        for g in opt.param_groups:
            g["lr"] = lr
        ids, ans, row_tasks = make_batch(filler, rng, length, batch, mix, args.min_keys, bool(args.dense_keys),
                                         bool(args.copy_marker))
        logits = model(ids[:, :-1])
        tgt = ids[:, 1:]
        m = ans[:, 1:]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none").view_as(tgt)
        loss_ans = answer_loss(ce, m, row_tasks, args.balanced_loss, weights)
        loss_lm = ce[~m].mean()
        loss = loss_ans + 0.1 * loss_lm
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        now = time.time()
        elapsed += now - t_last
        t_last = now
        if step % 10 == 0:
            msg = (f"step {step} len {length} lr {lr:.2e} loss_ans {loss_ans.item():.4f} "
                   f"loss_lm {loss_lm.item():.4f} elapsed {elapsed / 60:.1f} min")
            print(msg, flush=True)
            log.write(msg + "\n")
            log.flush()
        if step % args.eval_every == 0 or step == total:
            acc = evaluate(model, quick_eval)
            msg = f"step {step} quick-eval@1024 " + " ".join(f"{k} {v:.3f}" for k, v in acc.items())
            print(msg, flush=True)
            log.write(msg + "\n")
            log.flush()
            t_last = time.time()  # evaluation time is not training time
        if step % args.save_every == 0 or step == total:
            save_weights(model, args.out)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": rng.getstate(),
                        "torch_rng": torch.get_rng_state(), "step": step, "elapsed": elapsed},
                       state_path + ".tmp")
            os.replace(state_path + ".tmp", state_path)

    final = evaluate(model, tasks.make_eval_set(filler, copy_marker=bool(args.copy_marker)))
    result = {"steps": step, "train_minutes": round(elapsed / 60, 1), "threads": args.threads, "seed": args.seed,
              "filler_sha256": filler.sha256, "filler_sources": filler.sources,
              "eval": {"seed": 1234, "per_task": 100, "length": 1024, "accuracy": final},
              "torch": torch.__version__}
    with open(args.results, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2), flush=True)


if __name__ == "__main__":
    main()
