"""Transformer Engine kernels (``model.backend=te``): the slots of the one transformer filled with TE modules, so its
matrix products can run in FP8 and its norms/activations fused. Not a second network: the network is
:mod:`difflm.model.transformer`; this module only says which module sits in each slot.

Module for module (parameter names and shapes are those of the torch kernels, see :mod:`difflm.model.layers`)::

    layers.{i}.attention.qkv      te.LayerNormLinear(normalization="RMSNorm")  layer_norm_weight [d], weight [(h+2h_kv) hd, d]
                                  (model.fused_mlp: difflm.kernels.quack_norm_linear.ResidualNormLinear, same parameters)
    layers.{i}.attention.q_norm   te.RMSNorm(hd)                               weight [hd]   (model.qk_norm)
    layers.{i}.attention.k_norm   te.RMSNorm(hd)                               weight [hd]   (model.qk_norm)
    layers.{i}.attention.core     te.DotProductAttention                       no parameters (runs for attention_backend=te)
    layers.{i}.attention.proj     te.Linear                                    weight [d, h hd]
    layers.{i}.mlp                te.LayerNormMLP(activation="swiglu")         layer_norm_weight, fc1_weight [2f, d], fc2_weight [d, f]
                                  (model.fused_mlp: difflm.kernels.quack_mlp.ResidualNormMLP, same parameters, on quack's GEMMs)
    final_norm                    te.RMSNorm(d)                                weight [d]
    embedding, output             torch nn.Embedding (its gradient into main_grad: difflm.kernels.embedding) /
                                  nn.Linear (kept in BF16 under FP8, as Megatron-LM's LM head);
                                  under TP ``output`` is vocab-parallel (difflm.parallel.vocab_parallel)

Every TE module also carries an ``_extra_state`` entry in the state dict (its FP8 scaling metadata: an empty uint8
tensor until FP8 has run, then a serialized ``DelayedScaling`` amax history). That is the only difference between
the two layouts; :func:`torch_to_te_state_dict` and :func:`te_to_torch_state_dict` convert, and
``tests/fixtures/te_tiny_state_dict.json`` records the names and shapes a real TE model has.

Tensor/sequence/context parallelism use TE's own arguments (``tp_group``, ``parallel_mode``, ``sequence_parallel``,
``cp_group``): as the design notes say, the TE kernels are the one place that takes process groups in a
constructor, because TE's TP/CP live inside its modules. With ``sequence_parallel`` the residual stream is kept
sequence-first (``sbhd``, TE splits dim 0): :meth:`TEKernels.enter` scatters it, :meth:`TEKernels.exit` gathers it
for the vocab-parallel LM head.
Transformer Engine is imported only when a kernel set is built.
"""
from __future__ import annotations

import contextlib
from typing import Mapping, Optional

import torch

from difflm.errors import DifflmError
from difflm.kernels.main_grad import (  # noqa: F401  (the TE kernel set's helpers, imported from here too)
    MAIN_GRAD_NAMES,
    accumulate_into_grad,
    attach_main_grads,
    main_grad_weights,
    weights_cast_once_per_step,
    weights_changed_since_cast,
)
from difflm.model.kernels import TorchKernels
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


def fp8_fits(num_tokens: int) -> bool:
    """Whether a forward of ``num_tokens`` tokens (micro-batch x sequence, this rank's) runs its GEMMs in FP8: TE's
    FP8 GEMMs need whole tiles of rows, so other counts (random-length steps, sampling) run in BF16 inside an FP8
    region (:meth:`TEKernels.forward_context`)."""
    return num_tokens % FP8_ROWS_MULTIPLE == 0


# ------------------------------------------------------------------ state-dict layout
def te_module_names(cfg) -> list[str]:
    """Paths of the TE modules of a ``model`` config, i.e. the state-dict prefixes with an ``_extra_state``
    (a mixture-of-experts MLP is the same torch module under both kernel sets: no TE module there; the dense
    blocks before it, ``model.moe.first_k_dense``, have TE's)."""
    from difflm.model.moe import is_moe_layer

    names = []
    for i in range(cfg.num_layers):
        mlp = [] if is_moe_layer(cfg, i) else ["mlp"]
        p = f"layers.{i}.attention."
        names.append(p + "qkv")
        if cfg.qk_norm:
            names += [p + "q_norm", p + "k_norm"]
        names += [p + "core", p + "proj"] + [f"layers.{i}.{m}" for m in mlp]
    names.append("final_norm")
    return names


def _is_te_quantized(t) -> bool:
    return type(t) is not torch.Tensor and "transformer_engine" in type(t).__module__ and hasattr(t, "dequantize")


def torch_to_te_state_dict(state: Mapping[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """A torch-kernel state dict as the TE kernels expect it.

    Parameter names and shapes are shared; each TE module gets an empty ``_extra_state`` (uint8 [0]), which TE
    reads as "no FP8 metadata yet".
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
    """A TE-kernel state dict for the torch kernels: drops ``_extra_state`` (FP8 scaling history, which the torch
    kernels have no use for) and dequantizes FP8 weights (``precision.fp8_weights``) to FP32."""
    out = {}
    for k, v in state.items():
        if k == EXTRA_STATE or k.endswith("." + EXTRA_STATE):
            continue
        out[k] = v.dequantize(dtype=torch.float32) if _is_te_quantized(v) else v
    return out


def _group_size(group) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


def fp8_layer_options(cfg_model, precision) -> dict:
    """``bf16_layers`` (``precision.fp8_skip_first_last``: {0, L-1}) and ``fp8_weights_recipe``
    (``precision.fp8_weights``) from the ``precision`` config."""
    if precision is None or isinstance(precision, str) or precision_name(precision) != "fp8":
        return {"bf16_layers": (), "fp8_weights_recipe": None}
    last = cfg_model.num_layers - 1
    skip = (0, last) if getattr(precision, "fp8_skip_first_last", False) else ()
    recipe = build_fp8_recipe(precision) if getattr(precision, "fp8_weights", False) else None
    return {"bf16_layers": skip, "fp8_weights_recipe": recipe}


# ------------------------------------------------------------------ the kernel set
class TEKernels(TorchKernels):
    """``model.backend=te``: Transformer Engine modules in every slot (see the module docstring).

    Args:
        cfg: the ``model`` config.
        device: where parameters are created (``"meta"`` to materialise later, or a CUDA device).
        precision: the ``precision`` config: ``fp8_skip_first_last`` runs blocks 0 and L-1 in BF16 inside an FP8
            region, ``fp8_weights`` builds the other blocks' weights in FP8 (``te.quantized_model_init``).
        tp_group, sequence_parallel, cp_group, cp_global_ranks, cp_stream, cp_comm_type: passed to the TE modules
            (None / False: one GPU).
        ub_tokens: with sequence-parallel TP, overlap its all-gathers / reduce-scatters with the GEMMs through TE's
            userbuffers (``parallel.tp_comm_overlap``): the token count of one micro-batch (seq_len x micro batch
            / cp), the size of the communication buffers (:func:`initialize_userbuffers`). None: no overlap.
        fuse_wgrad_accumulation: the weight-gradient GEMMs of the linear layers accumulate straight into FP32
            gradients (TE's ``fuse_wgrad_accumulation``, Megatron-LM's ``main_grad``), instead of writing a BF16
            gradient per micro-batch that autograd casts and adds to ``.grad``: :func:`accumulate_into_grad`. On
            when this and ``model.fuse_wgrad_accumulation`` are; the layouts that reduce gradients through FSDP2 or
            split the backward into pipeline stages pass False (their hooks and schedules read what autograd hands
            back), and FP8 weights (``precision.fp8_weights``) leave it off.
    Raises: DifflmError when Transformer Engine cannot be imported, when context parallelism is asked of an
        attention backend other than ``te`` (TE's ring attention lives in ``te.DotProductAttention``), or when
        ``ub_tokens`` is given without sequence-parallel TP.
    """

    name = "te"

    def __init__(self, cfg, device="meta", precision=None, *, tp_group=None, sequence_parallel: bool = False,
                 cp_group=None, cp_global_ranks=None, cp_stream=None, cp_comm_type: str = "p2p",
                 ub_tokens: Optional[int] = None, fuse_wgrad_accumulation: bool = True):
        super().__init__(cfg, device)
        self.te = import_te()
        options = fp8_layer_options(cfg, precision)
        self.bf16_layers = frozenset(int(i) for i in options["bf16_layers"])
        self.fp8_weights_recipe = options["fp8_weights_recipe"]
        self.fuse_wgrad = (bool(fuse_wgrad_accumulation) and bool(getattr(cfg, "fuse_wgrad_accumulation", True))
                           and self.fp8_weights_recipe is None)
        self.tp_group = tp_group if _group_size(tp_group) > 1 else None
        self.tp_size = _group_size(self.tp_group)
        self.sequence_parallel = bool(sequence_parallel) and self.tp_group is not None
        self.layout = "sbhd" if self.sequence_parallel else "bshd"
        self.cp_group, self.cp_args = cp_group, {}
        if _group_size(cp_group) > 1:
            if getattr(cfg, "attention_backend", "sdpa") != "te":
                raise DifflmError("context parallelism with model.backend=te runs inside te.DotProductAttention: "
                                  "set model.attention_backend=te")
            self.cp_args = dict(cp_group=cp_group, cp_global_ranks=cp_global_ranks, cp_comm_type=cp_comm_type,
                                cp_stream=cp_stream if cp_stream is not None else torch.cuda.Stream())
        self.ub = {}  # userbuffers arguments per slot (TE TransformerLayer's defaults under ub_tp_comm_overlap)
        if ub_tokens is not None:
            if not self.sequence_parallel:
                raise DifflmError("parallel.tp_comm_overlap=true overlaps the communication of sequence-parallel TP: "
                                  "set parallel.sequence_parallel=true with parallel.tp > 1")
            initialize_userbuffers(ub_tokens, cfg.hidden_size, self.tp_size, fp8=precision_name(precision) == "fp8")
            self.ub = {
                "qkv": dict(ub_overlap_ag=True, ub_overlap_rs_dgrad=False, ub_bulk_dgrad=True, ub_bulk_wgrad=True,
                            ub_name="qkv"),
                "proj": dict(ub_overlap_rs=True, ub_overlap_ag=True, ub_name="proj"),
                "mlp": dict(ub_overlap_ag=True, ub_overlap_rs=True, ub_overlap_rs_dgrad=False, ub_bulk_dgrad=True,
                            ub_bulk_wgrad=True),
            }

    def _tp(self, mode: Optional[str]) -> dict:
        args = dict(tp_group=self.tp_group, tp_size=self.tp_size, sequence_parallel=self.sequence_parallel)
        return dict(args, parallel_mode=mode if self.tp_group is not None else None)

    def accumulate_weight_grads(self, module, *names):
        """``module`` with the gradients of its weights ``names`` accumulated in FP32 in place (see
        ``fuse_wgrad_accumulation``): this set's own modules, and the MoE experts (whose grouped GEMMs then add into
        ``main_grad``: :mod:`difflm.model.grouped_experts`)."""
        if self.fuse_wgrad:
            accumulate_into_grad(module, names)
        return module


    # ------------------------------------------------------------------ slots
    def norm_linear(self, in_features, out_features, *, eps, bias=False):
        if getattr(self.cfg, "fused_mlp", False) and not bias:  # the attention half's input on quack's kernels
            from difflm.kernels.quack_norm_linear import ResidualNormLinear

            module = ResidualNormLinear(in_features, out_features, eps,
                                        autotune=getattr(self.cfg, "fused_mlp_autotune", False), device=self.device)
            return self.accumulate_weight_grads(module, "weight")
        return self.accumulate_weight_grads(self.te.LayerNormLinear(
            in_features, out_features, eps=eps, bias=bias, normalization="RMSNorm", device=self.device,
            fuse_wgrad_accumulation=self.fuse_wgrad, **self._tp("column"), **self.ub.get("qkv", {})), "weight")

    def linear(self, in_features, out_features):
        return self.accumulate_weight_grads(self.te.Linear(
            in_features, out_features, bias=False, device=self.device, fuse_wgrad_accumulation=self.fuse_wgrad,
            **self._tp("row"), **self.ub.get("proj", {})), "weight")

    def norm_mlp(self, hidden, ffn, *, eps):
        if getattr(self.cfg, "fused_mlp", False):  # checked by difflm.config.validate.check_fused_mlp
            from difflm.kernels.quack_mlp import ResidualNormMLP

            mlp = ResidualNormMLP(hidden, ffn, eps, autotune=getattr(self.cfg, "fused_mlp_autotune", False),
                                  device=self.device)
            return self.accumulate_weight_grads(mlp, "fc1_weight", "fc2_weight")
        return self.accumulate_weight_grads(self.te.LayerNormMLP(
            hidden, ffn, eps=eps, bias=False, normalization="RMSNorm", activation="swiglu", tp_group=self.tp_group,
            tp_size=self.tp_size, set_parallel_mode=self.tp_group is not None, sequence_parallel=self.sequence_parallel,
            device=self.device, fuse_wgrad_accumulation=self.fuse_wgrad, **self.ub.get("mlp", {})),
            "fc1_weight", "fc2_weight")

    def norm(self, dim, *, eps, residual=False):
        return self.te.RMSNorm(dim, eps=eps, device=self.device,
                               sequence_parallel=(self.sequence_parallel or None) if residual else None)

    def embedding(self, vocab, hidden):
        """The token embedding; with ``fuse_wgrad_accumulation`` on one TP rank its gradient too accumulates in
        ``main_grad`` (:class:`difflm.kernels.embedding.Embedding`)."""
        if not self.fuse_wgrad or self.tp_group is not None:
            return super().embedding(vocab, hidden)
        from difflm.kernels.embedding import Embedding

        return self.accumulate_weight_grads(Embedding(vocab, hidden, device=self.device), "weight")

    def lm_head(self, hidden, vocab):
        """A plain torch head (kept in BF16 under FP8, as Megatron-LM's); under TP this rank's rows of a vocab-parallel
        head (:class:`difflm.parallel.vocab_parallel.VocabParallelLinear`)."""
        if self.tp_group is None:
            return super().lm_head(hidden, vocab)
        from difflm.parallel.vocab_parallel import VocabParallelLinear

        return VocabParallelLinear.local(hidden, vocab, self.tp_group, self.device)

    def attention_core(self, cfg, causal, layer_number):
        """A ``te.DotProductAttention`` per layer, whatever ``model.attention_backend`` (its ``_extra_state`` is part
        of the TE checkpoint layout); :func:`difflm.model.attention.attend` runs it for ``attention_backend=te``."""
        tp = dict(tp_group=self.tp_group, tp_size=self.tp_size, sequence_parallel=self.sequence_parallel)
        return self.te.DotProductAttention(num_attention_heads=cfg.num_heads, kv_channels=cfg.head_dim,
                                           num_gqa_groups=cfg.num_kv_heads, qkv_format=self.layout,
                                           attn_mask_type="causal" if causal else "no_mask",
                                           layer_number=layer_number, **tp, **self.cp_args)

    def block_init_context(self, index):
        if self.fp8_weights_recipe is None or index in self.bf16_layers:
            return contextlib.nullcontext()
        return quantized_model_init(True, self.fp8_weights_recipe)

    # ------------------------------------------------------------------ residual stream
    def enter(self, x):
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):  # residual stream in the compute dtype (Megatron-LM default)
            x = x.to(torch.get_autocast_dtype(device_type))
        if self.sequence_parallel:  # TE's SP modules take and return this rank's chunk of the sequence
            from difflm.parallel.te_tensor_parallel import scatter_sequence

            x = scatter_sequence(x.transpose(0, 1), self.tp_group)
        return x

    def exit(self, x):
        """[S(/tp), B, d] or [B, S, d] -> the full [B, S, d] for the vocab-parallel head, whose gradient to it is a
        partial sum per TP rank: gathered with a reduce-scatter backward (SP), else an all-reduce backward."""
        if self.sequence_parallel:
            from difflm.parallel.te_tensor_parallel import gather_sequence

            x = gather_sequence(x, self.tp_group).transpose(0, 1)
        elif self.tp_group is not None:
            from difflm.parallel.vocab_parallel import copy_to_group

            x = copy_to_group(x, self.tp_group)
        return x

    def layer_context(self, index):
        if index in self.bf16_layers and fp8_is_active():
            return te_autocast(False)
        return contextlib.nullcontext()

    def forward_context(self, num_tokens):
        # FP8 GEMMs need whole tiles of tokens: odd-sized inputs (random-length steps, sampling) run in BF16.
        if not fp8_fits(num_tokens) and fp8_is_active():
            return te_autocast(False)
        return contextlib.nullcontext()

    def tp_shards(self):
        if self.tp_group is None:
            return None
        import torch.distributed as dist

        from difflm.parallel.te_tensor_parallel import TensorParallelShards

        return TensorParallelShards(dist.get_rank(self.tp_group), self.tp_size, self.tp_group)


_UB_SHAPE: Optional[tuple] = None  # (tokens, hidden, tp, fp8) of this process's userbuffers


def initialize_userbuffers(tokens: int, hidden: int, tp: int, fp8: bool) -> None:
    """TE's userbuffers for comm/GEMM overlap of sequence-parallel TP (``initialize_ub``, once per process, before
    the TE modules are built; Megatron-LM's ``_initialize_tp_communicators``): buffers of [tokens, hidden] in BF16,
    plus FP8 ones for ``fp8`` runs (blocks that run in BF16 inside an FP8 run use the BF16 ones). Bootstrapped over
    NCCL on the TP ranks, which are consecutive global ranks in difflm's mesh, as ``initialize_ub`` assumes.
    NVLink multicast stays off: ``UB_SKIPMC=1`` (CUDA IPC instead) unless set.

    Raises: DifflmError when they already exist with another shape, or when TE cannot create them (one line).
    """
    global _UB_SHAPE
    import os

    shape = (int(tokens), int(hidden), int(tp), bool(fp8))
    if _UB_SHAPE is not None:
        if _UB_SHAPE != shape:
            raise DifflmError(f"TE userbuffers exist for (tokens, hidden, tp, fp8)={_UB_SHAPE} and this model asks "
                              f"for {shape}: one process holds one set (parallel.tp_comm_overlap)")
        return
    os.environ.setdefault("UB_SKIPMC", "1")
    from transformer_engine.pytorch.module import base

    modes = [base.UserBufferQuantizationMode.NONE]
    if fp8:
        modes.insert(0, base.UserBufferQuantizationMode.FP8)
    try:
        base.initialize_ub([shape[0], shape[1]], tp, quantization_modes=modes, dtype=torch.bfloat16,
                           bootstrap_backend="nccl")
    except (RuntimeError, ValueError, AssertionError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DifflmError(f"parallel.tp_comm_overlap=true: Transformer Engine could not create its userbuffers "
                          f"({first}); set parallel.tp_comm_overlap=false") from err
    _UB_SHAPE = shape


def check_te_device(device: torch.device) -> None:
    """Raises: DifflmError unless ``device`` is CUDA (TE's kernels are CUDA-only)."""
    if torch.device(device).type != "cuda":
        raise DifflmError(f"model.backend=te runs Transformer Engine's CUDA kernels and the device is {device}: "
                          "use device=cuda on an NVIDIA GPU, or model.backend=torch")


__all__ = ["EXTRA_STATE", "FP8_ROWS_MULTIPLE", "TEKernels", "accumulate_into_grad", "check_te_device", "fp8_fits",
           "fp8_layer_options", "initialize_userbuffers", "te_module_names", "te_to_torch_state_dict",
           "torch_to_te_state_dict"]
