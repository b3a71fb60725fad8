"""A difflm model for Hugging Face ``transformers`` (written by ``difflm-export``; self-contained: torch + transformers).

    model = AutoModel.from_pretrained(dir, trust_remote_code=True)      # or AutoModelForMaskedLM
    logits = model(input_ids).logits                                    # [B, S, V]
    out = model.generate(input_ids, steps=64, gen_length=64, block_length=32, temperature=0.0,
                         cfg_scale=0.0, remasking="low_confidence")    # [B, P + gen_length]
    out = model.generate(padded_ids, attention_mask=mask)              # padded rows: as if unpadded

The network is difflm's ``difflm/model/transformer.py`` (Llama-style: RMSNorm, RoPE rotate-half, GQA, SwiGLU)
with its parameter names, so ``model.safetensors`` holds difflm's state dict unchanged:

    embedding.weight                              [V, d]
    layers.{i}.attention.qkv.layer_norm_weight    [d]
    layers.{i}.attention.qkv.weight               [(h + 2 h_kv) * hd, d]  rows grouped per KV head:
                                                  for each KV head, its h / h_kv query heads, its key, its value
    layers.{i}.attention.qkv.bias                 [(h + 2 h_kv) * hd]     (qkv_bias)
    layers.{i}.attention.{q,k}_norm.weight        [hd]                    (qk_norm)
    layers.{i}.attention.proj.weight              [d, h * hd]
    layers.{i}.mlp.layer_norm_weight              [d]
    layers.{i}.mlp.fc1_weight                     [2 f, d]   rows [:f] gate (SiLU), [f:] up
    layers.{i}.mlp.fc2_weight                     [d, f]
    final_norm.weight                             [d]
    (mixture of experts, ``moe_num_experts`` E > 0: the MLP slot is ``MoEMLP``, expert width f_e, f_s = shared x f_e)
    layers.{i}.mlp.layer_norm_weight              [d]
    layers.{i}.mlp.router.weight                  [E, d]
    layers.{i}.mlp.router.bias                    [E]        buffer: added to the scores for the top-k choice
                                                             (and to the weights with moe_bias_in_weights)
    layers.{i}.mlp.experts.fc1_weight             [E, 2 f_e, d]
    layers.{i}.mlp.experts.fc2_weight             [E, d, f_e]
    layers.{i}.mlp.shared.fc{1,2}_weight          [2 f_s, d], [d, f_s]  (moe_num_shared_experts > 0)
    output.weight                                 [V, d]     (absent when tie_word_embeddings)

``generate`` is difflm's masked-diffusion sampler (LLaDA, Nie et al. 2025, arXiv:2502.09992, Alg. 4-5 with
semi-autoregressive blocks, and classifier-free guidance as in ML-GSAI/LLaDA ``generate.py``); a causal
(``ar``) export decodes left to right instead.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from .configuration_difflm import DiffLMConfig

try:  # transformers >= 5: initialisers that skip weights already loaded from the checkpoint
    from transformers import initialization as _init
except ImportError:  # pragma: no cover - older transformers
    _init = nn.init


# ---------------------------------------------------------------------------------------------- network
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, statistics in FP32; returns x's dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps)


class LayerNormLinear(nn.Module):
    """RMSNorm then linear: [..., in] -> [..., out] (Transformer Engine's LayerNormLinear names)."""

    def __init__(self, in_features: int, out_features: int, eps: float, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features))
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_rms_norm(x, self.layer_norm_weight, self.eps), self.weight, self.bias)


class LayerNormMLP(nn.Module):
    """RMSNorm then SwiGLU: [..., d] -> [..., d]; ``fc1_weight`` rows are [gate; up]."""

    def __init__(self, hidden: int, ffn: int, eps: float):
        super().__init__()
        self.eps = eps
        self.layer_norm_weight = nn.Parameter(torch.ones(hidden))
        self.fc1_weight = nn.Parameter(torch.empty(2 * ffn, hidden))
        self.fc2_weight = nn.Parameter(torch.empty(hidden, ffn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(_rms_norm(x, self.layer_norm_weight, self.eps), self.fc1_weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.fc2_weight)


class MoERouter(nn.Module):
    """Top-k router (FP32): scores = softmax or sigmoid of ``x W^T``; experts = top-k of scores + ``bias`` (with
    ``n_group`` > 1 among the ``topk_group`` groups whose 2 best scores + bias sum highest: DeepSeek-V3 sec. 2.1.2);
    weights = the chosen scores (+ their bias with ``bias_in_weights``: LLaDA-MoE's ``expert_bias``; renormalised
    with ``norm_topk_prob``) times ``scale``. x [T, d] -> (ids [T, k] int64, weights [T, k] FP32)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, score_func: str, norm_topk_prob: bool,
                 n_group: int = 1, topk_group: int = 1, scale: float = 1.0, bias_in_weights: bool = False):
        super().__init__()
        self.top_k, self.score_func, self.norm_topk_prob = top_k, score_func, norm_topk_prob
        self.n_group, self.topk_group, self.scale = n_group, topk_group, scale
        self.bias_in_weights = bias_in_weights
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.register_buffer("bias", torch.zeros(num_experts), persistent=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        scores = torch.softmax(logits, dim=-1) if self.score_func == "softmax" else torch.sigmoid(logits)
        choice = scores + self.bias.float()
        if self.n_group > 1:
            t, e = choice.shape
            grouped = choice.view(t, self.n_group, e // self.n_group)
            group_scores = grouped.topk(min(2, e // self.n_group), dim=-1).values.sum(dim=-1)
            keep = torch.topk(group_scores, self.topk_group, dim=-1).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(-1, keep, True)
            choice = grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(t, e)
        ids = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(-1, ids)
        if self.bias_in_weights:
            weights = weights + self.bias.float()[ids]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights * self.scale if self.scale != 1.0 else weights


class SharedExperts(nn.Module):
    """Always-on SwiGLU experts fused into one (no norm: the input is already normalised): ``fc1_weight``
    [2 f_s, d], ``fc2_weight`` [d, f_s]."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1_weight = nn.Parameter(torch.empty(2 * ffn, hidden))
        self.fc2_weight = nn.Parameter(torch.empty(hidden, ffn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.fc1_weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.fc2_weight)


class MoEExperts(nn.Module):
    """E SwiGLU experts with stacked weights: ``fc1_weight`` [E, 2f, d] (rows [gate; up]), ``fc2_weight`` [E, d, f]."""

    def __init__(self, num_experts: int, hidden: int, ffn: int):
        super().__init__()
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, 2 * ffn, hidden))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, hidden, ffn))

    def forward(self, x: torch.Tensor, e: int) -> torch.Tensor:
        gate, up = F.linear(x, self.fc1_weight[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.fc2_weight[e])


class MoEMLP(nn.Module):
    """RMSNorm, then the gated sum of the top-k experts' outputs (+ shared experts): [..., d] -> [..., d].
    Same arithmetic as difflm's ``difflm/model/moe.py`` at inference (no token dropping)."""

    def __init__(self, config: DiffLMConfig):
        super().__init__()
        d, f = config.hidden_size, config.moe_intermediate_size
        self.eps = config.rms_norm_eps
        self.layer_norm_weight = nn.Parameter(torch.ones(d))
        self.router = MoERouter(d, config.moe_num_experts, config.moe_top_k, config.moe_score_func,
                                config.moe_norm_topk_prob, getattr(config, "moe_n_group", 1),
                                getattr(config, "moe_topk_group", 1), getattr(config, "moe_routed_scaling_factor", 1.0),
                                bool(getattr(config, "moe_bias_in_weights", False)))
        self.experts = MoEExperts(config.moe_num_experts, d, f)
        shared = (getattr(config, "moe_shared_intermediate_size", None) or config.moe_num_shared_experts * f
                  if config.moe_num_shared_experts else 0)
        self.shared = SharedExperts(d, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = _rms_norm(x, self.layer_norm_weight, self.eps).reshape(-1, shape[-1])  # [T, d]
        ids, weights = self.router(h)
        y = h.new_zeros(*ids.shape, h.shape[-1])  # [T, k, d]: each slot's expert output
        for e in ids.unique().tolist():
            slot = (ids == e).nonzero(as_tuple=True)
            y[slot] = self.experts(h[slot[0]], e)
        out = torch.bmm(weights.unsqueeze(1).to(y.dtype), y).squeeze(1).to(h.dtype)
        if self.shared is not None:
            out = out + self.shared(h)
        return out.reshape(shape)


def rope_cos_sin(seq_len: int, head_dim: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos/sin tables [S, hd] float32 for ``hd`` rotated dims; pair i rotates at ``base ** (-2 i / hd)`` (RoFormer,
    rotate-half). Partial rotary passes the rotated width R = int(head_dim * partial_rotary_factor) as ``head_dim``."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rope_cos_sin_at(position_ids: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos/sin at explicit positions ``position_ids`` [B, S] int -> [B, 1, S, hd] float32 (padded batches)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32)
                                / head_dim))
    angles = position_ids.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, S, hd] by position; returns x's dtype. Tables of R < hd dims rotate ``x[..., :R]`` only."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: DiffLMConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.causal = config.head_dim, config.causal
        out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv = LayerNormLinear(config.hidden_size, out, config.rms_norm_eps, bias=config.qkv_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, S, d] -> [B, S, d]; ``attn_mask`` [B, 1, S, S] bool (True = attend) replaces the causal /
        bidirectional pattern (padded batches)."""
        b, s, _ = x.shape
        group = self.num_heads // self.num_kv_heads
        q, k, v = self.qkv(x).view(b, s, -1, group + 2, self.head_dim).split([group, 1, 1], dim=3)
        q = q.reshape(b, s, self.num_heads, self.head_dim)
        k = k.reshape(b, s, self.num_kv_heads, self.head_dim)
        v = v.reshape(b, s, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=self.causal and attn_mask is None,
                                             enable_gqa=group > 1)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, config: DiffLMConfig, layer: int = 0):
        super().__init__()
        self.attention = Attention(config)
        moe = getattr(config, "moe_num_experts", 0) > 0 and layer >= getattr(config, "moe_first_k_dense", 0)
        self.mlp = (MoEMLP(config) if moe
                    else LayerNormMLP(config.hidden_size, config.intermediate_size, config.rms_norm_eps))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.attention(x, cos, sin, attn_mask)
        return x + self.mlp(x)


@dataclass
class DiffLMOutput(ModelOutput):
    """``logits`` [B, S, V] float (FP32 weights: FP32); ``loss`` when ``labels`` are given."""

    loss: Optional[torch.FloatTensor] = None
    logits: Optional[torch.FloatTensor] = None


class DiffLMPreTrainedModel(PreTrainedModel):
    config_class = DiffLMConfig
    base_model_prefix = "difflm"
    _no_split_modules = ["Block"]
    supports_gradient_checkpointing = False

    def _init_weights(self, module: nn.Module) -> None:
        """Norm scales 1, biases 0, other weights N(0, initializer_range^2) (only for weights not loaded)."""
        std = self.config.initializer_range
        if isinstance(module, RMSNorm):
            _init.ones_(module.weight)
        elif isinstance(module, LayerNormLinear):
            _init.ones_(module.layer_norm_weight)
            _init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                _init.zeros_(module.bias)
        elif isinstance(module, LayerNormMLP):
            _init.ones_(module.layer_norm_weight)
            _init.normal_(module.fc1_weight, mean=0.0, std=std)
            _init.normal_(module.fc2_weight, mean=0.0, std=std)
        elif isinstance(module, (nn.Linear, nn.Embedding, MoERouter)):
            _init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, MoEMLP):
            _init.ones_(module.layer_norm_weight)
        elif isinstance(module, (MoEExperts, SharedExperts)):
            _init.normal_(module.fc1_weight, mean=0.0, std=std)
            _init.normal_(module.fc2_weight, mean=0.0, std=std)


class DiffLMForMaskedLM(DiffLMPreTrainedModel):
    """difflm's transformer: ``forward(input_ids [B, S] int64) -> DiffLMOutput(logits [B, S, V])``.

    Bidirectional (masked diffusion) unless ``config.causal``. With ``labels`` [B, S] int64 (-100 = ignore)
    the loss is the mean cross-entropy of the logits at the labelled positions against ``labels`` (for a
    causal model, shift the labels yourself: the logits at i predict token i + 1).
    """

    def __init__(self, config: DiffLMConfig):
        super().__init__(config)
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                        bias=False)
        self.post_init()

    # ---- the embedding accessors of PreTrainedModel (resize_token_embeddings, PEFT, TRL read them)
    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding ``[V, d]`` (``embedding``)."""
        return self.embedding

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        """Replace the token embedding (``resize_token_embeddings`` passes a resized copy). With
        ``tie_word_embeddings`` the LM head is this embedding, so it changes with it."""
        self.embedding = value

    def get_output_embeddings(self) -> Optional[nn.Linear]:
        """The untied LM head ``output`` (``nn.Linear`` d -> V), or None with ``tie_word_embeddings``: the logits are
        then ``final_norm(h) @ embedding.weight^T`` and no separate module exists (transformers' convention for a
        head with no module of its own: ``resize_token_embeddings`` resizes the embedding, and the head with it)."""
        return self.output

    def set_output_embeddings(self, value: nn.Linear) -> None:
        """Replace the untied LM head. Raises ValueError with ``tie_word_embeddings`` (the head is the input
        embedding: use :meth:`set_input_embeddings`)."""
        if self.output is None:
            raise ValueError("tie_word_embeddings=True: the LM head is the input embedding; use set_input_embeddings")
        self.output = value

    def resize_token_embeddings(self, new_num_tokens: Optional[int] = None, pad_to_multiple_of: Optional[int] = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """transformers' ``resize_token_embeddings`` (input embedding, untied head and ``config.vocab_size``), and
        ``config.tokenizer_vocab_size`` follows ``new_num_tokens`` (``len(tokenizer)`` after adding tokens): the
        new tokens become tokens ``generate`` may emit, while the rows padded by ``pad_to_multiple_of`` stay
        forbidden, as the embedding's padding rows of the export are.

        Raises ValueError when ``new_num_tokens`` would drop the mask token (``config.mask_token_id``).
        """
        mask = self.config.mask_token_id
        if new_num_tokens is not None and mask is not None and new_num_tokens <= mask:
            raise ValueError(f"new_num_tokens={new_num_tokens} would drop the mask token {mask} that generate needs: "
                             f"keep at least {mask + 1} tokens")
        out = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        if new_num_tokens is not None:
            self.config.tokenizer_vocab_size = int(new_num_tokens)
        return out

    def head_weight(self) -> torch.Tensor:
        return self.embedding.weight if self.output is None else self.output.weight

    def forward(self, input_ids: torch.LongTensor, labels: Optional[torch.LongTensor] = None,
                attention_mask: Optional[torch.Tensor] = None) -> DiffLMOutput:
        """Logits for ``input_ids`` [B, S] int64.

        ``attention_mask`` [B, S] (1 = real token, 0 = padding, left or right): pad keys are masked out of
        attention and RoPE positions skip them, so the logits at every real position equal those of the row
        without its padding (with ``shift_logits`` too: position i's logits come from the last real position
        before it). Logits at pad positions are meaningless.
        """
        valid = _valid_positions(attention_mask, input_ids)
        b, s = input_ids.shape
        mask = None
        rotary = int(self.config.head_dim * float(getattr(self.config, "partial_rotary_factor", 1.0)))
        if valid is None:
            cos, sin = rope_cos_sin(s, rotary, self.config.rope_theta, input_ids.device)
        else:  # every query sees the real keys and itself (no all-False row for SDPA)
            cos, sin = rope_cos_sin_at((valid.long().cumsum(dim=1) - 1).clamp(min=0), rotary, self.config.rope_theta)
            mask = (valid[:, None, :] | torch.eye(s, dtype=torch.bool, device=valid.device))[:, None]
            if self.config.causal:
                mask = mask & torch.ones(s, s, dtype=torch.bool, device=valid.device).tril()
        x = self.embedding(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        x = self.final_norm(x)
        if self.config.shift_logits:  # Dream: position i's logits come from the (real) position before it
            x = torch.take_along_dim(x, _previous_real(valid, b, s, x.device)[..., None], dim=1)
        logits = F.linear(x, self.head_weight())
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        return DiffLMOutput(loss=loss, logits=logits)

    # ------------------------------------------------------------------------------------------ sampling
    def _forbidden_ids(self) -> list[int]:
        ids = set(range(self.config.tokenizer_vocab_size, self.config.vocab_size))
        if self.config.mask_token_id is not None:
            ids.add(int(self.config.mask_token_id))
        return sorted(ids)

    @torch.no_grad()
    def generate(self, input_ids: torch.LongTensor, steps: Optional[int] = None, gen_length: Optional[int] = None,
                 block_length: Optional[int] = None, temperature: Optional[float] = None,
                 cfg_scale: Optional[float] = None, remasking: Optional[str] = None, mask_id: Optional[int] = None,
                 top_k: Optional[int] = None, top_p: Optional[float] = None, threshold: Optional[float] = None,
                 generator: Optional[torch.Generator] = None, attention_mask: Optional[torch.Tensor] = None,
                 max_new_tokens: Optional[int] = None, remdm_sigma: Optional[float] = None,
                 remdm_schedule: Optional[str] = None, do_sample: Optional[bool] = None,
                 stop_at_eos: bool = True, infill: bool = False) -> torch.LongTensor:
        """``[B, P + gen_length]`` int64: the prompt ``input_ids`` [B, P] followed by generated tokens.

        Masked diffusion (LLaDA, Alg. 4-5; difflm's ``diffusion_generate``): ``gen_length`` masks after the
        prompt, decoded in blocks of ``block_length`` with ``steps`` steps in all. Each step proposes
        ``x0 = argmax(top-k/top-p filtered logits + temperature * Gumbel)`` (float64) at the block's
        positions and unmasks a fixed number of them (LLaDA's linear schedule), the most confident first
        (confidences in float64, as LLaDA): ``remasking`` ``low_confidence`` (p(x0)), ``margin`` (top-1 minus
        top-2 probability), ``entropy`` (lowest entropy) or ``random``; ``remdm``: ``low_confidence`` plus ReMDM's
        remasking of decoded tokens (Wang et al. 2025; ``remdm_sigma``, ``remdm_schedule`` ``cap``/``rescale``).
        ``threshold`` (Fast-dLLM): unmask every masked token of the block whose confidence is >= threshold, at
        least one per step. ``cfg_scale`` > 0:
        classifier-free guidance, ``uncond + (cfg_scale + 1) * (cond - uncond)`` with the prompt masked as the
        unconditional input. Causal exports decode left to right (``temperature``, ``top_k``, ``top_p`` apply).
        ``attention_mask`` [B, P] (1 = real, 0 = padding, left or right): each row is generated as if alone
        (the tokens of its unpadded prompt), after the padded prompt. Defaults come from ``config.gen_*``;
        ``block_length`` and ``steps`` None there (and not given) fit ``gen_length`` as difflm's null does: the
        largest divisor of ``gen_length`` up to 64, and ``min(64, gen_length)`` steps rounded down to a multiple of
        the block count (``gen_length=16``: one block of 16, 16 steps). The
        mask id and the embedding's padding ids are never emitted. The same ``generator`` seed gives difflm's
        output token for token. ``max_new_tokens`` (transformers' name, also in ``generation_config.json``) is
        ``gen_length``; give either, or both with the same value. ``do_sample`` as in transformers: False is greedy
        (temperature 0), True without ``temperature`` samples at the run's ``gen_temperature``, or at 1.0 when that
        is 0. ``stop_at_eos`` (default): as transformers' ``generate`` ends a row at ``eos_token_id``, every
        generated token after a row's first EOS becomes ``pad_token_id`` (EOS when there is none); False returns
        the sampler's tokens as they are (difflm's samplers do; its commands cut the text at EOS).
        ``top_p`` is the nucleus of the temperature-scaled distribution (transformers' warper order).
        ``infill``: the prompt's ``mask_id`` positions are sampled too, with the first block, the given tokens
        kept (difflm's ``GenerationOptions.infill``; masked-diffusion exports only).
        Unknown keyword arguments raise TypeError.
        Raises ValueError, as difflm's sampler refuses them: ``max_new_tokens`` != ``gen_length``; a length, step or
        block count < 1; inconsistent lengths/steps; an unknown ``remasking``; ``temperature`` or ``cfg_scale`` < 0
        or infinite; ``top_k`` < 0; ``top_p`` or ``threshold`` outside (0, 1]; a ``threshold`` with
        ``remasking="entropy"``; for a causal export, a diffusion-only argument
        (``steps``, ``block_length``, ``remasking``, ``cfg_scale``, ``threshold``) away from difflm's default, or an
        empty prompt; a bad ``attention_mask``; an argument the others leave unread: ``top_k`` / ``top_p`` at
        temperature 0 (greedy), ``remdm_sigma`` / ``remdm_schedule`` without ``remasking="remdm"``.
        """
        cfg = self.config
        if max_new_tokens is not None:
            if gen_length is not None and gen_length != max_new_tokens:
                raise ValueError(f"max_new_tokens={max_new_tokens} and gen_length={gen_length} both set the number of "
                                 "generated tokens: give one of them")
            gen_length = max_new_tokens
        pick = lambda value, key, default: getattr(cfg, key, default) if value is None else value  # noqa: E731
        gen_length = pick(gen_length, "gen_length", 64)
        fits = _is_int(gen_length) and gen_length >= 1  # else refused below, naming gen_length
        if cfg.causal:  # difflm's GenerationOptions.check_autoregressive, on the arguments given
            given = dict(steps=steps, block_length=block_length, remasking=remasking, cfg_scale=cfg_scale,
                         threshold=threshold, remdm_sigma=remdm_sigma, remdm_schedule=remdm_schedule)
            # steps / block_length at difflm's former default 64 are accepted as difflm accepts them
            changed = [f"{k}={v!r}" for k, v in given.items() if v is not None and v != AR_IGNORED[k]
                       and v != FORMER_DEFAULTS.get(k)]
            if changed:
                keys = ", ".join(c.split("=")[0] for c in changed)
                raise ValueError(f"{', '.join(changed)}: this causal (objective=ar) export decodes left to right and "
                                 "reads only max_new_tokens (gen_length), temperature, top_k, top_p and generator: "
                                 f"drop {keys}")
        given_filters = {"top_k": top_k, "top_p": top_p}
        given_remdm = {"remdm_sigma": remdm_sigma, "remdm_schedule": remdm_schedule}
        block_length = pick(block_length, "gen_block_length", None)
        if block_length is None and fits:  # difflm's gen.block_length=null: fitted to the length
            block_length = _fitted_block_length(gen_length)
        steps = pick(steps, "gen_steps", None)
        if steps is None and fits:  # difflm's gen.steps=null
            steps = _fitted_steps(gen_length, block_length)
        if do_sample is False:
            temperature = 0.0
        elif do_sample and temperature is None:
            temperature = getattr(cfg, "gen_temperature", 0.0) or 1.0
        temperature = pick(temperature, "gen_temperature", 0.0)
        remasking = pick(remasking, "gen_remasking", "low_confidence")
        cfg_scale = pick(cfg_scale, "gen_cfg_scale", 0.0)
        top_k, top_p = pick(top_k, "gen_top_k", 0), pick(top_p, "gen_top_p", 1.0)
        threshold = pick(threshold, "gen_threshold", None)
        remdm_sigma = pick(remdm_sigma, "gen_remdm_sigma", 0.0)
        remdm_schedule = pick(remdm_schedule, "gen_remdm_schedule", "cap")
        _check_unread(given_filters, given_remdm, temperature, None if cfg.causal else remasking)
        mask_id = cfg.mask_token_id if mask_id is None else mask_id
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, P], got {tuple(input_ids.shape)}")
        input_ids = input_ids.long()
        valid = _valid_positions(attention_mask, input_ids)
        if valid is not None and not bool(valid.any(dim=1).all()):
            raise ValueError("attention_mask has a row without any real token: give each prompt a token")
        forbid = self._forbidden_ids()
        _check_sampling(gen_length, temperature, top_k, top_p)
        if cfg.causal:
            if infill:
                raise ValueError("infill=True needs a masked-diffusion export: this causal (objective=ar) export "
                                 "decodes left to right")
            if input_ids.shape[1] < 1:
                raise ValueError("input_ids must hold at least one token (e.g. BOS) for left-to-right decoding")
            out = self._generate_ar(input_ids, valid, gen_length, temperature, generator, forbid, top_k, top_p)
        else:
            if mask_id is None:
                raise ValueError("config.mask_token_id is not set: pass mask_id=")
            _check_remdm(remasking, remdm_sigma, remdm_schedule, threshold)
            out = self._generate_diffusion(input_ids, valid, steps, gen_length, block_length, temperature, cfg_scale,
                                           remasking, mask_id, generator, forbid, top_k, top_p, threshold,
                                           remdm_sigma, remdm_schedule, infill)
        eos, pad = getattr(cfg, "eos_token_id", None), getattr(cfg, "pad_token_id", None)
        if stop_at_eos and eos is not None:
            out[:, input_ids.shape[1]:] = _fill_after_eos(out[:, input_ids.shape[1]:], eos, eos if pad is None else pad)
        return out

    def _logits(self, x: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self(x, attention_mask=valid).logits.float()

    def _generate_ar(self, x, valid, length, temperature, generator, forbid, top_k, top_p):
        """Left to right, no KV cache (difflm's autoregressive_generate): argmax at T = 0, else softmax(l / T).
        The next token comes from each row's last real position (right padding: before the pads)."""
        rows = torch.arange(x.shape[0], device=x.device)
        for _ in range(length):
            logits = self._logits(x, valid)
            last_pos = x.shape[1] - 1 if valid is None else x.shape[1] - 1 - valid.flip(1).long().argmax(dim=1)
            last = _filter_top_k_top_p(_apply_forbid(logits[rows, last_pos], forbid), top_k, top_p, temperature)
            if temperature == 0:
                nxt = last.argmax(dim=-1)
            else:
                probs = torch.softmax(last.double() / temperature, dim=-1)  # float64, as difflm's sampler
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            x = torch.cat([x, nxt.unsqueeze(1)], dim=1)
            if valid is not None:
                valid = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=1)
        return x

    def _generate_diffusion(self, prompt, valid, steps, length, block_length, temperature, cfg_scale, remasking,
                            mask_id, generator, forbid, top_k, top_p, threshold, remdm_sigma=0.0, remdm_schedule="cap",
                            infill=False):
        num_blocks = _check_diffusion(length, steps, block_length, remasking, cfg_scale, threshold)
        steps_per_block = steps // num_blocks
        batch, prompt_len = prompt.shape
        x = torch.cat([prompt, torch.full((batch, length), mask_id, dtype=torch.long, device=prompt.device)], 1)
        if valid is not None:  # the generated positions are real tokens
            valid = torch.cat([valid, torch.ones(batch, length, dtype=torch.bool, device=valid.device)], dim=1)
        first_masked = prompt_len  # infill: the first block also covers the prompt's masked positions
        if infill and bool((prompt == mask_id).any()):
            first_masked = int((prompt == mask_id).any(dim=0).nonzero()[0])
        for block in range(num_blocks):
            start = prompt_len + block * block_length
            end = start + block_length
            if block == 0:
                start = first_masked
            to_decode = x[:, start:end] == mask_id
            schedule = _num_transfer_tokens(to_decode.sum(dim=1), steps_per_block)
            decoded_confidence = torch.zeros(to_decode.shape, dtype=torch.float64, device=x.device)
            step = 0
            while (x[:, start:end] == mask_id).any() if threshold is not None else step < steps_per_block:
                candidates = x[:, start:end] == mask_id  # [B, N]
                if cfg_scale > 0:  # unconditional input: the real prompt tokens masked
                    uncond = x.clone()
                    real = torch.ones_like(prompt, dtype=torch.bool) if valid is None else valid[:, :prompt_len]
                    uncond[:, :prompt_len] = torch.where(real, torch.full_like(prompt, mask_id), prompt)
                    both = None if valid is None else torch.cat([valid, valid])
                    cond, un = self._logits(torch.cat([x, uncond]), both)[:, start:end].chunk(2)
                    logits = un + (cfg_scale + 1.0) * (cond - un)
                else:
                    logits = self._logits(x, valid)[:, start:end]
                rule = "low_confidence" if remasking == "remdm" else remasking
                x0, confidence = _propose(_apply_forbid(logits, forbid), rule, temperature, generator, top_k, top_p)
                count = schedule[:, min(step, steps_per_block - 1)]
                if remasking == "remdm":  # ReMDM in count form (difflm.sampling.remdm)
                    remask, count = _remdm_remask(to_decode & ~candidates, decoded_confidence, candidates.sum(dim=1),
                                                  count, to_decode.sum(dim=1), remdm_sigma, remdm_schedule)
                transfer = _select_transfer(confidence, candidates, count, threshold)
                x[:, start:end] = torch.where(transfer, x0, x[:, start:end])
                if remasking == "remdm":
                    decoded_confidence = torch.where(transfer, confidence, decoded_confidence)
                    x[:, start:end] = x[:, start:end].masked_fill(remask, mask_id)
                step += 1
        return x


REMASKING = ("low_confidence", "random", "margin", "entropy")
REMDM_SCHEDULES = ("cap", "rescale")
# difflm's defaults of the diffusion-only settings (GenerationOptions): a causal export's generate refuses others
# (steps / block_length None: fitted to gen_length; their FORMER_DEFAULTS are accepted too)
AR_IGNORED = {"steps": None, "block_length": None, "remasking": "low_confidence", "cfg_scale": 0.0,
              "threshold": None, "remdm_sigma": 0.0, "remdm_schedule": "cap"}
# difflm's DEFAULT_BLOCK_LENGTH / DEFAULT_STEPS: what block_length / steps None give at most
DEFAULT_BLOCK_LENGTH, DEFAULT_STEPS = 64, 64
# what steps and block_length were before None fitted them to gen_length (difflm's FORMER_DEFAULTS)
FORMER_DEFAULTS = {"steps": 64, "block_length": 64}


def _fitted_block_length(length: int) -> int:
    """difflm's ``gen.block_length=null`` for ``length`` (>= 1) tokens: the largest divisor of ``length`` not above
    :data:`DEFAULT_BLOCK_LENGTH` (``length`` itself up to 64; 64 for 128, 48 for 96) while it is at least a quarter
    of it, else one block of ``length`` (67, 127)."""
    if length <= DEFAULT_BLOCK_LENGTH:
        return length
    divisor = next(d for d in range(DEFAULT_BLOCK_LENGTH, 0, -1) if length % d == 0)
    return divisor if divisor >= DEFAULT_BLOCK_LENGTH // 4 else length


def _fitted_steps(length: int, block_length) -> int:
    """difflm's ``gen.steps=null``: ``min(64, length)`` rounded down to a multiple of the block count (a block that
    does not divide ``length`` counts as one: the sampler refuses it), at least one step per block."""
    fits = _is_int(block_length) and 0 < block_length <= length and length % block_length == 0
    blocks = length // block_length if fits else 1
    return max(blocks, min(DEFAULT_STEPS, length) // blocks * blocks)


def _check_unread(filters: dict, remdm: dict, temperature, remasking) -> None:
    """difflm's ``check_read_settings`` on the arguments given (``filters``: ``top_k`` / ``top_p``, ``remdm``:
    ``remdm_sigma`` / ``remdm_schedule``; None: not given): a filter at temperature 0 (greedy keeps the argmax) and,
    for a diffusion export (``remasking`` the one used; None for a causal export, which refuses them itself), ReMDM
    settings without ``remasking="remdm"``. Raises ValueError naming the argument and the fix."""
    off = {"top_k": 0, "top_p": 1.0, "remdm_sigma": 0.0, "remdm_schedule": "cap"}
    if remasking is not None and remasking != "remdm":
        for key, value in remdm.items():
            if value is not None and value != off[key]:
                raise ValueError(f"{key}={value!r} has no effect without remasking='remdm': pass remasking='remdm' "
                                 "or drop it")
    if _is_real(temperature) and temperature == 0:
        for key, value in filters.items():
            if value is not None and value != off[key]:
                raise ValueError(f"{key}={value!r} has no effect with temperature=0 (greedy): pass temperature>0 "
                                 "(or do_sample=True) or drop it")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_sampling(length, temperature, top_k, top_p) -> None:
    """difflm's ``GenerationOptions`` checks of the settings every sampler reads. Raises ValueError naming the
    argument."""
    if not _is_int(length) or length < 1:
        raise ValueError(f"gen_length (max_new_tokens)={length!r} must be an integer >= 1")
    if not _is_real(temperature) or not 0 <= temperature < math.inf:
        raise ValueError(f"temperature={temperature!r} must be >= 0 and finite (0 = greedy)")
    if not _is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k={top_k!r} must be an integer >= 0 (0 = off)")
    if not _is_real(top_p) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p!r} must be in (0, 1] (1 = off)")


def _consistent_setting(length: int, steps: int, block_length: int) -> str:
    """The nearest accepted ``gen_length``/``block_length``/``steps``, keeping ``gen_length`` (difflm's
    ``consistent_setting``)."""
    block = block_length if 0 < block_length <= length and length % block_length == 0 else length
    blocks = length // block
    fitted = max(blocks, min(steps, length) // blocks * blocks)
    return f"gen_length={length}, block_length={block}, steps={fitted}"


def _check_diffusion(length, steps, block_length, remasking, cfg_scale, threshold) -> int:
    """difflm's checks of the masked-diffusion settings (``GenerationOptions`` and the LLaDA sampler's block and
    step rules); returns the number of blocks. Raises ValueError naming the argument (with a consistent setting)."""
    if not _is_int(steps) or steps < 1:
        raise ValueError(f"steps={steps!r} must be an integer >= 1")
    if not _is_int(block_length) or block_length < 1:
        raise ValueError(f"block_length={block_length!r} must be an integer >= 1")
    if remasking not in REMASKING + ("remdm",):
        raise ValueError(f"remasking={remasking!r} must be one of {REMASKING + ('remdm',)}")
    if not _is_real(cfg_scale) or not 0 <= cfg_scale < math.inf:
        raise ValueError(f"cfg_scale={cfg_scale!r} must be >= 0 and finite (0 = off)")
    if threshold is not None and (not _is_real(threshold) or not 0.0 < threshold <= 1.0):
        raise ValueError(f"threshold={threshold!r} must be in (0, 1] or None (None = fixed schedule)")
    if threshold is not None and remasking == "entropy":
        raise ValueError(f"threshold={threshold!r} is compared with a confidence in (0, 1], and remasking='entropy' "
                         "gives minus an entropy (<= 0), which never reaches it: every step would unmask one token "
                         "whatever steps; pass remasking='low_confidence' or 'margin', or threshold=None")
    fix = f"; e.g. {_consistent_setting(length, steps, block_length)}"
    if length % block_length:
        raise ValueError(f"gen_length={length} must be a multiple of block_length={block_length}{fix}")
    num_blocks = length // block_length
    if steps < num_blocks or steps % num_blocks:
        raise ValueError(f"steps={steps} must be a multiple of the number of blocks gen_length/block_length="
                         f"{num_blocks}{fix}")
    if steps > length:
        raise ValueError(f"steps={steps} must be <= gen_length={length} (at least one token per step){fix}")
    return num_blocks


def _fill_after_eos(generated: torch.Tensor, eos, pad) -> torch.Tensor:
    """``generated`` [B, L] with every token after a row's first ``eos`` (an id or a list of ids) set to ``pad``
    (an id, or the first of a list): transformers' ``generate`` pads a finished row so."""
    eos_ids = torch.tensor(eos if isinstance(eos, (list, tuple)) else [eos], device=generated.device)
    pad = pad[0] if isinstance(pad, (list, tuple)) else pad
    is_eos = torch.isin(generated, eos_ids).long()
    after = (is_eos.cumsum(dim=1) - is_eos) > 0
    return generated.masked_fill(after, int(pad))


def _check_remdm(remasking, sigma, schedule, threshold) -> None:
    """difflm's checks of the ReMDM settings (``GenerationOptions``). Raises ValueError naming the argument."""
    if schedule not in REMDM_SCHEDULES:
        raise ValueError(f"remdm_schedule={schedule!r} must be one of {REMDM_SCHEDULES}")
    if not _is_real(sigma) or not sigma >= 0:
        raise ValueError(f"remdm_sigma={sigma!r} must be a number >= 0 (0 = no remasking)")
    if schedule == "rescale" and sigma > 1:
        raise ValueError(f"remdm_sigma={sigma!r} must be in [0, 1] under remdm_schedule={schedule}")
    if remasking == "remdm" and threshold is not None:
        raise ValueError("remasking='remdm' remasks against the fixed unmasking schedule: pass threshold=None")


def _remdm_remask(decoded, decoded_confidence, masked_count, count, block_count, eta, schedule):
    """ReMDM (Wang et al. 2025, arXiv:2503.00307, sec. 3-4.1) in count form, as difflm's ``remdm_remask``: remask the
    r = round(sigma_t n) least confident of the block's n decoded tokens (ties leftmost), sigma_t = min(eta,
    sigma_max) (cap) or eta sigma_max (rescale), sigma_max = min(1, (1 - alpha_s) / alpha_t), alpha_t = n / N,
    alpha_s = (n + k) / N; returns (remask [B, N] bool, k + r [B])."""
    n = decoded.sum(dim=1)
    total = block_count.clamp(min=1).double()
    alpha_t, alpha_s = n.double() / total, (n + count).double() / total
    safe = torch.where(alpha_t > 0, alpha_t, torch.ones_like(alpha_t))
    sigma_max = torch.where(alpha_t > 0, ((1 - alpha_s) / safe).clamp(0.0, 1.0), torch.zeros_like(alpha_t))
    sigma = sigma_max.clamp(max=eta) if schedule == "cap" else eta * sigma_max
    r = torch.minimum(torch.floor(sigma * n.double() + 0.5).long(), (masked_count - count).clamp(min=0))
    order = torch.sort(decoded_confidence.masked_fill(~decoded, float("inf")), dim=1, stable=True).indices
    ranks = torch.arange(decoded.shape[1], device=decoded.device).unsqueeze(0)
    return torch.zeros_like(decoded).scatter(1, order, ranks < r.unsqueeze(1)) & decoded, count + r


def _valid_positions(attention_mask: Optional[torch.Tensor], input_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """``attention_mask`` [B, S] (1 real, 0 padding) as a bool tensor on ``input_ids``' device, or None when it is
    absent or all ones. Raises ValueError when its shape is not that of ``input_ids``."""
    if attention_mask is None:
        return None
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must have the shape of input_ids "
                         f"{tuple(input_ids.shape)}")
    valid = attention_mask.bool().to(input_ids.device)
    return None if bool(valid.all()) else valid


def _previous_real(valid: Optional[torch.Tensor], b: int, s: int, device) -> torch.Tensor:
    """[B, S] int64: the last real position before each position (itself where there is none, as position 0);
    ``valid`` [B, S] bool (None: no padding, so i - 1)."""
    pos = torch.arange(s, device=device).expand(b, s)
    if valid is None:
        return (pos - 1).clamp(min=0)
    last_real = torch.where(valid, pos, torch.full_like(pos, -1)).cummax(dim=1).values
    prev = torch.cat([torch.full_like(pos[:, :1], -1), last_real[:, :-1]], dim=1)
    return torch.where(prev >= 0, prev, pos)


def _num_transfer_tokens(mask_count: torch.Tensor, steps: int) -> torch.Tensor:
    """[B] masked counts -> [B, steps] tokens unmasked per step, split evenly, remainder first (LLaDA)."""
    base = mask_count.long().unsqueeze(1) // steps
    remainder = mask_count.long().unsqueeze(1) % steps
    return base + (torch.arange(steps, device=mask_count.device).unsqueeze(0) < remainder).long()


def _gumbel_argmax(logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator]) -> torch.Tensor:
    """argmax of ``logits + T * Gumbel`` in float64 (LLaDA's add_gumbel_noise, log form); T = 0: argmax."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.to(torch.float64)
    u = torch.rand(logits.shape, generator=generator, dtype=torch.float64, device=logits.device)
    return (logits - temperature * torch.log(-torch.log(u))).argmax(dim=-1)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0,
                        temperature: float = 1.0) -> torch.Tensor:
    """Keep the ``top_k`` largest logits and the nucleus of mass ``top_p`` of ``softmax(logits / temperature)`` (the
    order of transformers' temperature, top-k and top-p warpers); the rest -inf (0 / 1 = off)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits.double() / (temperature if temperature > 0 else 1.0), dim=-1)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    return logits


def _propose(logits, remasking, temperature, generator, top_k, top_p):
    """(x0 [B, N] int64, confidence [B, N] float64) for block logits [B, N, V] (see ``generate``)."""
    x0 = _gumbel_argmax(_filter_top_k_top_p(logits, top_k, top_p, temperature), temperature, generator)
    if remasking == "random":
        return x0, torch.rand(x0.shape, generator=generator, dtype=torch.float64, device=x0.device)
    # the model's (unfiltered) distribution in float64, as LLaDA: in float32 leads > ~17 nats tie at 1.0, and a
    # one-token nucleus would give every such position confidence 1
    probs = torch.softmax(logits.double(), dim=-1)
    if remasking == "low_confidence":
        confidence = probs.gather(-1, x0.unsqueeze(-1)).squeeze(-1)
    elif remasking == "margin":
        top2 = probs.topk(2, dim=-1).values
        confidence = top2[..., 0] - top2[..., 1]
    else:  # entropy
        confidence = -torch.special.entr(probs).sum(dim=-1)
    return x0, confidence


def _select_transfer(confidence, candidates, count, threshold):
    """[B, N] bool: the ``count[b]`` most confident candidates (ties leftmost), or with ``threshold`` all
    candidates at or above it and at least the most confident one."""
    confidence = confidence.masked_fill(~candidates, float("-inf"))
    order = torch.sort(confidence, dim=1, descending=True, stable=True).indices
    ranks = torch.arange(confidence.shape[1], device=confidence.device).unsqueeze(0)
    if threshold is None:
        return torch.zeros_like(candidates).scatter(1, order, ranks < count.unsqueeze(1)) & candidates
    first = torch.zeros_like(candidates).scatter(1, order, (ranks == 0).expand_as(order))
    return (first | (confidence >= threshold)) & candidates


def _apply_forbid(logits: torch.Tensor, forbid: Sequence[int]) -> torch.Tensor:
    if not forbid:
        return logits
    logits = logits.clone()
    logits[..., list(forbid)] = float("-inf")
    return logits


DiffLMModel = DiffLMForMaskedLM  # AutoModel maps here too: the logits are what a diffusion LM is for
