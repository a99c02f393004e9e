"""Long-context retrieval tasks for kvp-tiny: passkey retrieval, multi-key associative recall, copying.

Filler is real English text: the license texts Debian ships in /usr/share/common-licenses (package base-files),
read at run time, files sorted by name, symlinks resolved and de-duplicated (FILLER_SOURCES below lists what is
read; the model card records the sha256 of the normalised corpus used for training). Normalisation: lower-case,
digits removed, every non-printable byte / newline / tab becomes a space, whitespace runs collapse to one space.
Because of that, upper-case letters and digits never occur in filler: they are the needle alphabet, so a needle
is unambiguous and its answer can only be read from the needle itself.

Formats (byte tokens; the prompt starts with BOS; the model must continue with exactly `answer`):
  passkey  needle " the pass key is 48213. remember it. "      query " what is the pass key? the pass key is "
           answer "48213" (5 digits)
  multikey needles " key XQ4821. " (n_keys of them, distinct 2-letter upper-case keys, 4-digit values)
           query " recall key XQ"                                 answer "4821"
  copy     needle " copy this: @KXJQWMZLPRTAHBNE. "             query " repeat the copied text: @"
           answer the 16 upper-case letters
Multikey format decision: the value follows the key letters directly and the prompt ends with the key, so the
lookup is an induction step ("find the earlier 'XQ', copy what followed"). An earlier format, needle
" key XQ is 4821. " / query " what is key XQ? key XQ is ", put " is " between key and value in both places; every
needle then ends in the same tokens before its value and the model, after 100 minutes of training, reached only 13 %:
it copied the digits of a random needle (teacher-forced later digits were right, the first digit was a guess).
Copy format decision: the copied string is preceded by "@" in the needle and the query ends with "@" (a byte
that never occurs in the filler), so the first letter is found the way every later one is -- by matching the
previous token. Without the marker (copy_marker=False; used in the first training phases, see
models/kvp-tiny/README.md) the query's " text: " must be linked to the needle's " this: " by a learned, format-
specific lookup; once the model had learned content-based induction (needed for multi-key recall), it lost that
lookup and output one constant letter, with every later letter right.
Needles are placed at uniformly random depths in the filler. For evaluation the prompt plus the answer is exactly
`length` tokens (1024 by default), one query per prompt, the last query names one of the needles.
"""

from __future__ import annotations

import glob
import hashlib
import os
import random
import string
from dataclasses import dataclass

from model import BOS

FILLER_GLOB = "/usr/share/common-licenses/*"
TASKS = ("passkey", "multikey", "copy")


def filler_sources() -> list[str]:
    seen, out = set(), []
    for p in sorted(glob.glob(FILLER_GLOB)):
        rp = os.path.realpath(p)
        if os.path.isfile(rp) and rp not in seen:
            seen.add(rp)
            out.append(rp)
    return out


def normalise(text: str) -> str:
    out = []
    prev_space = False
    for ch in text.lower():
        if ch.isdigit():
            continue
        if not (32 <= ord(ch) < 127) or ch.isspace():
            ch = " "
        if ch == " ":
            if prev_space:
                continue
            prev_space = True
        else:
            prev_space = False
        out.append(ch)
    return "".join(out)


class Filler:
    def __init__(self):
        self.sources = filler_sources()
        if not self.sources:
            raise RuntimeError(f"no filler text found at {FILLER_GLOB}")
        parts = []
        for p in self.sources:
            with open(p, "rb") as f:
                parts.append(normalise(f.read().decode("utf-8", errors="replace")))
        self.text = " ".join(parts)
        assert not any(c.isdigit() or c.isupper() for c in self.text)
        self.sha256 = hashlib.sha256(self.text.encode()).hexdigest()

    def take(self, rng: random.Random, n: int) -> str:
        if n <= 0:
            return ""
        start = rng.randrange(len(self.text))
        s = self.text[start:start + n]
        while len(s) < n:
            s += " " + self.text[: n - len(s) - 1]
        return s[:n]


@dataclass
class Sample:
    task: str
    prompt: list[int]  # token ids, starts with BOS
    answer: list[int]  # byte ids the model must produce greedily
    needle_pos: list[int]  # token index where each needle string starts (for policy tests)


def _digits(rng, n):
    return "".join(rng.choice(string.digits) for _ in range(n))


def _upper(rng, n):
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(n))


def _assemble(filler: Filler, rng: random.Random, needles: list[str], tail: str, total_chars: int):
    """BOS + filler with needles at random depths + tail, where len(prompt tokens) == 1 + total_chars."""
    n_fill = total_chars - sum(len(n) for n in needles) - len(tail)
    if n_fill < len(needles):
        raise ValueError("length too short for the needles")
    text = filler.take(rng, n_fill)
    cuts = sorted(rng.randrange(0, n_fill + 1) for _ in needles)
    pieces, pos, prev, needle_pos = [], 1, 0, []
    for cut, nd in zip(cuts, needles):
        pieces.append(text[prev:cut])
        pos += cut - prev
        needle_pos.append(pos)
        pieces.append(nd)
        pos += len(nd)
        prev = cut
    pieces.append(text[prev:])
    pieces.append(tail)
    s = "".join(pieces)
    assert len(s) == total_chars
    return [BOS] + list(s.encode("ascii")), needle_pos


def make_sample(filler: Filler, rng: random.Random, task: str, length: int, n_keys: int = 6,
                n_queries: int = 1, copy_len: int = 16, copy_marker: bool = True) -> tuple[Sample, list[int], list[tuple[int, int]]]:
    """One sample whose full sequence (prompt + answers [+ extra queries]) is `length` tokens.

    With n_queries > 1 (multikey training only) further query/answer pairs follow the first answer; copy_len
    (training only) changes the length of the copied string. Returns the
    Sample (first query only), the full token sequence and the (start, end) spans of every answer in it."""
    if task == "passkey":
        key = _digits(rng, 5)
        needles = [f" the pass key is {key}. remember it. "]
        qa = [(" what is the pass key? the pass key is ", key)]
    elif task == "multikey":
        keys = set()
        while len(keys) < n_keys:
            keys.add(_upper(rng, 2))
        keys = sorted(keys)
        rng.shuffle(keys)
        vals = [_digits(rng, 4) for _ in keys]
        needles = [f" key {k}{v}. " for k, v in zip(keys, vals)]
        qidx = [rng.randrange(n_keys) for _ in range(n_queries)]
        qa = [(f" recall key {keys[i]}", vals[i]) for i in qidx]
    elif task == "copy":
        s = _upper(rng, copy_len)
        m = "@" if copy_marker else ""
        needles = [f" copy this: {m}{s}. "]
        qa = [(f" repeat the copied text: {m}", s)]
    else:
        raise ValueError(task)
    # tail = first query; extra (query, answer) pairs are appended after the first answer (".")
    extra = "".join(f".{q}{a}" for q, a in qa[1:])
    total_chars = length - 1 - len(qa[0][1]) - len(extra)
    prompt, needle_pos = _assemble(filler, rng, needles, qa[0][0], total_chars)
    answer = list(qa[0][1].encode("ascii"))
    seq = prompt + answer
    spans = [(len(prompt), len(seq))]
    for q, a in qa[1:]:
        seq += list(f".{q}".encode("ascii"))
        spans.append((len(seq), len(seq) + len(a)))
        seq += list(a.encode("ascii"))
    assert len(seq) == length, (len(seq), length)
    return Sample(task, prompt, answer, needle_pos), seq, spans


def make_induction(filler: Filler, rng: random.Random, length: int, random_len: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
    """Training-only auxiliary: a random string S of upper-case letters and digits, n = min(63, (length-1)//2)
    characters, written twice back to back at a random depth in filler: BOS + filler + S + S + filler. The repeat
    (but its first character) is supervised. Only an induction circuit (find the previous occurrence of the current
    token, copy its successor) predicts it, and that circuit is what every task above needs; this dense signal is
    what gets training past its initial plateau. Bounding n keeps S's own repeated characters rare enough that one
    or two tokens of context identify where to copy from, at every length. With random_len, n is drawn from
    [8, that bound] per sample: at a fixed length a constant n lets "attend n tokens back" -- a positional head --
    solve the task without any content matching, which is no help to multi-key recall."""
    n = min(63, (length - 1) // 2)
    if random_len:  # a string length drawn per sample: the repeat's offset varies, so only content can locate it
        n = rng.randint(min(8, n), n)
    s = "".join(rng.choice(string.ascii_uppercase + string.digits) for _ in range(n))
    n_fill = length - 1 - 2 * n
    text = filler.take(rng, n_fill)
    c = rng.randrange(0, n_fill + 1)
    seq = [BOS] + list((text[:c] + s + s + text[c:]).encode("ascii"))
    start = 1 + c + n  # index of the repeat
    assert len(seq) == length and bytes(seq[start:start + n]).decode() == s
    return seq, [(start + 1, start + n)]


def make_eval_set(filler: Filler, seed: int = 1234, per_task: int = 100, length: int = 1024,
                  copy_marker: bool = True) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for task in TASKS:
        for _ in range(per_task):
            out.append(make_sample(filler, rng, task, length, copy_marker=copy_marker)[0])
    return out
