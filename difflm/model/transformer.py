"""Llama-style transformer, bidirectional for masked diffusion (LLaDA) or causal for the AR baseline.

The model only knows its dimensions and attention type; precision, parallel layout and the objective
are applied from outside. Parameter names follow Transformer Engine (see :mod:`difflm.model.layers`):

    embedding.weight                              [V, d]
    layers.{i}.attention.qkv.layer_norm_weight    [d]
    layers.{i}.attention.qkv.weight               [(h + 2 h_kv) * hd, d]  grouped per KV head (below)
    layers.{i}.attention.qkv.bias                 [(h + 2 h_kv) * hd]     (model.qkv_bias, e.g. Qwen2)
    layers.{i}.attention.q_norm.weight            [hd]   (model.qk_norm)
    layers.{i}.attention.k_norm.weight            [hd]   (model.qk_norm)
    layers.{i}.attention.proj.weight              [d, h * hd]
    layers.{i}.mlp.layer_norm_weight              [d]
    layers.{i}.mlp.fc1_weight                     [2 f, d]
    layers.{i}.mlp.fc2_weight                     [d, f]
    final_norm.weight                             [d]
    output.weight                                 [V, d]  (absent with model.tie_embeddings)

The fused QKV rows are grouped per KV head as Megatron-LM does: for each of the h_kv groups,
``h / h_kv`` query heads, then its key head, then its value head. Splitting the rows evenly across
tensor-parallel ranks therefore gives each rank whole groups.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from difflm.model.attention import attend
from difflm.model.masks import to_block_mask
from difflm.model.init import megatron_init_
from difflm.model.layers import LayerNormLinear, RMSNorm
from difflm.model.moe import build_mlp
from difflm.model.rope import apply_rope, rope_cos_sin, rope_cos_sin_at


class Attention(nn.Module):
    """Multi-head attention with GQA, RoPE and optional QK-norm, through :func:`difflm.model.attention.attend`.

    Shapes: x [B, S, d] -> [B, S, d]. ``causal`` selects the AR mask; diffusion attends both ways.
    """

    def __init__(self, cfg, causal: bool):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.causal = causal
        self.attention_backend = getattr(cfg, "attention_backend", "sdpa")  # see difflm.model.attention
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv = LayerNormLinear(cfg.hidden_size, qkv_out, cfg.norm_eps, bias=getattr(cfg, "qkv_bias", False))
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask=None,
                kv_cache=None) -> torch.Tensor:
        b, s, _ = x.shape
        group = self.num_heads // self.num_kv_heads
        qkv = self.qkv(x).view(b, s, -1, group + 2, self.head_dim)  # [B, S, h_kv, group + 2, hd]
        q, k, v = qkv.split([group, 1, 1], dim=3)
        q = q.reshape(b, s, self.num_heads, self.head_dim)
        k = k.reshape(b, s, self.num_kv_heads, self.head_dim)
        v = v.reshape(b, s, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:  # difflm.model.kv_cache.LayerKV: cached K/V around this forward's positions
            k, v = kv_cache.update(k, v)
        out = attend(q, k, v, causal=self.causal and attn_mask is None, backend=self.attention_backend,
                     attn_mask=attn_mask)  # [B, heads, S, hd]
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, cfg, causal: bool):
        super().__init__()
        self.attention = Attention(cfg, causal)
        # MoE integration (issue 15), to be redone in the one-model tree: the MLP slot is MoEMLP when
        # model.moe.num_experts > 0, else the dense LayerNormMLP (difflm.model.moe.build_mlp).
        self.mlp = build_mlp(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask=None,
                kv_cache=None) -> torch.Tensor:
        x = x + self.attention(x, cos, sin, attn_mask, kv_cache)
        return x + self.mlp(x)


class Transformer(nn.Module):
    """The whole network: embedding, ``num_layers`` blocks, final RMSNorm, LM head.

    Args:
        cfg: a :class:`difflm.config.schema.ModelConfig` with ``vocab_size`` and ``head_dim`` resolved.
        causal: True for the AR objective; False (bidirectional) for masked diffusion.
    """

    def __init__(self, cfg, causal: bool = False):
        super().__init__()
        self.cfg, self.causal = cfg, causal
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, causal) for _ in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def head_weight(self) -> torch.Tensor:
        return self.embedding.weight if self.output is None else self.output.weight

    def forward(self, input_ids: torch.Tensor, logits_mask: Optional[torch.Tensor] = None, attn_mask=None,
                position_ids: Optional[torch.Tensor] = None, kv_cache=None) -> torch.Tensor:
        """Logits for ``input_ids`` [B, S] int64.

        Optional inputs (all default to the plain full-sequence forward):
            attn_mask: replaces the model's own bidirectional / causal pattern: a dense bool
                [B | 1, 1, S, S_kv] tensor (True = attend) or a FlexAttention ``BlockMask``
                (:mod:`difflm.model.masks`: BD3-LM block-causal, intra-document, padding). DifflmError on
                attention backends that cannot take a mask (``te``, ``flash``).
            position_ids: RoPE positions, [S] or [B, S] int64 (default ``0..S-1``); BD3-LM repeats
                ``0..L-1`` for both halves of ``[x_t ; x_0]``, padded batches skip pad tokens.
            kv_cache: a :class:`difflm.model.kv_cache.KVCache` (block-level cache for decoding).

        With ``model.shift_logits`` (Dream, Ye et al. 2025) the logits at position i come from the hidden
        state at i - 1 (position 0 keeps its own), so an AR-initialised model keeps predicting "the next
        token" while the objective and the sampler read logits[i] as the prediction of token i.
        Returns [B, S, V] in the compute dtype, or, when ``logits_mask`` [B, S] bool is given, only the
        selected positions [N, V] (row-major order) - the diffusion loss needs logits at masked tokens only,
        which saves most of the LM-head FLOPs and memory.
        """
        s = input_ids.shape[1]
        if position_ids is None:
            cos, sin = rope_cos_sin(s, self.cfg.head_dim, self.cfg.rope_base, input_ids.device)
        else:
            cos, sin = rope_cos_sin_at(position_ids.to(input_ids.device), self.cfg.head_dim, self.cfg.rope_base)
        if isinstance(attn_mask, torch.Tensor) and getattr(self.cfg, "attention_backend", "sdpa") == "flex":
            attn_mask = to_block_mask(attn_mask)  # once per forward rather than in every layer
        x = self.embedding(input_ids)
        for i, layer in enumerate(self.layers):
            if attn_mask is None and kv_cache is None:
                x = layer(x, cos, sin)
            else:
                x = layer(x, cos, sin, attn_mask, None if kv_cache is None else kv_cache.layer(i))
        x = self.final_norm(x)
        if getattr(self.cfg, "shift_logits", False):  # Dream: position i predicts token i (from state i - 1)
            x = torch.cat([x[:, :1], x[:, :-1]], dim=1)
        if logits_mask is not None:
            x = x[logits_mask]
        return F.linear(x, self.head_weight())

    def init_weights(self, seed: int) -> None:
        """Keyed Megatron-style init (:func:`difflm.model.init.megatron_init_`): both backends built with the
        same seed hold identical weights."""
        megatron_init_(self, self.cfg, seed)

    def num_params(self, exclude_embedding: bool = True) -> int:
        """Parameter count; with ``exclude_embedding`` the input embedding is left out (PaLM's N for MFU)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding and self.output is not None:
            n -= self.embedding.weight.numel()
        return n
