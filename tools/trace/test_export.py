#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Tests of tools/trace/export_trace.py (run with /work/venv/bin/python; not part of CI).

On a randomly initialised small Llama (GQA, RoPE; nothing downloaded):
  1. causal attention recomputed in numpy from the exported q/k/v equals the
     attention output of an independent eager forward of the same model (the
     input of o_proj), for every layer, prompt rows and decode rows;
  2. layer 0's exported keys are the model's post-RoPE keys at absolute
     positions 0..T-1 (attention alone is blind to a common position shift);
  3. the metadata and shapes follow the format of include/kvpolicy/io/trace.hpp;
  4. a model whose attention does not use AttentionInterface is rejected.
On kvp-tiny (models/kvp-tiny through tools/model/to_hf.py):
  5. the converted model's logits equal model.py's and the exported q/k/v are model.py's post-RoPE q/k and v.

  /work/venv/bin/python tools/trace/test_export.py
"""
from __future__ import annotations

import os
import sys
import tempfile
import unittest

import numpy as np
import torch
from safetensors import safe_open

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export_trace  # noqa: E402


def causal_attention(q, k, v, scale):
    """q (Hq, N, d), k/v (Hkv, N, d) -> (Hq, N, d), causal, GQA (query head h reads kv head h // G)."""
    hq, n, _ = q.shape
    g = hq // k.shape[0]
    out = np.zeros_like(q, dtype=np.float64)
    mask = np.triu(np.ones((n, n), dtype=bool), 1)
    for h in range(hq):
        s = (q[h].astype(np.float64) @ k[h // g].astype(np.float64).T) * scale
        s[mask] = -np.inf
        s -= s.max(axis=1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=1, keepdims=True)
        out[h] = p @ v[h // g].astype(np.float64)
    return out


class ExportTraceTest(unittest.TestCase):
    T, D = 40, 5

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.path = os.path.join(cls.tmp.name, "t.safetensors")
        cls.model = export_trace.random_llama(seed=3)
        cls.ids = torch.randint(0, cls.model.config.vocab_size, (cls.T,), generator=torch.Generator().manual_seed(5))
        cls.gen = export_trace.export_trace(cls.model, cls.ids, cls.path, num_decode=cls.D, dtype=torch.float32,
                                            with_attn_output=True, model_name="random-llama", needles=[7, 20])
        with safe_open(cls.path, "np") as f:
            cls.meta = f.metadata()
            cls.t = {k: f.get_tensor(k) for k in f.keys()}

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def reference_attention_outputs(self):
        """Input of every layer's o_proj in a plain eager forward over prompt + generated tokens."""
        ref = export_trace.random_llama(seed=3)
        ref.set_attn_implementation("eager")
        got = {}
        hooks = [layer.self_attn.o_proj.register_forward_pre_hook(
            lambda m, args, i=i: got.__setitem__(i, args[0].detach())) for i, layer in enumerate(ref.model.layers)]
        full = torch.cat([self.ids, torch.tensor(self.gen, dtype=torch.int64)]).unsqueeze(0)
        with torch.no_grad():
            ref(input_ids=full, use_cache=False)
        for h in hooks:
            h.remove()
        cfg = ref.config
        hd = cfg.hidden_size // cfg.num_attention_heads
        return {i: o[0].view(full.shape[1], cfg.num_attention_heads, hd).transpose(0, 1).numpy() for i, o in got.items()}

    def test_metadata_and_shapes(self):
        m, t = self.meta, self.t
        self.assertEqual(m["format"], "kvpolicy-trace")
        self.assertEqual(m["version"], "1")
        L, hq, hkv, d = int(m["num_layers"]), int(m["num_q_heads"]), int(m["num_kv_heads"]), int(m["head_dim"])
        self.assertEqual((L, hq, hkv, d), (2, 4, 2, 16))
        self.assertEqual(int(m["num_tokens"]), self.T)
        self.assertEqual(int(m["num_decode"]), self.D)
        self.assertAlmostEqual(float(m["attn_scale"]), d ** -0.5)
        for i in range(L):
            self.assertEqual(t[f"layer.{i}.q"].shape, (hq, self.T, d))
            self.assertEqual(t[f"layer.{i}.k"].shape, (hkv, self.T, d))
            self.assertEqual(t[f"layer.{i}.v"].shape, (hkv, self.T, d))
            self.assertEqual(t[f"layer.{i}.q_decode"].shape, (hq, self.D, d))
            self.assertEqual(t[f"layer.{i}.k_decode"].shape, (hkv, self.D, d))
            self.assertEqual(t[f"layer.{i}.out"].dtype, np.float32)
        np.testing.assert_array_equal(t["positions"], np.arange(self.T))
        np.testing.assert_array_equal(t["positions_decode"], np.arange(self.T, self.T + self.D))
        np.testing.assert_array_equal(t["needles"], [7, 20])
        self.assertEqual(t["rope.inv_freq"].shape, (d // 2,))

    def test_attention_from_trace_equals_model_attention(self):
        ref = self.reference_attention_outputs()
        t, scale = self.t, float(self.meta["attn_scale"])
        for i in range(int(self.meta["num_layers"])):
            q = np.concatenate([t[f"layer.{i}.q"], t[f"layer.{i}.q_decode"]], axis=1)
            k = np.concatenate([t[f"layer.{i}.k"], t[f"layer.{i}.k_decode"]], axis=1)
            v = np.concatenate([t[f"layer.{i}.v"], t[f"layer.{i}.v_decode"]], axis=1)
            mine = causal_attention(q, k, v, scale)
            np.testing.assert_allclose(mine, ref[i], rtol=0, atol=2e-5, err_msg=f"layer {i}")
            stored = np.concatenate([t[f"layer.{i}.out"], t[f"layer.{i}.out_decode"]], axis=1)
            np.testing.assert_allclose(stored, ref[i], rtol=0, atol=2e-5, err_msg=f"layer {i} stored out")
            # the attention is selective enough for eviction to matter: the last query's
            # strongest key gets several times the uniform weight in some head
            g = q.shape[0] // k.shape[0]
            peak = 0.0
            for h in range(q.shape[0]):
                s = (k[h // g].astype(np.float64) @ q[h, -1].astype(np.float64)) * scale
                p = np.exp(s - s.max())
                peak = max(peak, float(p.max() / p.sum()))
            self.assertGreater(peak, 4.0 / k.shape[1], f"layer {i}: attention is nearly uniform")

    def test_layer0_keys_are_post_rope_at_absolute_positions(self):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        m = self.model
        with torch.no_grad():
            h = m.model.layers[0].input_layernorm(m.model.embed_tokens(self.ids.unsqueeze(0)))
            attn = m.model.layers[0].self_attn
            hd = attn.head_dim
            k = attn.k_proj(h).view(1, self.T, -1, hd).transpose(1, 2)
            q = attn.q_proj(h).view(1, self.T, -1, hd).transpose(1, 2)
            cos, sin = m.model.rotary_emb(h, torch.arange(self.T).unsqueeze(0))
            q_rot, k_rot = apply_rotary_pos_emb(q, k, cos, sin)
        np.testing.assert_allclose(self.t["layer.0.k"], k_rot[0].numpy(), rtol=0, atol=1e-5)
        np.testing.assert_allclose(self.t["layer.0.q"], q_rot[0].numpy(), rtol=0, atol=1e-5)
        self.assertGreater(np.abs(self.t["layer.0.k"] - k[0].numpy()).max(), 1e-2)  # RoPE was applied

    def test_model_without_attention_interface_is_rejected(self):
        class Plain(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.config = type("C", (), {"_attn_implementation": None})()
                self.w = torch.nn.Linear(4, 4)

            def forward(self, input_ids, **kw):  # no attention call at all
                from types import SimpleNamespace
                return SimpleNamespace(logits=torch.zeros(1, input_ids.shape[1], 4), past_key_values=None)

        with self.assertRaisesRegex(RuntimeError, "AttentionInterface"):
            export_trace.export_trace(Plain(), torch.arange(4), os.path.join(self.tmp.name, "x.safetensors"))


class KvpTinyTraceTest(unittest.TestCase):
    """The exporter on the project's own model (models/kvp-tiny, converted by tools/model/to_hf.py)."""

    MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "models", "kvp-tiny")

    def test_trace_holds_the_models_post_rope_qkv(self):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "model"))
        import random

        import tasks
        from model import load_model, rope_cos_sin
        from to_hf import check, to_llama

        model = load_model(self.MODEL)
        hf = to_llama(model)
        sample = tasks.make_sample(tasks.Filler(), random.Random(7), "passkey", 1024)[0]
        check(model, hf, sample.prompt)  # same logits as model.py (tolerance in to_hf.check)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "kt.safetensors")
            export_trace.export_trace(hf, torch.tensor(sample.prompt), path, num_decode=2, dtype=torch.float32,
                                      model_name="kvp-tiny")
            with safe_open(path, "np") as f:
                meta = f.metadata()
                t = {k: f.get_tensor(k) for k in f.keys()}
        c = model.c
        self.assertEqual((int(meta["num_layers"]), int(meta["num_q_heads"]), int(meta["num_kv_heads"]), int(meta["head_dim"])),
                         (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim))
        T = len(sample.prompt)
        with torch.no_grad():
            x = model.embed_tokens(torch.tensor([sample.prompt]))
            cos, sin = rope_cos_sin(torch.arange(T), c.head_dim, c.rope_base)
            for i, blk in enumerate(model.layers):
                _, (q, k, v) = blk.attn(blk.attn_norm(x), cos, sin, return_qkv=True)
                # fp32 rotary angles in transformers vs fp64 in model.py (~1e-4 at position 1023), and what that
                # changes in the earlier layers' outputs
                np.testing.assert_allclose(t[f"layer.{i}.q"], q[0].numpy(), rtol=0, atol=2e-3, err_msg=f"layer {i} q")
                np.testing.assert_allclose(t[f"layer.{i}.k"], k[0].numpy(), rtol=0, atol=2e-3, err_msg=f"layer {i} k")
                np.testing.assert_allclose(t[f"layer.{i}.v"], v[0].numpy(), rtol=0, atol=1e-3, err_msg=f"layer {i} v")
                x = blk(x, cos, sin)


if __name__ == "__main__":
    unittest.main(verbosity=2)
