# SPDX-License-Identifier: Apache-2.0
"""kvpress 0.5.5 presses whose scoring and selection run in kvpolicy.

Each class here subclasses the kvpress press of the same name (same dataclass fields and defaults), so it is a
drop-in for kvpress's pipeline and its ``with press(model):`` context manager; only ``compress`` differs: the
press hands the layer's keys (and what the policy reads: the window's post-RoPE queries, the prompt's pre-RoPE
queries, the values, the eager attention weights) to the kvpolicy policy of the same semantics, read in place,
and gathers the kept rows as kvpress does (Ada-KV: sets ``module.masked_key_indices`` like kvpress's AdaKVPress).

    from kvpress import pipeline
    from kvpolicy.kvpress import SnapKVPress
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    answer = pipe(context, question=question, press=SnapKVPress(compression_ratio=0.5))["answer"]

Kept sets equal kvpress's up to ties (kvpolicy breaks exact ties towards the later token; torch.topk's order is
unspecified) and float rounding (both read fp32 or the model's dtype; kvpolicy accumulates in fp32). kvpolicy keeps
each head's rows in ascending token order, kvpress in score order; attention does not depend on the order.
The CPU backend runs on host tensors; CUDA tensors are refused with a ValueError.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple

import kvpress as _kvpress
import torch
from kvpress.utils import get_prerope_query_states
from transformers.models.llama.modeling_llama import rotate_half

import kvpolicy

__all__ = ["SnapKVPress", "StreamingLLMPress", "TOVAPress", "ObservedAttentionPress", "ExpectedAttentionPress",
           "AdaKVPress", "PyramidKVPress", "KnormPress", "window_queries"]


def window_queries(module: Any, hidden_states: torch.Tensor, window: int, position_embeddings: Tuple[Any, Any]) -> torch.Tensor:
    """The last `window` post-RoPE queries, (batch, num_q_heads, window, head_dim): the evidence kvpress's
    SnapKV / TOVA recompute their window attention from (its q_proj and rotary, in the model's dtype)."""
    q = get_prerope_query_states(module, hidden_states[:, -window:])
    cos, sin = position_embeddings
    cos, sin = cos[:, -window:], sin[:, -window:]
    return q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)


def _record(press: Any, module: Any, keep: "kvpolicy.KeepSet") -> "kvpolicy.KeepSet":
    """Keeps the layer's decision on the press: ``press.decisions[layer_idx]`` (the last prefill's KeepSet)."""
    decisions = press.__dict__.get("decisions")
    if decisions is None:
        decisions = {}
        object.__setattr__(press, "decisions", decisions)
    decisions[getattr(module, "layer_idx", 0)] = keep
    return keep


def _d(x: Any) -> Any:
    """The tensor without autograd (a view, no copy): DLPack does not export tensors that require grad."""
    return x.detach() if isinstance(x, torch.Tensor) else x


def _gather(keys: torch.Tensor, values: torch.Tensor, keep: "kvpolicy.KeepSet") -> Tuple[torch.Tensor, torch.Tensor]:
    b, h, _, d = keys.shape
    idx = torch.from_numpy(keep.dense()).reshape(b, h, -1).to(device=keys.device, dtype=torch.long)
    idx = idx.unsqueeze(-1).expand(-1, -1, -1, d)
    return keys.gather(2, idx).contiguous(), values.gather(2, idx).contiguous()


class _Policies:
    """Per-press cache of built kvpolicy policies, keyed by spec string."""

    def __init__(self) -> None:
        self._by_spec: Dict[str, Any] = {}

    def get(self, name: str, **params: Any) -> Any:
        spec = kvpolicy.spec_string(name, **params)
        p = self._by_spec.get(spec)
        if p is None:
            p = self._by_spec[spec] = kvpolicy.make(spec)
        return p


def _policies(press: Any) -> _Policies:
    cache = press.__dict__.get("_kvpolicy_cache")
    if cache is None:
        cache = _Policies()
        object.__setattr__(press, "_kvpolicy_cache", cache)
    return cache


@dataclass
class SnapKVPress(_kvpress.SnapKVPress):
    """kvpress SnapKVPress; scores and the top-k run in kvpolicy's SnapKV (kvpress semantics)."""

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        assert hidden_states.shape[1] > self.window_size, (
            f"Query length {hidden_states.shape[1]} should be greater than the window size {self.window_size}")
        q = window_queries(module, hidden_states, self.window_size, kwargs["position_embeddings"])
        p = _policies(self).get("snapkv", compression_ratio=self.compression_ratio, window=self.window_size,
                                kernel=self.kernel_size)
        return _gather(keys, values, _record(self, module, p.evict(queries=_d(q), keys=_d(keys))))


@dataclass
class StreamingLLMPress(_kvpress.StreamingLLMPress):
    """kvpress StreamingLLMPress (sinks + recent); the decision runs in kvpolicy's StreamingLLM."""

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        assert keys.shape[2] > self.n_sink, f"Input should contain more tokens than n_sink={self.n_sink}"
        p = _policies(self).get("streaming_llm", compression_ratio=self.compression_ratio, sinks=self.n_sink)
        return _gather(keys, values, _record(self, module, p.evict(keys=_d(keys))))


@dataclass
class TOVAPress(_kvpress.TOVAPress):
    """kvpress TOVAPress (one-shot, the last query's head-mean attention); runs in kvpolicy's TOVA."""

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        q = window_queries(module, hidden_states, 1, kwargs["position_embeddings"])
        p = _policies(self).get("tova", compression_ratio=self.compression_ratio)
        return _gather(keys, values, _record(self, module, p.evict(queries=_d(q), keys=_d(keys))))


@dataclass
class ObservedAttentionPress(_kvpress.ObservedAttentionPress):
    """kvpress ObservedAttentionPress: the eager attention weights summed over the query rows (in torch, fp32), then
    the normalisation by T - j, the GQA mean and the selection in kvpolicy's ObservedAttention."""

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        assert attentions is not None, 'Set attn_implementation="eager" to use this hook'
        p = _policies(self).get("observed_attention", compression_ratio=self.compression_ratio)
        return _gather(keys, values, _record(self, module, p.evict(keys=_d(keys), column_sums=_d(attentions).sum(2, dtype=torch.float32))))


def _rope_base(module: Any, head_dim: int) -> float:
    """The RoPE base of the model's rotary embedding, checked to be plain HF RoPE (no scaling)."""
    rot = getattr(module, "rotary_emb", None)
    inv = getattr(rot, "inv_freq", None)
    if inv is None:
        raise NotImplementedError("ExpectedAttentionPress (kvpolicy): the attention module has no rotary_emb.inv_freq")
    inv = inv.detach().float().cpu()
    base = float(inv[1]) ** (-head_dim / 2.0) if inv.numel() > 1 else 10000.0
    ref = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scaling = float(getattr(rot, "attention_scaling", 1.0))
    if not torch.allclose(inv, ref, rtol=1e-5, atol=0) or scaling != 1.0:
        raise NotImplementedError("ExpectedAttentionPress (kvpolicy): scaled RoPE (inv_freq not 1/base^(2i/d) or "
                                  "attention_scaling != 1) is not passed through the registry spec yet")
    return round(base, 6)


@dataclass
class ExpectedAttentionPress(_kvpress.ExpectedAttentionPress):
    """kvpress ExpectedAttentionPress: the prompt's pre-RoPE query statistics, RoPE averaged over the next positions;
    statistics, scores and selection in kvpolicy's ExpectedAttention."""

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        assert keys.size(2) > self.n_sink, f"Input should contain more tokens than n_sink={self.n_sink}"
        q = get_prerope_query_states(module, hidden_states)  # (b, Hq, T, d), the sinks are skipped by kvpolicy
        p = _policies(self).get("expected_attention", compression_ratio=self.compression_ratio,
                                n_future_positions=self.n_future_positions, n_sink=self.n_sink,
                                use_covariance=self.use_covariance, use_vnorm=self.use_vnorm,
                                epsilon=float(self.epsilon), rope_base=_rope_base(module, module.head_dim))
        return _gather(keys, values, _record(self, module, p.evict(queries=_d(q), keys=_d(keys), values=_d(values))))


@dataclass
class AdaKVPress(_kvpress.AdaKVPress):
    """kvpress AdaKVPress over a SnapKV press (kvpress's or this module's): the safeguarded per-head allocation and the
    SnapKV scores run in kvpolicy's Ada-KV; like kvpress, the cache keeps its length and the pruned entries are
    masked (``module.masked_key_indices``)."""

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        assert module.config._attn_implementation != "eager", "eager mode not supported"
        inner = self.press
        if not isinstance(inner, _kvpress.SnapKVPress) or isinstance(inner, _kvpress.PyramidKVPress):
            raise NotImplementedError(f"AdaKVPress (kvpolicy): the scorer must be a SnapKVPress, got {type(inner).__name__}")
        q = window_queries(module, hidden_states, inner.window_size, kwargs["position_embeddings"])
        # kvpress SnapKV scoring: window mean, avg pooling, GQA mean (both linear: the order of pool and group mean
        # does not change the scores beyond rounding).
        p = _policies(self).get("adakv", compression_ratio=self.compression_ratio, alpha=self.alpha_safeguard,
                                window=inner.window_size, kernel=inner.kernel_size, pooling="avg", group_reduce="mean")
        keep = _record(self, module, p.evict(queries=_d(q), keys=_d(keys)))
        b, h, t, _ = keys.shape
        pruned = ~torch.from_numpy(keep.mask(t)).reshape(b, h, t)
        bi, hi, si = torch.nonzero(pruned, as_tuple=True)
        module.masked_key_indices = (bi.to(keys.device), hi.to(keys.device), si.to(keys.device))
        return keys, values


@dataclass
class PyramidKVPress(_kvpress.PyramidKVPress):
    """kvpress PyramidKVPress: SnapKV scores with the pyramid layer budget; in kvpolicy's PyramidKV."""

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        q = window_queries(module, hidden_states, self.window_size, kwargs["position_embeddings"])
        p = _policies(self).get("pyramidkv", compression_ratio=self.compression_ratio, window=self.window_size,
                                kernel=self.kernel_size, beta=self.beta, num_layers=module.config.num_hidden_layers,
                                layer=module.layer_idx)
        return _gather(keys, values, _record(self, module, p.evict(queries=_d(q), keys=_d(keys))))


@dataclass
class KnormPress(_kvpress.KnormPress):
    """kvpress KnormPress (score = -||key||_2 per token and kv head, n_kept = max(1, int(T * (1 - r)))); the norms
    and the top-k run in kvpolicy's Knorm on the keys read in place (kvpolicy accumulates the norm in double,
    kvpress in fp32: kept sets may differ only on near-ties)."""

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        p = _policies(self).get("knorm", compression_ratio=self.compression_ratio)
        return _gather(keys, values, _record(self, module, p.evict(keys=_d(keys))))
