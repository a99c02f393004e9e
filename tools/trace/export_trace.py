#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Export a kvpolicy attention trace from a Hugging Face transformers causal LM.

A trace holds, per layer, the post-RoPE queries and keys and the values the
model's attention kernel saw on one prompt, plus optionally a few greedy decode
steps; the format is documented in include/kvpolicy/io/trace.hpp and read by
kvpolicy::io::Trace and tools/compare (`kvpolicy-compare --trace file`).

How the tensors are captured: the exporter registers its own attention function
in transformers' AttentionInterface (the dispatch every modern decoder uses:
Llama, Mistral, Qwen2/3, Gemma, Phi-3, ...). The model calls it with exactly
the query/key/value tensors its kernel would get -- after the projections, any
q/k norms, partial or scaled RoPE and the KV-cache update -- so nothing about
the model's positional encoding is re-implemented here. The function records
them and then runs transformers' eager attention, whose output is stored as
`layer.{i}.out` when --with-attn-output is given (a self-check for readers).
A model whose attention does not go through AttentionInterface is rejected
with a clear error rather than traced wrongly.

Examples:
  export_trace.py --model Qwen/Qwen2.5-0.5B --prompt-file doc.txt --decode 16 --out doc.safetensors
  export_trace.py --random-llama --random-tokens 48 --decode 6 --dtype float32 \\
      --with-attn-output --out tests/data/traces/tiny_llama_random.safetensors
  export_trace.py --kvp-tiny models/kvp-tiny --kvp-task passkey --seed 7 --decode 4 \\
      --out tests/data/traces/kvp_tiny_passkey.safetensors

Requires torch, transformers (>= 4.48, AttentionInterface) and safetensors.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from dataclasses import dataclass, field

import torch
from safetensors.torch import save_file

TRACE_IMPL = "kvp_trace"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class _Recorder:
    """Per layer, the (q, k, v, out) tensors of each attention call, in call order."""

    calls: dict = field(default_factory=dict)
    scales: set = field(default_factory=set)
    extras: set = field(default_factory=set)
    active: bool = False

    def record(self, layer, q, k, v, out):
        self.calls.setdefault(layer, []).append((q.detach(), k.detach(), v.detach(), out.detach()))


_REC = _Recorder()


def _trace_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface entry: record q (B,Hq,q,d), k/v (B,Hkv,kv,d), then run eager attention."""
    mod = importlib.import_module(type(module).__module__)
    eager = getattr(mod, "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(f"{type(module).__name__}: its module has no eager_attention_forward to delegate to")
    for k in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(k) is not None:
            _REC.extras.add(k)
    out, weights = eager(module, query, key, value, attention_mask, scaling=scaling, dropout=0.0, **kwargs)
    if _REC.active:
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise RuntimeError(f"{type(module).__name__} has no layer_idx; cannot attribute attention calls to layers")
        _REC.scales.add(float(scaling) if scaling is not None else float(query.shape[-1]) ** -0.5)
        # eager returns (B, q, Hq, d); store (B, Hq, q, d) like the query.
        _REC.record(int(layer), query, key, value, out.transpose(1, 2))
    return out, weights


def _install(model):
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(TRACE_IMPL, _trace_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(TRACE_IMPL, eager_mask)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(TRACE_IMPL)
    else:
        model.config._attn_implementation = TRACE_IMPL


def _rope_info(model):
    """(inv_freq tensor or None, attention_scaling, rope_theta or 0)."""
    rotary = None
    for name, m in model.named_modules():
        if name.endswith("rotary_emb") and hasattr(m, "inv_freq"):
            rotary = m
            break
    cfg = model.config
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        rp = getattr(cfg, "rope_parameters", None) or {}
        if isinstance(rp, dict):
            theta = rp.get("rope_theta")
    inv = rotary.inv_freq.detach().float().cpu() if rotary is not None else None
    scaling = float(getattr(rotary, "attention_scaling", 1.0)) if rotary is not None else 1.0
    return inv, scaling, float(theta or 0.0)


@torch.no_grad()
def export_trace(model, input_ids, path, num_decode=0, dtype=torch.float16, with_attn_output=False, model_name="",
                 needles=None, extra_metadata=None):
    """Run `model` on `input_ids` (1-d LongTensor), then `num_decode` greedy steps; write the trace to `path`.

    Returns the generated decode token ids (list of int)."""
    if input_ids.dim() != 1 or input_ids.numel() < 1:
        raise ValueError("input_ids must be a non-empty 1-d tensor of token ids")
    _install(model)
    model.eval()
    dev = next(model.parameters()).device
    ids = input_ids.to(dev).unsqueeze(0)
    T = ids.shape[1]
    _REC.calls.clear()
    _REC.scales.clear()
    _REC.extras.clear()
    _REC.active = True
    try:
        out = model(input_ids=ids, use_cache=True)
        past = out.past_key_values
        generated = []
        nxt = out.logits[0, -1].argmax()
        for s in range(num_decode):
            generated.append(int(nxt))
            pos = torch.tensor([[T + s]], device=dev)
            out = model(input_ids=nxt.view(1, 1), past_key_values=past, use_cache=True, position_ids=pos,
                        cache_position=pos[0])
            past = out.past_key_values
            nxt = out.logits[0, -1].argmax()
    finally:
        _REC.active = False
    if not _REC.calls:
        raise RuntimeError("no attention call was recorded: this model does not dispatch attention through "
                           "transformers' AttentionInterface, so it cannot be traced by this exporter")
    if _REC.extras:
        raise RuntimeError(f"the model's attention uses {sorted(_REC.extras)}, which the trace format does not describe")
    if len(_REC.scales) != 1:
        raise RuntimeError(f"layers use different attention scales {sorted(_REC.scales)}")

    cfg = model.config
    L = len(_REC.calls)
    if sorted(_REC.calls) != list(range(L)):
        raise RuntimeError(f"recorded layers {sorted(_REC.calls)} are not 0..{L - 1}")
    tensors = {}
    Hq = Hkv = d = None
    for i in range(L):
        calls = _REC.calls[i]
        if len(calls) != 1 + num_decode:
            raise RuntimeError(f"layer {i}: {len(calls)} attention calls recorded, expected {1 + num_decode}")
        q, k, v, o = calls[0]
        if q.shape[0] != 1:
            raise RuntimeError("batch size must be 1")
        Hq, Hkv, d = q.shape[1], k.shape[1], q.shape[3]
        if k.shape[2] != T:
            raise RuntimeError(f"layer {i}: prefill keys cover {k.shape[2]} tokens, expected {T}")
        tensors[f"layer.{i}.q"] = q[0]
        tensors[f"layer.{i}.k"] = k[0]
        tensors[f"layer.{i}.v"] = v[0]
        if with_attn_output:
            tensors[f"layer.{i}.out"] = o[0]
        if num_decode:
            dq, dk, dv, do = [], [], [], []
            for s, (q1, k1, v1, o1) in enumerate(calls[1:]):
                if q1.shape[2] != 1 or k1.shape[2] != T + s + 1:
                    raise RuntimeError(f"layer {i} decode step {s}: unexpected shapes q {tuple(q1.shape)} k {tuple(k1.shape)}")
                dq.append(q1[0, :, 0])
                dk.append(k1[0, :, -1])
                dv.append(v1[0, :, -1])
                do.append(o1[0, :, 0])
            tensors[f"layer.{i}.q_decode"] = torch.stack(dq, dim=1)
            tensors[f"layer.{i}.k_decode"] = torch.stack(dk, dim=1)
            tensors[f"layer.{i}.v_decode"] = torch.stack(dv, dim=1)
            if with_attn_output:
                tensors[f"layer.{i}.out_decode"] = torch.stack(do, dim=1)
    tensors = {n: t.to(dtype).contiguous().cpu() for n, t in tensors.items()}
    tensors["positions"] = torch.arange(T, dtype=torch.int64)
    if num_decode:
        tensors["positions_decode"] = torch.arange(T, T + num_decode, dtype=torch.int64)
    tensors["tokens"] = input_ids.detach().to(torch.int64).cpu().contiguous()
    inv, att_scaling, theta = _rope_info(model)
    if inv is not None and inv.numel() == d // 2:
        tensors["rope.inv_freq"] = inv.contiguous()
    if needles:
        bad = [p for p in needles if not 0 <= p < T]
        if bad:
            raise ValueError(f"needle positions {bad} outside the prompt [0, {T})")
        tensors["needles"] = torch.tensor(list(needles), dtype=torch.int64)

    meta = {
        "format": "kvpolicy-trace",
        "version": "1",
        "model": model_name or getattr(cfg, "_name_or_path", "") or type(model).__name__,
        "architecture": type(model).__name__,
        "num_layers": str(L),
        "num_q_heads": str(Hq),
        "num_kv_heads": str(Hkv),
        "head_dim": str(d),
        "num_tokens": str(T),
        "num_decode": str(num_decode),
        "rope_theta": repr(theta),
        "rope_attention_scaling": repr(att_scaling),
        "attn_scale": repr(next(iter(_REC.scales))),
        "dtype": str(dtype).replace("torch.", ""),
        "exporter": "tools/trace/export_trace.py",
    }
    if extra_metadata:
        meta.update({str(k): str(v) for k, v in extra_metadata.items()})
    save_file(tensors, path, metadata=meta)
    return generated


def random_llama(seed=0, layers=2, hidden=64, heads=4, kv_heads=2, vocab=128):
    """A randomly initialised small Llama (no download): GQA, RoPE, eager-compatible."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float().eval()
    # Random init gives near-uniform attention; scale q/k so the heads attend selectively.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(10.0)
            layer.self_attn.k_proj.weight.mul_(10.0)
    return model


def _kvp_tiny(model_dir, task, prompt, seed):
    """kvp-tiny as a transformers Llama, its byte-level prompt ids and, for a task prompt, the needle tokens."""
    import random

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "model"))
    import tasks
    from model import BOS, load_model
    from to_hf import to_llama

    hf = to_llama(load_model(model_dir))
    name = "kvp-tiny" + (f":{task}" if task else "")
    if task:
        sample = tasks.make_sample(tasks.Filler(), random.Random(seed), task, 1024)[0]
        ids = sample.prompt
        text = bytes(ids[1:]).decode("ascii")
        at = 1 + text.find(bytes(sample.answer).decode("ascii"))  # the answer's first occurrence: in its needle
        needles = list(range(at, at + len(sample.answer)))
    else:
        ids, needles = [BOS] + list(prompt.encode("utf-8")), []
    return hf, None, name, ids, needles


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="Hugging Face model id or local path")
    src.add_argument("--random-llama", action="store_true", help="a randomly initialised small Llama (tests, no download)")
    src.add_argument("--kvp-tiny", metavar="DIR", help="the project's own model (models/kvp-tiny), via tools/model/to_hf.py")
    ap.add_argument("--seed", type=int, default=0)
    txt = ap.add_mutually_exclusive_group()
    txt.add_argument("--prompt", help="prompt text")
    txt.add_argument("--prompt-file", help="file holding the prompt text")
    txt.add_argument("--random-tokens", type=int, help="a prompt of N random token ids")
    txt.add_argument("--kvp-task", choices=("passkey", "multikey", "copy"),
                     help="--kvp-tiny only: a 1024-token task prompt (tools/model/tasks.py, seed --seed); the answer's "
                          "tokens in the prompt are recorded as needles")
    ap.add_argument("--max-tokens", type=int, default=0, help="truncate the prompt to its last N tokens (0: no limit)")
    ap.add_argument("--decode", type=int, default=0, help="greedy decode steps to record")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float16", help="storage dtype of q/k/v (default float16)")
    ap.add_argument("--model-dtype", choices=sorted(DTYPES), default="float32", help="dtype the model runs in")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--with-attn-output", action="store_true", help="also store the attention output (layer.{i}.out)")
    ap.add_argument("--needles", default="", help="comma-separated prompt token indices to record as needles")
    ap.add_argument("--out", required=True, help="output .safetensors path")
    a = ap.parse_args(argv)

    torch.manual_seed(a.seed)
    task_needles = []
    if a.random_llama:
        model, tok, name = random_llama(a.seed), None, "random-llama"
    elif a.kvp_tiny:
        model, tok, name, kvp_ids, task_needles = _kvp_tiny(a.kvp_tiny, a.kvp_task, a.prompt, a.seed)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(a.model)
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=DTYPES[a.model_dtype])
        name = a.model
    model = model.to(a.device).to(DTYPES[a.model_dtype])
    vocab = model.config.vocab_size
    if a.kvp_task and not a.kvp_tiny:
        ap.error("--kvp-task needs --kvp-tiny")
    if a.kvp_tiny and (a.kvp_task or a.prompt is not None):
        ids = torch.tensor(kvp_ids, dtype=torch.int64)
    elif a.kvp_tiny:
        ap.error("--kvp-tiny takes --prompt or --kvp-task")
    elif a.random_tokens:
        ids = torch.randint(0, vocab, (a.random_tokens,), generator=torch.Generator().manual_seed(a.seed))
    else:
        text = a.prompt if a.prompt is not None else (open(a.prompt_file, encoding="utf-8").read() if a.prompt_file else None)
        if text is None:
            ap.error("give --prompt, --prompt-file or --random-tokens")
        if tok is None:
            ap.error("--random-llama has no tokenizer: use --random-tokens")
        ids = torch.tensor(tok(text)["input_ids"], dtype=torch.int64)
    if a.max_tokens and ids.numel() > a.max_tokens:
        ids = ids[-a.max_tokens:]
    needles = [int(x) for x in a.needles.split(",") if x.strip()] or task_needles
    gen = export_trace(model, ids, a.out, num_decode=a.decode, dtype=DTYPES[a.dtype], with_attn_output=a.with_attn_output,
                       model_name=name, needles=needles,
                       extra_metadata={"seed": a.seed, "prompt_source": "random" if a.random_tokens else "text"})
    print(json.dumps({"out": a.out, "tokens": int(ids.numel()), "decode": gen}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
