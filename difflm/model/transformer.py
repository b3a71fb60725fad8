"""The one Llama-style transformer, bidirectional for masked diffusion (LLaDA) or causal for the AR baseline.

The network is written once; which module fills each slot (a fused norm + linear, a linear, a fused MLP, a norm,
the attention kernel) comes from a kernel set chosen by ``model.backend`` (:mod:`difflm.model.kernels`: ``torch``,
or ``te`` for Transformer Engine). Masks, positions, KV caches, pipeline stages and checkpoints are written once for
both. The model only knows its dimensions and attention type; precision, parallel layout and the objective are
applied from outside. Parameter names follow Transformer Engine (see :mod:`difflm.model.layers`)::

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

The fused QKV rows are grouped per KV head as Megatron-LM does: for each of the h_kv groups, ``h / h_kv`` query
heads, then its key head, then its value head. Splitting the rows evenly across tensor-parallel ranks therefore
gives each rank whole groups.

A pipeline stage is the same class holding a run of blocks (:meth:`Transformer.pipeline_stage`): without the
embedding it takes hidden states, without the final norm it returns them.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from difflm.errors import DifflmError
from difflm.model.attention import attend, opaque_kernel, prepare_mask
from difflm.model.init import megatron_init_
from difflm.model.kernels import TorchKernels
from difflm.model.loss_rows import LossRows, loss_rows
from difflm.model.moe import MoEMLP, is_moe_layer, moe_config
from difflm.model.qkv import qkv_heads
from difflm.kernels.qkv_flash import fused_qkv_flash_applies, qkv_flash_attention
from difflm.model.rope import rope_angles


class Attention(nn.Module):
    """Multi-head attention with GQA, RoPE and optional QK-norm, through :func:`difflm.model.attention.attend`; q, k
    and v come out of the fused QKV projection through :func:`difflm.model.qkv.qkv_heads` (Triton kernels on CUDA).
    With FlashAttention 4 and no mask, both steps run as one function that never copies the value heads
    (:func:`difflm.kernels.qkv_flash.qkv_flash_attention`).

    Shapes: x [B, S, d] (or [S, B, d] in a sequence-first kernel set) -> same. ``num_heads`` / ``num_kv_heads`` are
    this rank's counts (tensor parallelism divides them). ``causal`` selects the AR mask; diffusion attends both ways.
    Raises: DifflmError when the tensor-parallel size does not divide the KV heads.
    """

    def __init__(self, cfg, causal: bool, kernels, layer_number: int):
        super().__init__()
        tp = kernels.tp_size
        if cfg.num_kv_heads % tp:
            raise DifflmError(f"model.num_kv_heads={cfg.num_kv_heads} is not divisible by the tensor-parallel size "
                              f"{tp}: pick parallel.tp dividing the KV heads")
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads // tp, cfg.num_kv_heads // tp, cfg.head_dim
        self.causal, self.kernels = causal, kernels
        self.attention_backend = getattr(cfg, "attention_backend", "sdpa")  # see difflm.model.attention
        opaque_kernel(self.attention_backend)  # te / flash: their torch.compiler.disable wrapper, before any compile
        self.fused_qkv = bool(getattr(cfg, "fused_qkv", True))  # see difflm.model.qkv
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv = kernels.norm_linear(cfg.hidden_size, qkv_out, eps=cfg.norm_eps, bias=bool(getattr(cfg, "qkv_bias", False)))
        self.q_norm = kernels.norm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = kernels.norm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.core = kernels.attention_core(cfg, causal, layer_number)
        self.proj = kernels.linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size)

    def forward(self, x: torch.Tensor, rope, attn_mask=None, kv_cache=None,
                rows: Optional[LossRows] = None) -> torch.Tensor:
        return self.from_qkv(self.qkv(x), rope, attn_mask, kv_cache, rows)

    def from_qkv(self, qkv: torch.Tensor, rope, attn_mask=None, kv_cache=None,
                 rows: Optional[LossRows] = None) -> torch.Tensor:
        """The attention output from the fused QKV projection ``qkv`` [B, S, (H + 2 H_kv) D] (or sequence-first):
        [B, S, d], or [R, d] at ``rows`` (batch-first only; :mod:`difflm.model.loss_rows`), where the queries of
        FlashAttention 4's one-function path are those rows only and every other path selects the rows of the
        attention output before the projection."""
        lead = qkv.shape[:2]  # (B, S), or (S, B) sequence-first; TE's SP has all-gathered the sequence here
        if fused_qkv_flash_applies(qkv, rope, self.q_norm, self.k_norm, backend=self.attention_backend,
                                   layout=self.kernels.layout, fused=self.fused_qkv, attn_mask=attn_mask,
                                   kv_cache=kv_cache, head_dim=self.head_dim):  # value heads read in place
            out = qkv_flash_attention(qkv, rope, self.num_heads, self.num_kv_heads, self.head_dim, self.q_norm,
                                      self.k_norm, self.causal, rows=rows)
            return self.proj(out.reshape(*out.shape[:-2], -1))
        q, k, v = qkv_heads(qkv, rope, self.num_heads, self.num_kv_heads, self.head_dim, self.q_norm, self.k_norm,
                            fused=self.fused_qkv)
        if kv_cache is not None:  # difflm.model.kv_cache.LayerKV: cached K/V around this forward's positions
            k, v = kv_cache.update(k, v)
        out = attend(q, k, v, causal=self.causal, backend=self.attention_backend, layout=self.kernels.layout,
                     attn_mask=attn_mask, core=self.core if self.attention_backend == "te" else None)
        out = out.reshape(*lead, -1)
        return self.proj(out if rows is None else rows.select(out))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))`` (the norms live in the slots)."""

    def __init__(self, cfg, causal: bool, kernels, layer_number: int):
        super().__init__()
        self.attention = Attention(cfg, causal, kernels, layer_number)
        if is_moe_layer(cfg, layer_number - 1):  # mixture of experts past model.moe.first_k_dense (difflm.model.moe)
            with torch.device(kernels.device):
                self.mlp = MoEMLP(cfg)  # the same torch modules under both kernel sets
            kernels.accumulate_weight_grads(self.mlp.experts, "fc1_weight", "fc2_weight")
        else:
            self.mlp = kernels.norm_mlp(cfg.hidden_size, cfg.ffn_hidden_size, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor, rope, attn_mask=None, kv_cache=None,
                rows: Optional[LossRows] = None) -> torch.Tensor:
        """[B, S, d] (or sequence-first) -> the same; with ``rows`` (the last block of a masked-diffusion loss,
        :mod:`difflm.model.loss_rows`) the keys and values still come from every position, and the output is
        [R, d] at the rows only."""
        if getattr(self.attention.qkv, "passes_residual", False):  # model.fused_mlp: the residual's gradient is added
            qkv, x = self.attention.qkv(x, pass_residual=True)      # inside the QKV norm's backward kernel
            branch = self.attention.from_qkv(qkv, rope, attn_mask, kv_cache, rows)
        else:
            branch = self.attention(x, rope, attn_mask, kv_cache, rows)
        if rows is not None:
            x = rows.select(x)
        if getattr(self.mlp, "adds_residual", False):  # both residual adds inside its kernels (model.fused_mlp)
            # R changes every step: quack's default tiles for these GEMMs, as autotuning would tune every R
            return self.mlp(branch, x) if rows is None else self.mlp(branch, x, varying_rows=True)
        x = x + branch
        return x + self.mlp(x)


class Transformer(nn.Module):
    """The whole network: embedding, ``num_layers`` blocks, final RMSNorm, LM head.

    Args:
        cfg: a :class:`difflm.config.schema.ModelConfig` with ``vocab_size`` and ``head_dim`` resolved.
        causal: True for the AR objective; False (bidirectional) for masked diffusion.
        kernels: the kernel set (:func:`difflm.model.build_kernels`); default: torch modules built on the
            current default device.
    """

    def __init__(self, cfg, causal: bool = False, kernels=None):
        super().__init__()
        if kernels is None:
            kernels = TorchKernels(cfg, device=torch.get_default_device())
        self.cfg, self.causal, self.kernels = cfg, causal, kernels
        self.seq_shards = 1  # sequence shards a pipeline stage's hidden-state input holds (SP)
        self.step_inputs: dict = {}  # pipeline stages: inputs every micro-batch of a step shares (see forward)
        self.embedding = kernels.embedding(cfg.vocab_size, cfg.hidden_size)
        blocks = []
        for i in range(cfg.num_layers):
            with kernels.block_init_context(i):
                blocks.append(Block(cfg, causal, kernels, layer_number=i + 1))
        self.layers = nn.ModuleList(blocks)
        self.final_norm = kernels.norm(cfg.hidden_size, eps=cfg.norm_eps, residual=True)
        self.output = None if cfg.tie_embeddings else kernels.lm_head(cfg.hidden_size, cfg.vocab_size)
        # the last block at the loss rows only (difflm.model.loss_rows): bidirectional, dense, batch-first, one
        # tensor-parallel rank (torch TP turns it off in difflm.parallel.tensor_parallel), no MoE (its balancing
        # terms count every token), no Dream shift (its head reads the row before)
        self.last_block_loss_rows = (bool(getattr(cfg, "last_block_loss_rows", False)) and not causal
                                     and kernels.tp_size == 1 and kernels.layout == "bshd"
                                     and moe_config(cfg) is None and not getattr(cfg, "shift_logits", False))

    # ------------------------------------------------------------------ structure
    def blocks(self) -> list[tuple[int, nn.Module]]:
        """(index in the full model, block) of the blocks this module holds."""
        if isinstance(self.layers, nn.ModuleDict):
            return [(int(k), b) for k, b in self.layers.items()]
        return list(enumerate(self.layers))

    def pipeline_stage(self, layer_ids: Iterable[int], first: bool, last: bool, seq_shards: int = 1) -> "Transformer":
        """A pipeline stage of this model: blocks ``layer_ids`` (kept under their full-model names, ``layers.{i}``),
        the embedding when ``first``, the final norm and LM head when ``last``. It shares the modules (no copy), so
        a rank keeps only the parameters its stages reference. ``seq_shards``: sequence shards of a hidden-state
        input under torch sequence parallelism.

        Forward of a stage: ``input_ids`` [B, S] on the first stage or hidden states from the previous stage;
        returns hidden states, or on the last stage logits [B, S, V] (the loss selects rows; [B, S, V/tp] under TP).
        """
        stage = Transformer.__new__(Transformer)
        nn.Module.__init__(stage)
        stage.cfg, stage.causal, stage.kernels, stage.seq_shards = self.cfg, self.causal, self.kernels, seq_shards
        stage.step_inputs = {}
        stage.embedding = self.embedding if first else None
        stage.layers = nn.ModuleDict({str(i): self.layers[i] for i in layer_ids})
        stage.final_norm = self.final_norm if last else None
        stage.output = self.output if last else None
        stage.last_block_loss_rows = self.last_block_loss_rows
        return stage

    def pipeline_io(self, batch: int, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, output) meta tensors of this pipeline stage for micro-batches of ``batch`` x ``seq_len`` tokens with
        activations in ``dtype``: ``input_ids`` [B, S] int64 or hidden states ([B, S/n, d], or [S/n, B, d] in a
        sequence-first kernel set; n = ``seq_shards``), and hidden states or logits [B, S, V]."""
        d = self.cfg.hidden_size
        local = seq_len // self.seq_shards
        hidden = (local, batch, d) if self.kernels.layout == "sbhd" else (batch, local, d)
        inputs = torch.empty(batch, seq_len, dtype=torch.long, device="meta") if self.embedding is not None \
            else torch.empty(hidden, dtype=dtype, device="meta")
        outputs = torch.empty(batch, seq_len, self.cfg.vocab_size, dtype=dtype, device="meta") \
            if self.final_norm is not None else torch.empty(hidden, dtype=dtype, device="meta")
        return inputs, outputs

    def head_weight(self) -> torch.Tensor:
        return self.embedding.weight if self.output is None else self.output.weight

    @property
    def tp_group(self):
        """The tensor-parallel group of TE's sharded parameters (None: no plain-tensor shards)."""
        return self.kernels.tp_group

    def tp_shards(self):
        """This rank's place for plain-tensor TP shards (TE kernels), or None (see the kernel sets)."""
        return self.kernels.tp_shards()

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, logits_mask: Optional[torch.Tensor] = None, attn_mask=None,
                position_ids: Optional[torch.Tensor] = None, kv_cache=None) -> torch.Tensor:
        """Logits for ``input_ids`` [B, S] int64 (hidden states on a pipeline stage without the embedding).

        Optional inputs (all default to the plain full-sequence forward):
            attn_mask: replaces the model's own bidirectional / causal pattern: a dense bool
                [B | 1, 1, S, S_kv] tensor (True = attend), a FlexAttention ``BlockMask``, or a structured mask of
                :mod:`difflm.model.masks` (BD3-LM block-causal, packed documents). Each attention backend takes
                what it can and refuses the rest with one line (:mod:`difflm.model.attention`).
            position_ids: RoPE positions, [S] or [B, S] int64 (default ``0..S-1``); BD3-LM repeats
                ``0..L-1`` for both halves of ``[x_t ; x_0]``, padded batches skip pad tokens, context-parallel
                ranks pass the positions of their chunks.
            kv_cache: a :class:`difflm.model.kv_cache.KVCache` (block-level cache for decoding).

        A pipeline schedule passes only activations between stages, so a stage takes ``attn_mask`` /
        ``position_ids`` that every micro-batch shares (BD3-LM's mask and positions) from ``self.step_inputs``,
        which :class:`difflm.parallel.pipeline.Pipeline` sets before each step.

        With ``model.shift_logits`` (Dream, Ye et al. 2025) the logits at position i come from the hidden
        state at i - 1 (position 0 keeps its own), so an AR-initialised model keeps predicting "the next
        token" while the objective and the sampler read logits[i] as the prediction of token i.
        Returns [B, S, V] in the compute dtype, or, when ``logits_mask`` is given, only the selected positions
        [N, V] (row-major order) - the diffusion loss needs logits at masked tokens only, which saves most of the
        LM-head FLOPs and memory. ``logits_mask`` is a [B, S] bool mask, or the [N] int64 indices of the selected
        positions in the flattened ``B * S`` tokens (computed where the mask was drawn: selecting by index needs no
        device-to-host sync, a boolean mask does). Given the indices, a bidirectional model also runs its last block
        at those rows only (``model.last_block_loss_rows``, :mod:`difflm.model.loss_rows`): the same logits.
        """
        if self.embedding is not None:
            batch, seq_len = input_ids.shape
        else:  # a later pipeline stage: hidden states, maybe a sequence shard ([B, S/n, d] or [S/n, B, d])
            seq_dim = 0 if self.kernels.layout == "sbhd" else 1
            batch, seq_len = input_ids.shape[1 - seq_dim], input_ids.shape[seq_dim] * self.seq_shards
        attn_mask = self.step_inputs.get("attn_mask") if attn_mask is None else attn_mask
        position_ids = self.step_inputs.get("position_ids") if position_ids is None else position_ids
        with self.kernels.forward_context(batch * seq_len):
            x = input_ids if self.embedding is None else self.kernels.enter(self.embedding(input_ids))
            if position_ids is None:
                position_ids = torch.arange(seq_len, device=x.device)
            rope = self.kernels.rope(rope_angles(position_ids.to(x.device), self.cfg.head_dim, self.cfg.rope_base,
                                                  getattr(self.cfg, "partial_rotary_factor", 1.0)))
            attn_mask = prepare_mask(attn_mask, getattr(self.cfg, "attention_backend", "sdpa"))  # once, not per layer
            blocks = self.blocks()
            rows = self._last_block_rows(x, logits_mask, kv_cache, blocks, batch, seq_len)
            for i, layer in blocks:
                with self.kernels.layer_context(i):
                    if rows is not None and i == blocks[-1][0]:
                        x = layer(x, rope, attn_mask, None, rows=rows)  # [R, d]: the loss rows only
                    elif attn_mask is None and kv_cache is None:
                        x = layer(x, rope)
                    else:
                        x = layer(x, rope, attn_mask, None if kv_cache is None else kv_cache.layer(i))
            if self.final_norm is None:
                return x
            if rows is not None:
                return self.head(rows.in_given_order(x))  # the rows' logits, in logits_mask's order
            return self.head(x, logits_mask)

    def _last_block_rows(self, x: torch.Tensor, logits_mask, kv_cache, blocks, batch: int,
                         seq_len: int) -> Optional[LossRows]:
        """The rows the last block runs at (:mod:`difflm.model.loss_rows`), or None for the full block: this module
        holds the last block and the head, ``logits_mask`` is an index, no KV cache, a batch-first plain tensor."""
        if (not self.last_block_loss_rows or self.final_norm is None or kv_cache is not None or not blocks
                or blocks[-1][0] != self.cfg.num_layers - 1 or type(x) is not torch.Tensor
                or tuple(x.shape[:2]) != (batch, seq_len)):
            return None
        return loss_rows(logits_mask, batch, seq_len)

    def head(self, x: torch.Tensor, logits_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Final norm and LM head on the residual stream ``x``: logits [B, S, V], or [N, V] at ``logits_mask``.
        Under tensor parallelism the head is vocab-parallel: each rank returns its [.., V/tp] slice
        (:mod:`difflm.parallel.vocab_parallel`; ``gather_logits`` for full ones)."""
        x = self.kernels.exit(self.final_norm(x))
        if getattr(self.cfg, "shift_logits", False):  # Dream: position i predicts token i (from state i - 1)
            x = torch.cat([x[:, :1], x[:, :-1]], dim=1)
        if logits_mask is not None:
            x = x[logits_mask] if logits_mask.dtype == torch.bool else x.flatten(0, 1).index_select(0, logits_mask)
        return F.linear(x, self.embedding.weight) if self.output is None else self.output(x)

    # ------------------------------------------------------------------ weights
    def init_weights(self, seed: int) -> None:
        """Keyed Megatron-style init (:func:`difflm.model.init.megatron_init_`): every kernel set and every layout
        built with the same seed holds identical weights; a rank holding shards (TE's TP, DTensors) draws only the
        init tiles of its shards (:class:`difflm.parallel.materialize.ShardLocator`)."""
        from difflm.parallel.materialize import ShardLocator

        megatron_init_(self, self.cfg, seed, locate=ShardLocator([self]))

    def num_params(self, exclude_embedding: bool = True) -> int:
        """Parameter count of the whole model (TE TP shards counted at their full size, so MFU under TP is that of
        the full model); with ``exclude_embedding`` the input embedding is left out (PaLM's N for MFU)."""
        shards = self.tp_shards()
        n = sum((p.numel() if shards is None else shards.full_shape(name, p.shape).numel())
                for name, p in self.named_parameters())
        if exclude_embedding and self.output is not None and self.embedding is not None:
            n -= self.embedding.weight.numel()
        return n
