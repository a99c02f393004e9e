"""kvp-tiny: a small Llama-style decoder-only transformer (the reference for examples/engine).

Architecture (every choice here is mirrored exactly by the C++ engine in examples/engine/model.hpp):
  * byte-level vocabulary: ids 0..255 are bytes, 256 = BOS, 257 = EOS, 258 = PAD  (vocab_size 259)
  * pre-norm blocks:  h = x + Attn(RMSNorm(x));  out = h + MLP(RMSNorm(h))
  * RMSNorm: x * rsqrt(mean(x^2) + eps) * weight, eps = 1e-5, computed in fp32
  * attention: grouped-query (n_heads query heads, n_kv_heads kv heads; query head h reads kv head
    h // (n_heads // n_kv_heads)), no biases, scale 1/sqrt(head_dim), causal
  * RoPE, base 10000, "half-split" (GPT-NeoX / HF Llama rotate_half) convention: for i < head_dim/2,
    inv_freq_i = base^(-2i/head_dim), angle = pos * inv_freq_i, and the pair (x[i], x[i + head_dim/2]) rotates:
        x'[i]          = x[i] cos - x[i + d/2] sin
        x'[i + d/2]    = x[i + d/2] cos + x[i] sin
    applied to q and k (not v) at the token's logical position.
  * SwiGLU MLP: down(silu(gate(x)) * up(x))
  * final RMSNorm, logits = norm(x) @ embed^T (tied embeddings)

Tensor names in the safetensors file (all fp32, torch Linear layout (out_features, in_features)):
  embed_tokens.weight (vocab, d_model)          norm.weight (d_model)
  layers.{i}.attn_norm.weight (d_model)         layers.{i}.mlp_norm.weight (d_model)
  layers.{i}.attn.q_proj.weight (n_heads*head_dim, d_model)
  layers.{i}.attn.k_proj.weight (n_kv_heads*head_dim, d_model)
  layers.{i}.attn.v_proj.weight (n_kv_heads*head_dim, d_model)
  layers.{i}.attn.o_proj.weight (d_model, n_heads*head_dim)
  layers.{i}.mlp.gate_proj.weight (ffn_hidden, d_model)
  layers.{i}.mlp.up_proj.weight (ffn_hidden, d_model)
  layers.{i}.mlp.down_proj.weight (d_model, ffn_hidden)
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

BOS, EOS, PAD = 256, 257, 258
VOCAB_SIZE = 259


@dataclass
class Config:
    vocab_size: int = VOCAB_SIZE
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    ffn_hidden: int = 384
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 1024
    tie_embeddings: bool = True
    bos_id: int = BOS
    eos_id: int = EOS
    pad_id: int = PAD

    def to_json(self) -> str:
        d = asdict(self)
        d["model_type"] = "kvp-tiny-llama"
        d["rope_convention"] = "half_split"
        d["tokenizer"] = "bytes+specials(256=BOS,257=EOS,258=PAD)"
        return json.dumps(d, indent=2)

    @staticmethod
    def from_json(text: str) -> "Config":
        d = json.loads(text)
        fields = {k: d[k] for k in Config.__dataclass_fields__ if k in d}
        return Config(**fields)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float):
    """cos, sin of shape (len(positions), head_dim), half-split layout (the frequency table repeated twice)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(torch.float32), ang.sin().to(torch.float32)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, D); cos/sin: (T, D)
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.d_model, c.n_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.d_model, bias=False)

    def forward(self, x, cos, sin, return_qkv: bool = False):
        B, T, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(B, T, c.n_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        g = c.n_heads // c.n_kv_heads
        kk = k.repeat_interleave(g, dim=1)
        vv = v.repeat_interleave(g, dim=1)
        o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
        o = o.transpose(1, 2).reshape(B, T, c.n_heads * c.head_dim)
        out = self.o_proj(o)
        if return_qkv:
            return out, (q, k, v)
        return out


class MLP(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.d_model, c.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(c.d_model, c.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(c.ffn_hidden, c.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.attn_norm = RMSNorm(c.d_model, c.norm_eps)
        self.attn = Attention(c)
        self.mlp_norm = RMSNorm(c.d_model, c.norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList([Block(c) for _ in range(c.n_layers)])
        self.norm = RMSNorm(c.d_model, c.norm_eps)
        if not c.tie_embeddings:
            self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self._init()

    def _init(self):
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=std)
                # scale the residual-branch output projections (GPT-2 style)
                if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                    p.data.mul_(1.0 / math.sqrt(2 * self.c.n_layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, T) -> logits (B, T, vocab), positions 0..T-1."""
        T = ids.shape[1]
        cos, sin = rope_cos_sin(torch.arange(T), self.c.head_dim, self.c.rope_base)
        x = self.embed_tokens(ids)
        for blk in self.layers:
            x = blk(x, cos, sin)
        x = self.norm(x)
        w = self.embed_tokens.weight if self.c.tie_embeddings else self.lm_head.weight
        return x @ w.t()


def state_dict_for_export(model: TinyLlama) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}


def load_model(model_dir: str) -> TinyLlama:
    from safetensors.torch import load_file

    with open(f"{model_dir}/config.json") as f:
        c = Config.from_json(f.read())
    m = TinyLlama(c)
    m.load_state_dict(load_file(f"{model_dir}/model.safetensors"))
    m.eval()
    return m


@torch.no_grad()
def greedy_decode(model: TinyLlama, prompt: list[int], n_new: int) -> list[int]:
    """Greedy continuation by full recomputation (slow, exact; the oracle for the C++ loop)."""
    ids = list(prompt)
    out = []
    for _ in range(n_new):
        logits = model(torch.tensor([ids]))[0, -1]
        t = int(torch.argmax(logits))
        out.append(t)
        ids.append(t)
    return out
