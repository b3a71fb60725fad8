"""Transformer Engine backend (``model.backend=te``): the network of :mod:`difflm.model.transformer` built
from Transformer Engine modules, so its matrix products can run in FP8 and its norms/activations fused.

Module for module (parameter names and shapes are those of the torch backend, see
:mod:`difflm.model.layers`)::

    layers.{i}.attention.qkv      te.LayerNormLinear(normalization="RMSNorm")  layer_norm_weight [d], weight [(h+2h_kv) hd, d]
    layers.{i}.attention.q_norm   te.RMSNorm(hd)                               weight [hd]   (model.qk_norm)
    layers.{i}.attention.k_norm   te.RMSNorm(hd)                               weight [hd]   (model.qk_norm)
    layers.{i}.attention.core     te.DotProductAttention(attn_mask_type="no_mask" | "causal")   no parameters
    layers.{i}.attention.proj     te.Linear                                    weight [d, h hd]
    layers.{i}.mlp                te.LayerNormMLP(activation="swiglu")         layer_norm_weight, fc1_weight [2f, d], fc2_weight [d, f]
    final_norm                    te.RMSNorm(d)                                weight [d]
    embedding, output             torch nn.Embedding / nn.Linear (kept in BF16 under FP8, as Megatron-LM's LM head)

Every TE module also carries an ``_extra_state`` entry in the state dict (its FP8 scaling metadata: an
empty uint8 tensor until FP8 has run, then a serialized ``DelayedScaling`` amax history). That is the
only difference between the two layouts; :func:`torch_to_te_state_dict` and :func:`te_to_torch_state_dict`
convert, and ``tests/fixtures/te_tiny_state_dict.json`` records the names and shapes a real TE model has.

Tensor/sequence/context parallelism use TE's own arguments (``tp_group``, ``parallel_mode``,
``sequence_parallel``, ``cp_group``): as the design notes say, the TE backend is the one place that takes
process groups in its constructor, because TE's TP/CP live inside its modules.
With ``sequence_parallel`` the activations are kept sequence-first ("sbhd"), as TE splits dim 0.
Transformer Engine is imported only when a model is built.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from difflm.errors import DifflmError
from difflm.model.attention import attend
from difflm.model.init import megatron_init_
from difflm.model.transformer import Transformer
from difflm.parallel.te_tensor_parallel import TensorParallelShards, gather_sequence, scatter_sequence
from difflm.training.precision import (
    build_fp8_recipe,
    fp8_is_active,
    import_te,
    precision_name,
    quantized_model_init,
    te_autocast,
)

EXTRA_STATE = "_extra_state"
FP8_ROWS_MULTIPLE = 32  # FP8 GEMMs need the token count divisible by 16 (32 for block/MX scaling)


# ------------------------------------------------------------------ state-dict layout
def te_module_names(cfg) -> list[str]:
    """Paths of the TE modules of a ``model`` config, i.e. the state-dict prefixes with an ``_extra_state``."""
    names = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}.attention."
        names.append(p + "qkv")
        if cfg.qk_norm:
            names += [p + "q_norm", p + "k_norm"]
        names += [p + "core", p + "proj", f"layers.{i}.mlp"]
    names.append("final_norm")
    return names


def _is_te_quantized(t) -> bool:
    return type(t) is not torch.Tensor and "transformer_engine" in type(t).__module__ and hasattr(t, "dequantize")


def torch_to_te_state_dict(state: Mapping[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """A torch-backend state dict as the TE backend expects it.

    Parameter names and shapes are shared; each TE module gets an empty ``_extra_state`` (uint8 [0]),
    which TE reads as "no FP8 metadata yet".
    Raises: DifflmError when ``state`` already holds ``_extra_state`` entries (it is a TE state dict).
    """
    if any(k.endswith(EXTRA_STATE) for k in state):
        raise DifflmError("torch_to_te_state_dict got a state dict with _extra_state entries: it already has the "
                          "TE layout (model.backend=te); load it directly")
    out = dict(state)
    for name in te_module_names(cfg):
        out[f"{name}.{EXTRA_STATE}"] = torch.empty(0, dtype=torch.uint8)
    return out


def te_to_torch_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A TE-backend state dict for the torch backend: drops ``_extra_state`` (FP8 scaling history, which
    the torch backend has no use for) and dequantizes FP8 weights (``precision.fp8_weights``) to FP32."""
    out = {}
    for k, v in state.items():
        if k == EXTRA_STATE or k.endswith("." + EXTRA_STATE):
            continue
        out[k] = v.dequantize(dtype=torch.float32) if _is_te_quantized(v) else v
    return out


# ------------------------------------------------------------------ rotary embedding for TE's fused kernel
def rope_freqs(seq_len: int, head_dim: int, base: float, device) -> torch.Tensor:
    """Rotation angles [seq_len, 1, 1, head_dim] float32 in TE's ``apply_rotary_pos_emb`` layout.

    Same angles as :func:`difflm.model.rope.rope_cos_sin` (RoFormer eq. 15, rotate-half layout:
    the two halves repeat the D/2 frequencies), so both backends rotate identically.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


def freqs_on_cp_rank(freqs: torch.Tensor, local_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Angles of the positions a context-parallel rank holds, [local_len, 1, 1, D].

    TE's load-balanced CP split (``DotProductAttention``, "dual chunk swap") cuts the sequence into
    2 * cp_size chunks and gives rank r chunks r and 2 cp_size - 1 - r (as TE's
    ``_get_freqs_on_this_cp_rank``).
    """
    if cp_size == 1:
        return freqs[:local_len]
    chunk = local_len // 2
    full = cp_size * local_len
    return torch.cat([freqs[cp_rank * chunk:(cp_rank + 1) * chunk],
                      freqs[full - (cp_rank + 1) * chunk:full - cp_rank * chunk]])


def _group_size(group) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


# ------------------------------------------------------------------ modules
class TEAttention(nn.Module):
    """Fused RMSNorm+QKV (``te.LayerNormLinear``), QK-norm, TE fused RoPE, attention, ``te.Linear`` output.

    The fused QKV rows are grouped per KV head (see :mod:`difflm.model.transformer`), so a column-parallel
    split over ``tp`` ranks hands every rank whole groups. Shapes: x [B, S, d] (or [S, B, d] with sequence
    parallelism) -> same.
    """

    def __init__(self, cfg, causal: bool, *, device, layer_number: int, layout: str, tp_group=None,
                 sequence_parallel: bool = False, cp_group=None, cp_global_ranks=None, cp_stream=None,
                 cp_comm_type: str = "p2p"):
        super().__init__()
        te = import_te()
        h, h_kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        tp = _group_size(tp_group)
        if h_kv % tp:
            raise DifflmError(f"model.num_kv_heads={h_kv} is not divisible by the tensor-parallel size {tp}: "
                              "pick parallel.tp dividing the KV heads")
        self.local_heads, self.local_kv_heads, self.head_dim = h // tp, h_kv // tp, hd
        self.layout, self.causal = layout, causal
        self.attention_backend = getattr(cfg, "attention_backend", "sdpa")
        self.cp_size, self.cp_rank = 1, 0
        if cp_group is not None:
            import torch.distributed as dist

            self.cp_size, self.cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
            if self.cp_size > 1 and self.attention_backend != "te":
                raise DifflmError("context parallelism runs inside te.DotProductAttention: "
                                  "set model.attention_backend=te")
        tp_args = dict(tp_group=tp_group, tp_size=tp, sequence_parallel=sequence_parallel)
        self.qkv = te.LayerNormLinear(cfg.hidden_size, (h + 2 * h_kv) * hd, eps=cfg.norm_eps,
                                      bias=bool(getattr(cfg, "qkv_bias", False)),
                                      normalization="RMSNorm", parallel_mode="column" if tp_group is not None else None,
                                      device=device, **tp_args)
        self.q_norm = te.RMSNorm(hd, eps=cfg.norm_eps, device=device) if cfg.qk_norm else None
        self.k_norm = te.RMSNorm(hd, eps=cfg.norm_eps, device=device) if cfg.qk_norm else None
        cp_args = {}
        if cp_group is not None:
            cp_args = dict(cp_group=cp_group, cp_global_ranks=cp_global_ranks, cp_comm_type=cp_comm_type,
                           cp_stream=cp_stream if cp_stream is not None else torch.cuda.Stream())
        self.core = te.DotProductAttention(num_attention_heads=h, kv_channels=hd, num_gqa_groups=h_kv,
                                           qkv_format=layout, attn_mask_type="causal" if causal else "no_mask",
                                           layer_number=layer_number, **tp_args, **cp_args)
        self.proj = te.Linear(h * hd, cfg.hidden_size, bias=False, parallel_mode="row" if tp_group is not None else None,
                              device=device, **tp_args)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

        qkv = self.qkv(x)
        lead = qkv.shape[:2]  # with sequence parallelism the QKV GEMM has all-gathered the sequence
        group = self.local_heads // self.local_kv_heads
        qkv = qkv.view(*lead, self.local_kv_heads, group + 2, self.head_dim)
        q, k, v = qkv.split([group, 1, 1], dim=3)
        q = q.reshape(*lead, self.local_heads, self.head_dim)
        k = k.reshape(*lead, self.local_kv_heads, self.head_dim)
        v = v.reshape(*lead, self.local_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary_pos_emb(q, freqs, tensor_format=self.layout, fused=True)
        k = apply_rotary_pos_emb(k, freqs, tensor_format=self.layout, fused=True)
        if self.attention_backend == "te":
            # dense tensors: TE infers the layout from strides (v is a strided view of the fused QKV)
            q, k, v = (t if t.is_contiguous() else t.contiguous() for t in (q, k, v))
            out = self.core(q, k, v)  # [B, S, h hd] (bshd) or [S, B, h hd] (sbhd)
        else:
            if self.layout == "sbhd":
                q, k, v = (t.transpose(0, 1) for t in (q, k, v))
            out = attend(q, k, v, causal=self.causal, backend=self.attention_backend, layout="bshd")
            if self.layout == "sbhd":
                out = out.transpose(0, 1)
            out = out.reshape(*lead, -1)
        return self.proj(out)


class TEBlock(nn.Module):
    """Pre-norm block ``x + attn(norm(x))``, ``x + mlp(norm(x))``; the norms live inside the TE modules."""

    def __init__(self, cfg, causal: bool, *, device, layer_number: int, layout: str, tp_group=None,
                 sequence_parallel: bool = False, **cp_args):
        super().__init__()
        te = import_te()
        tp = _group_size(tp_group)
        self.attention = TEAttention(cfg, causal, device=device, layer_number=layer_number, layout=layout,
                                     tp_group=tp_group, sequence_parallel=sequence_parallel, **cp_args)
        self.mlp = te.LayerNormMLP(cfg.hidden_size, cfg.ffn_hidden_size, eps=cfg.norm_eps, bias=False,
                                   normalization="RMSNorm", activation="swiglu", tp_group=tp_group, tp_size=tp,
                                   set_parallel_mode=tp_group is not None, sequence_parallel=sequence_parallel,
                                   device=device)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x, freqs)
        return x + self.mlp(x)


class TETransformer(nn.Module):
    """The Transformer of :mod:`difflm.model.transformer` on Transformer Engine modules.

    Args:
        cfg: ``model`` config with ``vocab_size`` and ``head_dim`` resolved.
        causal: AR attention (True) or bidirectional diffusion attention (False).
        device: where parameters are created (``"meta"`` for deferred materialisation, or a CUDA device).
        bf16_layers: block indices run with FP8 switched off inside an FP8 region
            (``precision.fp8_skip_first_last`` gives {0, L-1}).
        fp8_weights_recipe: a TE recipe to build the other blocks' weights in FP8 (``precision.fp8_weights``),
            or None for FP32 weights.
        tp_group, sequence_parallel, cp_group, cp_global_ranks, cp_stream, cp_comm_type: passed to the TE
            modules (None / False: a single GPU).
    Forward: ``input_ids`` [B, S] int64 (the local shard under CP), optional ``logits_mask`` [B, S] bool ->
        logits [B, S, V] or [N, V] at the masked positions, as :meth:`Transformer.forward` (with
        ``model.qkv_bias`` and ``model.shift_logits``; explicit attention masks, position ids and KV caches
        are torch-backend only).
    Raises: DifflmError when Transformer Engine cannot be imported, the heads do not split over TP, or
        forward gets ``attn_mask`` / ``position_ids`` / ``kv_cache``.
    """

    head_weight = Transformer.head_weight

    def num_params(self, exclude_embedding: bool = True) -> int:
        """Parameter count of the whole model (TP shards counted at their full size, so MFU under TP is that of
        the full model); with ``exclude_embedding`` the input embedding is left out (PaLM's N for MFU)."""
        shards = self.tp_shards()
        n = sum(shards.full_shape(name, p.shape).numel() for name, p in self.named_parameters())
        if exclude_embedding and self.output is not None:
            n -= self.embedding.weight.numel()
        return n

    def init_weights(self, seed: int) -> None:
        """The torch backend's keyed init (both backends hold identical weights); under TP every rank draws the
        full tensors and keeps its shards (:class:`difflm.parallel.te_tensor_parallel.TensorParallelShards`)."""
        megatron_init_(self, self.cfg, seed, shards=self.tp_shards())

    def tp_shards(self) -> TensorParallelShards:
        """This rank's tensor-parallel place (rank 0 of 1 without TP)."""
        if self.tp_group is None:
            return TensorParallelShards(0, 1)
        import torch.distributed as dist

        return TensorParallelShards(dist.get_rank(self.tp_group), dist.get_world_size(self.tp_group), self.tp_group)

    def __init__(self, cfg, causal: bool = False, *, device="cuda", bf16_layers: Iterable[int] = (),
                 fp8_weights_recipe=None, tp_group=None, sequence_parallel: bool = False, cp_group=None,
                 cp_global_ranks=None, cp_stream=None, cp_comm_type: str = "p2p"):
        super().__init__()
        te = import_te()
        self.cfg, self.causal = cfg, causal
        self.bf16_layers = frozenset(int(i) for i in bf16_layers)
        self.tp_group = tp_group if _group_size(tp_group) > 1 else None
        self.sequence_parallel = bool(sequence_parallel) and self.tp_group is not None
        self.layout = "sbhd" if self.sequence_parallel else "bshd"
        self.cp_size, self.cp_rank = 1, 0
        if cp_group is not None:
            import torch.distributed as dist

            self.cp_size, self.cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device)
        blocks = []
        for i in range(cfg.num_layers):
            quantized = fp8_weights_recipe is not None and i not in self.bf16_layers
            with quantized_model_init(True, fp8_weights_recipe) if quantized else contextlib.nullcontext():
                blocks.append(TEBlock(cfg, causal, device=device, layer_number=i + 1, layout=self.layout,
                                      tp_group=tp_group, sequence_parallel=sequence_parallel, cp_group=cp_group,
                                      cp_global_ranks=cp_global_ranks, cp_stream=cp_stream,
                                      cp_comm_type=cp_comm_type))
        self.layers = nn.ModuleList(blocks)
        self.final_norm = te.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps, device=device,
                                     sequence_parallel=self.sequence_parallel or None)
        self.output = (None if cfg.tie_embeddings
                       else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device))

    def forward(self, input_ids: torch.Tensor, logits_mask: Optional[torch.Tensor] = None, attn_mask=None,
                position_ids: Optional[torch.Tensor] = None, kv_cache=None) -> torch.Tensor:
        if attn_mask is not None or position_ids is not None or kv_cache is not None:
            raise DifflmError("model.backend=te runs the full-sequence forward only (no attn_mask, position_ids or "
                              "kv_cache: bd3lm, packed sft, cached sampling): use model.backend=torch for those")
        b, s = input_ids.shape
        if fp8_is_active() and (b * s) % FP8_ROWS_MULTIPLE:
            # FP8 GEMMs need whole tiles of tokens: odd-sized inputs (random-length steps, sampling) run in BF16.
            with te_autocast(False):
                return self._forward(input_ids, logits_mask, fp8=False)
        return self._forward(input_ids, logits_mask, fp8=fp8_is_active())

    def _forward(self, input_ids, logits_mask, fp8: bool) -> torch.Tensor:
        s = input_ids.shape[1]
        x = self.embedding(input_ids)
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):  # residual stream in the compute dtype (Megatron-LM default)
            x = x.to(torch.get_autocast_dtype(device_type))
        if self.sequence_parallel:  # TE's SP modules take and return this rank's chunk of the sequence
            x = scatter_sequence(x.transpose(0, 1), self.tp_group)
        freqs = rope_freqs(s * self.cp_size, self.cfg.head_dim, self.cfg.rope_base, x.device)
        freqs = freqs_on_cp_rank(freqs, s, self.cp_size, self.cp_rank)
        for i, layer in enumerate(self.layers):
            if fp8 and i in self.bf16_layers:
                with te_autocast(False):
                    x = layer(x, freqs)
            else:
                x = layer(x, freqs)
        x = self.final_norm(x)
        if self.sequence_parallel:
            x = gather_sequence(x, self.tp_group).transpose(0, 1)
        if getattr(self.cfg, "shift_logits", False):  # Dream: position i predicts token i from state i - 1
            x = torch.cat([x[:, :1], x[:, :-1]], dim=1)
        if logits_mask is not None:
            x = x[logits_mask]
        return F.linear(x, self.head_weight())



def fp8_layer_options(cfg_model, precision) -> dict:
    """``bf16_layers`` and ``fp8_weights_recipe`` for :class:`TETransformer` from the ``precision`` config."""
    if precision is None or isinstance(precision, str) or precision_name(precision) != "fp8":
        return {"bf16_layers": (), "fp8_weights_recipe": None}
    last = cfg_model.num_layers - 1
    skip = (0, last) if getattr(precision, "fp8_skip_first_last", False) else ()
    recipe = build_fp8_recipe(precision) if getattr(precision, "fp8_weights", False) else None
    return {"bf16_layers": skip, "fp8_weights_recipe": recipe}


def build_te_model(cfg, *, causal: bool, device: torch.device, seed: Optional[int], precision=None,
                   **parallel) -> TETransformer:
    """A :class:`TETransformer` on ``device`` with the torch backend's initial weights for ``seed``.

    Built on the meta device and materialised with ``to_empty`` (as the torch backend), except with FP8
    weights, which TE creates on the GPU directly. ``parallel`` holds the TE process-group arguments.
    ``seed=None`` skips the initialisation (see :func:`difflm.model.build_model`).
    Raises: DifflmError without Transformer Engine or on a non-CUDA device.
    """
    import_te()
    device = torch.device(device)
    if device.type != "cuda":
        raise DifflmError(f"model.backend=te runs Transformer Engine's CUDA kernels and the device is {device}: "
                          "use device=cuda on an NVIDIA GPU, or model.backend=torch")
    options = fp8_layer_options(cfg, precision)
    if options["fp8_weights_recipe"] is not None:
        model = TETransformer(cfg, causal, device=device, **options, **parallel)
    else:
        model = TETransformer(cfg, causal, device="meta", **options, **parallel)
        model.to_empty(device=device)
    if seed is not None:
        model.init_weights(seed)
    return model


__all__ = [
    "TEAttention", "TEBlock", "TETransformer", "build_te_model", "fp8_layer_options", "freqs_on_cp_rank",
    "rope_freqs", "te_module_names", "te_to_torch_state_dict", "torch_to_te_state_dict",
]
