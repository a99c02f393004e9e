#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Convert kvp-tiny (models/kvp-tiny) into a Hugging Face `LlamaForCausalLM` directory.

kvp-tiny is a Llama in every respect transformers models (RMSNorm with eps inside the rsqrt, half-split RoPE =
`rotate_half`, grouped-query attention without biases, SwiGLU, tied embeddings), so the conversion is a renaming of
tensors. The converted model lets every Hugging Face tool run on the project's own model -- in particular
tools/trace/export_trace.py, which records the post-RoPE Q/K and V of any transformers causal LM:

    /work/venv/bin/python tools/model/to_hf.py --out build/kvp-tiny-hf
    /work/venv/bin/python tools/trace/export_trace.py --model build/kvp-tiny-hf --prompt-file p.txt --out t.safetensors

Text goes in as bytes: the HF model has no tokenizer, so pass token ids (export_trace.py --kvp-tiny-prompt does
that: BOS + the prompt's bytes). `check()` asserts that the converted model's logits equal model.py's within max |diff|
<= 2e-3 on a 1024-token task prompt (observed ~5e-4: transformers computes the rotary angles pos * inv_freq in fp32,
model.py and the C++ engine in fp64, a difference of up to ~6e-5 rad at position 1023); the tests in
tools/trace/test_export.py run it.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import TinyLlama, load_model  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def to_llama(model: TinyLlama):
    """The same network as a transformers LlamaForCausalLM (fp32, eager attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.c
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.ffn_hidden,
                      num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                      head_dim=c.head_dim, hidden_act="silu", max_position_embeddings=c.max_seq_len,
                      rms_norm_eps=c.norm_eps, rope_theta=c.rope_base, tie_word_embeddings=c.tie_embeddings,
                      attention_bias=False, mlp_bias=False, bos_token_id=c.bos_id, eos_token_id=c.eos_id,
                      pad_token_id=c.pad_id, torch_dtype="float32")
    cfg._attn_implementation = "eager"
    hf = LlamaForCausalLM(cfg)
    sd = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight}
    for i, blk in enumerate(model.layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = blk.attn_norm.weight
        sd[p + "post_attention_layernorm.weight"] = blk.mlp_norm.weight
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{n}.weight"] = getattr(blk.attn, n).weight
        for n in ("gate_proj", "up_proj", "down_proj"):
            sd[p + f"mlp.{n}.weight"] = getattr(blk.mlp, n).weight
    if c.tie_embeddings:
        sd["lm_head.weight"] = model.embed_tokens.weight
    else:
        sd["lm_head.weight"] = model.lm_head.weight
    missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise RuntimeError(f"kvp-tiny -> Llama: missing {missing}, unexpected {unexpected}")
    hf.eval()
    return hf


@torch.no_grad()
def check(model: TinyLlama, hf, ids: list[int], tol: float = 2e-3) -> float:
    """Max |logit difference| between model.py and the converted model on `ids`; raises above `tol`."""
    x = torch.tensor([ids])
    a = model(x)
    b = hf(input_ids=x).logits
    diff = float((a - b).abs().max())
    if not diff <= tol:
        raise AssertionError(f"converted model differs from model.py: max |logit diff| {diff:.3g} > {tol}")
    return diff


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "kvp-tiny"))
    ap.add_argument("--out", required=True, help="output directory (config.json + model.safetensors)")
    args = ap.parse_args()
    import random

    import tasks

    m = load_model(args.model)
    hf = to_llama(m)
    sample = tasks.make_sample(tasks.Filler(), random.Random(0), "passkey", 1024)[0]
    diff = check(m, hf, sample.prompt + sample.answer)
    hf.save_pretrained(args.out, safe_serialization=True)
    print(f"wrote {args.out} (max |logit diff| vs model.py on a 1024-token prompt: {diff:.2e})")


if __name__ == "__main__":
    main()
