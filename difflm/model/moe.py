"""Mixture-of-experts MLP (``model.moe.num_experts > 0``): a token-choice top-k router, SwiGLU experts run as
one grouped GEMM, optional shared experts, load balancing, and the statistics users watch. docs/moe.md has
every formula with its source.

The block's MLP slot holds :class:`MoEMLP` instead of the dense SwiGLU ``LayerNormMLP``; like it, the
pre-norm lives inside the slot. Parameter and buffer names (``E`` experts, ``f`` expert width, ``f_s`` =
``model.moe.shared_ffn_hidden_size`` or ``num_shared_experts * f``; close to Megatron-LM's
``experts.linear_fc1``/``linear_fc2`` and torchtitan's
``GroupedExperts``, in TE's ``fc1``/``fc2`` spelling)::

    mlp.layer_norm_weight     [d]          RMSNorm scale (as the dense MLP's)
    mlp.router.weight         [E, d]       router logits = RMSNorm(x) @ weight^T (FP32)
    mlp.router.bias           [E]          buffer, persistent: DeepSeek-V3's aux-loss-free routing bias
    mlp.experts.fc1_weight    [E, 2f, d]   per expert [gate; up] rows (SiLU on the gate half), TE's swiglu split
    mlp.experts.fc2_weight    [E, d, f]
    mlp.shared.fc1_weight     [2 f_s, d]   (num_shared_experts > 0)
    mlp.shared.fc2_weight     [d, f_s]

Experts run as one grouped GEMM over the expert-sorted tokens: ``torch._grouped_mm`` on CUDA (BF16, sm90+) under
either kernel set and every precision (under ``precision=fp8`` the experts stay BF16 unless
``model.moe.fp8_experts``; with FP32 ``main_grad`` accumulation the BF16 / FP8 kernels of
:mod:`difflm.model.grouped_experts`), and a loop over experts elsewhere (CPU, the reference for tests).
Transformer Engine's ``te.GroupedLinear`` is not used: fed the stacked
expert weights, its FP8 backward returned zero weight gradients on an H200 (TE 2.20.2, tests/test_moe.py's CUDA
test), and its per-expert splits are a host list (one sync per layer). All three hold the same two stacked parameters.

Expert parallelism swaps :attr:`MoEMLP.dispatcher` for an all-to-all dispatcher
(:mod:`difflm.parallel.expert_parallel`); the module itself never knows its layout.

Auxiliary losses are not returned with the logits: :class:`AttachAuxLoss` passes the MoE output through and, in
backward, adds d(scale * aux)/d(params) (Megatron-LM's ``MoEAuxLossAutoScaler``). ``scale`` is set by the
trainer (:func:`set_moe_loss_scale`: micro-batch / global batch, so the per-micro-batch aux losses average over
the step like the CE loss, whose every rank's share is divided by the global normaliser). Layer-local
statistics live in buffers; :func:`moe_step` reduces them once per step (and moves the aux-free bias),
:func:`moe_metrics` reads them for metrics.jsonl, the console and wandb.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from difflm.kernels.main_grad import converted_once_per_step, weights_cast_once_per_step
from difflm.model.grouped_experts import (
    GroupedSwiGLUFP8,
    GroupedSwiGLUMainGrad,
    fp8_expert_weights,
    fp8_grouped_mm_supported,
    swiglu as _swiglu,
)
from difflm.model.layers import rms_norm
from difflm.model.token_permutation import SlotOrder
from difflm.training.precision import fp8_is_active

SCORE_FUNCS = ("softmax", "sigmoid")


# ------------------------------------------------------------------ config helpers
def moe_config(cfg):
    """``cfg.moe`` of a ``model`` config, or None when the model is dense (no ``moe`` or ``num_experts`` 0)."""
    moe = getattr(cfg, "moe", None) if not hasattr(cfg, "get") else cfg.get("moe", None)
    return moe if moe is not None and int(moe.num_experts or 0) > 0 else None


def expert_ffn_size(cfg) -> int:
    """Width f of one expert: ``model.moe.ffn_hidden_size``, or ``model.ffn_hidden_size`` when that is 0."""
    return int(cfg.moe.ffn_hidden_size or cfg.ffn_hidden_size)


def _key(moe, key: str, default):
    """``moe.<key>`` of a DictConfig or dataclass, ``default`` where the config predates the key."""
    return moe.get(key, default) if hasattr(moe, "get") else getattr(moe, key, default)


def shared_ffn_size(cfg) -> int:
    """Width f_s of the fused shared experts: ``model.moe.shared_ffn_hidden_size``, or
    ``num_shared_experts * f`` when that is 0 (0 when there are no shared experts)."""
    moe = cfg.moe
    if int(moe.num_shared_experts) <= 0:
        return 0
    return int(_key(moe, "shared_ffn_hidden_size", 0) or int(moe.num_shared_experts) * expert_ffn_size(cfg))


def first_k_dense(cfg) -> int:
    """Number of leading blocks that keep the dense SwiGLU MLP (``model.moe.first_k_dense``; DeepSeek-V3's and
    LLaDA 2's ``first_k_dense_replace``); 0 for a model without the key."""
    moe = moe_config(cfg)
    if moe is None:
        return 0
    return int(_key(moe, "first_k_dense", 0))


def is_moe_layer(cfg, layer: int) -> bool:
    """Whether block ``layer`` (0-based) has the mixture-of-experts MLP: an MoE model past its first
    ``model.moe.first_k_dense`` blocks."""
    return moe_config(cfg) is not None and layer >= first_k_dense(cfg)


def moe_inactive_params(cfg) -> int:
    """Parameters a token does not use: ``L_moe * (E - k) * 3 d f`` (the routed experts it is not sent to), with
    ``L_moe = L - first_k_dense`` the blocks that hold experts.

    ``num_params - moe_inactive_params`` is the active parameter count N of an MoE model, which MFU counts
    (6 N FLOPs per token, :func:`difflm.training.flops.flops_per_token`); 0 for a dense model.
    """
    moe = moe_config(cfg)
    if moe is None:
        return 0
    moe_layers_n = cfg.num_layers - first_k_dense(cfg)
    return moe_layers_n * (int(moe.num_experts) - int(moe.top_k)) * 3 * cfg.hidden_size * expert_ffn_size(cfg)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor parameter (TP-replicated, or this rank's experts under EP); ``t`` otherwise.
    ``to_local`` keeps the parameter's placements for the gradient (Replicate / Shard(0) over ep)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _count(ids: torch.Tensor, n: int) -> torch.Tensor:
    """Occurrences of 0..n-1 in ``ids`` -> [n] int64 (a fixed-size ``bincount``: no data-dependent shape)."""
    flat = ids.flatten()
    return flat.new_zeros(n).scatter_add_(0, flat, torch.ones_like(flat))


def _in_backward() -> bool:
    """True while autograd runs a backward pass (activation checkpointing recomputes forwards there)."""
    return torch._C._current_graph_task_id() != -1


# ------------------------------------------------------------------ router
@dataclass
class Routing:
    """What the router decides for T tokens.

    Attributes:
        logits: [T, E] float32 router logits (for the z-loss).
        probs: [T, E] float32 per-token distribution over experts for the balancing loss: the softmax scores,
            or the sigmoid scores normalised to sum to 1 (DeepSeek-V3 eq. 19).
        expert_ids: [T, k] int64 chosen experts (top-k of scores + bias).
        weights: [T, k] float32 gating weights (the chosen experts' scores, + their bias with ``bias_in_weights``,
            optionally renormalised and scaled).
    """

    logits: torch.Tensor
    probs: torch.Tensor
    expert_ids: torch.Tensor
    weights: torch.Tensor


def grouped_topk(choice: torch.Tensor, top_k: int, n_group: int, topk_group: int) -> torch.Tensor:
    """Node-limited (group-limited) expert choice of DeepSeek-V3 (Liu et al. 2024, sec. 2.1.2, "node-limited
    routing"; HF ``DeepseekV3TopkRouter.get_topk_indices``, as LLaDA 2's ``LLaDA2MoeGate`` uses it).

    The E experts are split into ``n_group`` contiguous groups of E / n_group; each group scores the sum of its
    2 highest ``choice`` values (its one value when a group holds one expert); the ``topk_group`` best groups are
    kept and the top-k experts are taken among their experts only (the others are masked to -inf, so a negative
    bias can never promote an expert of a dropped group).

    Args:
        choice: [T, E] float32 selection scores (scores + bias, eq. 16's ``s + b``).
        top_k: k experts per token (<= topk_group * E / n_group).
        n_group, topk_group: groups and groups kept (n_group divides E).
    Returns: [T, k] int64 expert ids, ordered by descending choice.
    """
    t, e = choice.shape
    grouped = choice.view(t, n_group, e // n_group)  # [T, G, E/G]
    group_scores = grouped.topk(min(2, e // n_group), dim=-1).values.sum(dim=-1)  # [T, G]
    keep = torch.topk(group_scores, topk_group, dim=-1).indices  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(-1, keep, True)  # [T, G]
    masked = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(t, e)
    return torch.topk(masked, top_k, dim=-1).indices


class TopKRouter(nn.Module):
    """Token-choice top-k router (Shazeer et al. 2017; Fedus et al. 2021), computed in FP32.

    ``scores = softmax(x W^T)`` (Switch/GShard/OLMoE) or ``sigmoid(x W^T)`` (DeepSeek-V3 eq. 15); the experts
    are the top-k of ``scores + bias`` (DeepSeek-V3 eq. 16: the bias only steers the choice), the gating weights
    the chosen ``scores``, divided by their sum with ``norm_topk_prob`` (DeepSeek-V3 eq. 13 for sigmoid), times
    ``routed_scaling_factor`` (DeepSeek-V3's and LLaDA 2's released configs: 2.5). With ``n_group`` > 1 the
    choice is group-limited (:func:`grouped_topk`; DeepSeek-V3 sec. 2.1.2 node-limited routing).
    ``bias_in_weights``: the gating weights are the chosen ``scores + bias`` instead (LLaDA-MoE's
    ``LLaDAMoESparseMoeBlock``: ``topk(softmax(logits) + expert_bias)`` gives both the experts and the weights);
    the bias still gets no gradient.
    Parameter ``weight`` [E, d]; buffer ``bias`` [E] float32 (zero unless ``model.moe.bias_update_rate`` > 0 or
    loaded from a checkpoint).

    Raises: ValueError for an unknown ``score_func`` or ``n_group`` that does not divide E.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, score_func: str, norm_topk_prob: bool,
                 n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
                 bias_in_weights: bool = False):
        super().__init__()
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func={score_func!r} is not one of {SCORE_FUNCS}")
        if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"n_group={n_group} must divide num_experts={num_experts} and topk_group={topk_group} "
                             f"be in [1, n_group]")
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.norm_topk_prob = score_func, norm_topk_prob
        self.n_group, self.topk_group = int(n_group), int(topk_group)
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.bias_in_weights = bool(bias_in_weights)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float32), persistent=True)

    def forward(self, x: torch.Tensor) -> Routing:
        """x [T, d] (any float dtype) -> :class:`Routing` for its T tokens."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), _local(self.weight).float())  # [T, E]
        if self.score_func == "softmax":
            scores = torch.softmax(logits, dim=-1)
            probs = scores
        else:
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        choice = scores.detach() + self.bias  # the bias never receives gradient
        if self.n_group > 1:
            expert_ids = grouped_topk(choice, self.top_k, self.n_group, self.topk_group)
        else:
            expert_ids = torch.topk(choice, self.top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(-1, expert_ids)
        if self.bias_in_weights:
            weights = weights + self.bias[expert_ids]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return Routing(logits, probs, expert_ids, weights)


# ------------------------------------------------------------------ experts
def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs the experts for input ``x``: CUDA, BF16 compute, compute capability 9+."""
    return (x.is_cuda and hasattr(torch, "_grouped_mm") and _compute_dtype(x) == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts (Shazeer 2020, eq. 6) applied to expert-sorted tokens.

    Args:
        num_experts: experts held here (all of them; :mod:`difflm.parallel.expert_parallel` shards dim 0).
        hidden, ffn: d and f.
        fp8: ``model.moe.fp8_experts``: inside an FP8 region, the FP8 grouped GEMMs below.
        fused: ``model.moe.fused_experts``: quack's grouped GEMMs with fused epilogues
            (:mod:`difflm.kernels.quack_experts`) on the ``main_grad`` path.
        autotune: ``model.fused_mlp_autotune``: with ``fused``, quack tunes the grouped GEMMs' tiles for the largest
            row count seen (:func:`difflm.kernels.quack_mlp.tuned_call`); else its default tiles.
    Parameters: ``fc1_weight`` [E, 2f, d] (rows [:f] gate, [f:] up), ``fc2_weight`` [E, d, f].
    Forward: x [R, d] with the rows of expert 0 first, then expert 1, ...; ``counts`` [E_local] int64 rows per
        (local) expert -> [R, d].
    Kernels (the same under both kernel sets), where :func:`grouped_mm_supported` (BF16 on sm90+, no host sync):
    in training forwards whose weights accumulate in FP32 ``main_grad`` (the TE kernel set on one GPU), BF16 weight
    copies cast once per step and gradients added into ``main_grad``, or with ``fp8`` in an FP8 region the FP8
    forward and input-gradient GEMMs (:mod:`difflm.model.grouped_experts`); otherwise autograd through
    ``torch._grouped_mm``. Elsewhere a loop over experts (the CPU reference).
    """

    def __init__(self, num_experts: int, hidden: int, ffn: int, fp8: bool = False, fused: bool = False,
                 autotune: bool = False):
        super().__init__()
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, 2 * ffn, hidden))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.fp8, self.fused, self.autotune = fp8, fused, autotune

    def forward(self, x: torch.Tensor, counts: torch.Tensor, is_first_microbatch=None) -> torch.Tensor:
        """``is_first_microbatch``: passed in FP8 regions by the ``main_grad`` hook (TE's contract); unused, the
        weight copies know when the weights changed (:func:`difflm.kernels.main_grad.converted_once_per_step`)."""
        w1, w2 = _local(self.fc1_weight), _local(self.fc2_weight)  # [E_local, 2f, d], [E_local, d, f]
        if grouped_mm_supported(x):
            masters = (self.fc1_weight, self.fc2_weight)
            if torch.is_grad_enabled() and all(getattr(w, "accumulates_in_main_grad", False) for w in masters):
                return self._main_grad(x, counts, masters).to(_compute_dtype(x))
            return self._grouped_mm(x, counts, w1, w2).to(_compute_dtype(x))
        return self._loop(x, counts.tolist(), w1, w2)

    def _main_grad(self, x: torch.Tensor, counts: torch.Tensor, masters) -> torch.Tensor:
        """Training forward with the weight gradients into FP32 ``main_grad`` (:mod:`difflm.model.grouped_experts`):
        FP8 when ``fp8`` is set, an FP8 region is active and the GPU has the FP8 grouped GEMM; else BF16, on quack's
        fused grouped GEMMs when ``fused`` is set."""
        if self.fp8 and fp8_is_active() and fp8_grouped_mm_supported(x):
            fp8 = converted_once_per_step(self, masters, "fp8", lambda ws: fp8_expert_weights(*ws))
            return GroupedSwiGLUFP8.apply(x.bfloat16(), counts, *masters, *fp8)
        w1b, w2b = weights_cast_once_per_step(self, masters, torch.bfloat16)
        if self.fused:  # checked by difflm.config.validate.check_moe_kernels
            from difflm.kernels.quack_experts import QuackGroupedSwiGLU, row_groups

            from difflm.kernels.quack_mlp import tuned_call

            xb = x.bfloat16()
            return QuackGroupedSwiGLU.apply(xb, row_groups(counts), *masters, w1b, w2b,
                                            tuned_call(xb, self.autotune, self))
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        return GroupedSwiGLUMainGrad.apply(x.bfloat16(), offs, *masters, w1b, w2b)

    @staticmethod
    def _grouped_mm(x, counts: torch.Tensor, w1, w2) -> torch.Tensor:
        """Both expert GEMMs as one ``torch._grouped_mm`` each over the groups ``offs = cumsum(counts)``, in BF16
        (torchtitan's ``GroupedExperts``); no host sync. Returns BF16 [R, d]."""
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        xb, w1, w2 = x.bfloat16(), w1.bfloat16(), w2.bfloat16()
        h = _swiglu(torch._grouped_mm(xb, w1.transpose(-2, -1), offs=offs))
        return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)

    @staticmethod
    def _loop(x, counts: list[int], w1, w2) -> torch.Tensor:
        """Reference: one pair of matmuls per expert (CPU; tests compare the kernels against it). Experts without
        tokens run on zero rows, so every local expert stays in the autograd graph (FSDP needs each gradient)."""
        outs, start = [], 0
        for e, n in enumerate(counts):
            outs.append(F.linear(_swiglu(F.linear(x[start:start + n], w1[e])), w2[e]))
            start += n
        return torch.cat(outs, dim=0)


class SharedExperts(nn.Module):
    """Always-on experts (DeepSeekMoE, Dai et al. 2024, sec. 3.2 "shared expert isolation"): the
    ``num_shared_experts`` SwiGLU experts of width f fused into one of width f_s = n f (torchtitan's layout), or
    of their own width f_s = ``model.moe.shared_ffn_hidden_size`` (LLaDA-MoE's ``shared_expert_intermediate_size``).
    ``fc1_weight`` [2 f_s, d], ``fc2_weight`` [d, f_s]. Forward x [T, d] (already normalised) -> [T, d]."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1_weight = nn.Parameter(torch.empty(2 * ffn, hidden))
        self.fc2_weight = nn.Parameter(torch.empty(hidden, ffn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_swiglu(F.linear(x, _local(self.fc1_weight))), _local(self.fc2_weight))


# ------------------------------------------------------------------ dispatch (no expert parallelism)
class LocalDispatcher:
    """Token dispatcher without expert parallelism: every expert is here, the sorted tokens go straight in.

    :class:`difflm.parallel.expert_parallel.AllToAllDispatcher` has the same two methods.
    """

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor):
        """x [N, d] sorted by global expert id, ``counts`` [E] -> (rows for the local experts, their counts, ctx)."""
        return x, counts, None

    def combine(self, y: torch.Tensor, ctx) -> torch.Tensor:
        """Expert outputs -> rows in the order of ``dispatch``'s input."""
        return y


# ------------------------------------------------------------------ auxiliary losses
class AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out`` whose backward also sends gradient ``scale`` into ``aux`` (a scalar), so the aux
    loss joins the objective without being returned by the model (Megatron-LM ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad_out, torch.full_like(aux, ctx.scale), None


def global_batch_balancing_loss(probs: torch.Tensor, step_counts: torch.Tensor) -> torch.Tensor:
    """The balancing loss of ``model.moe.balance_over=global_batch`` (Qiu et al. 2025, "Demons in the Detail: On
    Implementing Load Balancing Loss for Training Specialized Mixture-of-Expert Models", sec. 3; Megatron-LM's
    ``moe_router_load_balancing_type=global_aux_loss``): ``E * sum_i f_i P_i`` with ``f_i`` the fraction of the routed
    slots of the step so far, this micro-batch included, summed over data / context parallel ranks
    (``step_counts`` [E]), and ``P_i`` this forward's mean router probability (``probs`` [T, E] with grad). f is a
    constant of the backward, so the last micro-batch of a step is balanced against the whole global batch's counts
    and earlier ones against the counts seen up to them. Returns a float32 scalar (without the coefficient)."""
    e = probs.shape[-1]
    f = step_counts.float() / step_counts.sum().clamp(min=1).float()
    return e * (f * probs.mean(dim=0)).sum()


def load_balancing_loss(probs: torch.Tensor, counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4-6; GShard, Lepikhin et al. 2020) for top-k
    routing as Megatron-LM computes it: ``E * sum_i f_i P_i`` with ``f_i = counts_i / (T k)`` the fraction of
    routed slots taken by expert i and ``P_i = mean_t probs[t, i]``. Equals 1 when perfectly balanced.
    probs [T, E] float32 (with grad), counts [E] (no grad) -> scalar float32 (without the coefficient)."""
    t, e = probs.shape
    return e * (counts.float() / max(t * top_k, 1) * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss (Zoph et al. 2022, eq. 5): ``mean_t (logsumexp_j logits[t, j])^2``. [T, E] -> scalar."""
    return torch.logsumexp(logits, dim=-1).square().mean()


# ------------------------------------------------------------------ the MLP slot
class MoEMLP(nn.Module):
    """RMSNorm + routed SwiGLU experts (+ shared experts): the block's MLP slot when ``model.moe.num_experts`` > 0.

    Args:
        cfg: ``model`` config (``hidden_size``, ``norm_eps``, ``ffn_hidden_size``, ``moe.*``).
    Forward: x [*, d] (leading dims are tokens: [B, S, d] or [S, B, d]) -> [*, d] in x's dtype.
    Training forwards (train mode, gradients on) add the auxiliary losses to the backward pass
    (:class:`AttachAuxLoss`) and count tokens per expert; capacity dropping (``capacity_factor``) applies to
    training forwards only: evaluation and sampling route every token.
    Buffers: ``router.bias`` (persistent); non-persistent statistics ``step_tokens`` [E] (routed slots this
    step), ``step_losses`` [3] (sum of aux loss, z-loss, forwards this step), ``last_tokens`` [E] and
    ``last_losses`` [2] (the previous step's, after :func:`moe_step`).
    """

    def __init__(self, cfg):
        super().__init__()
        moe = cfg.moe
        d, f = cfg.hidden_size, expert_ffn_size(cfg)
        self.eps = cfg.norm_eps
        self.num_experts, self.top_k = int(moe.num_experts), int(moe.top_k)
        self.aux_loss_coeff, self.z_loss_coeff = float(moe.aux_loss_coeff), float(moe.z_loss_coeff)
        self.bias_update_rate = float(moe.bias_update_rate)
        self.capacity_factor = moe.capacity_factor
        self.balance_over = str(getattr(moe, "balance_over", "micro_batch") or "micro_batch")
        self.balance_group = None  # data / context parallel group of global_batch balancing (set_moe_balance_group)
        self.layer_norm_weight = nn.Parameter(torch.ones(d))
        self.router = TopKRouter(d, self.num_experts, self.top_k, moe.score_func, bool(moe.norm_topk_prob),
                                 n_group=int(_key(moe, "n_group", 1)), topk_group=int(_key(moe, "topk_group", 1)),
                                 routed_scaling_factor=float(_key(moe, "routed_scaling_factor", 1.0)),
                                 bias_in_weights=bool(_key(moe, "bias_in_weights", False)))
        self.experts = GroupedExperts(self.num_experts, d, f, fp8=bool(_key(moe, "fp8_experts", False)),
                                      fused=bool(_key(moe, "fused_experts", False)),
                                      autotune=_key(cfg, "fused_mlp_autotune", False) is True)
        self.fused_combine = bool(_key(moe, "fused_combine", True))
        f_s = shared_ffn_size(cfg)
        self.shared = SharedExperts(d, f_s) if f_s > 0 else None
        self.dispatcher = LocalDispatcher()
        self.loss_scale = 1.0  # gradient of each forward's aux loss; set_moe_loss_scale
        e = self.num_experts
        self.register_buffer("step_tokens", torch.zeros(e), persistent=False)
        self.register_buffer("step_losses", torch.zeros(3), persistent=False)
        self.register_buffer("last_tokens", torch.zeros(e), persistent=False)
        self.register_buffer("last_losses", torch.zeros(2), persistent=False)
        self.register_buffer("balance_tokens", torch.zeros(e), persistent=False)  # global_batch: the step's counts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = rms_norm(x, _local(self.layer_norm_weight), self.eps).reshape(-1, shape[-1])  # [T, d]
        routing = self.router(h)
        counts = _count(routing.expert_ids, self.num_experts)  # [E] routed slots
        expert_ids = routing.expert_ids
        if self.capacity_factor is not None and self.training:
            expert_ids = self._drop_over_capacity(routing)
        out = self._routed(h, expert_ids, routing.weights)
        if self.shared is not None:
            out = out + self.shared(h)
        if not (self.training and torch.is_grad_enabled()):  # evaluation, sampling, pipeline shape inference
            return out.reshape(shape)
        count = not _in_backward()  # activation checkpointing re-runs the forward in backward: count once
        if count:
            self.step_tokens += counts.detach().float()
        if self.aux_loss_coeff > 0 or self.z_loss_coeff > 0:
            if self.balance_over == "global_batch":
                if count:  # a recomputed forward (activation checkpointing) reuses the counts its first run added
                    seen = counts.detach().float()
                    group = self.balance_group
                    if group is not None and torch.distributed.is_initialized():
                        torch.distributed.all_reduce(seen, group=group)  # the other ranks' tokens of this micro-batch
                    self.balance_tokens += seen
                balance = global_batch_balancing_loss(routing.probs, self.balance_tokens.clone())
            else:
                balance = load_balancing_loss(routing.probs, counts, self.top_k)
            aux = self.aux_loss_coeff * balance
            z = self.z_loss_coeff * router_z_loss(routing.logits)
            out = AttachAuxLoss.apply(out, aux + z, self.loss_scale)
            if count:
                self.step_losses += torch.stack([aux.detach(), z.detach(), aux.new_ones(())])
        return out.reshape(shape)

    def _drop_over_capacity(self, routing: Routing) -> torch.Tensor:
        """Expert ids [T, k] with the slots beyond each expert's capacity ``ceil(cf * T * k / E)`` set to E (dropped):
        each expert keeps its highest-scoring tokens (GShard, Lepikhin et al. 2020, sec. 2.2; Megatron-LM's
        ``moe_token_drop_policy=probs``). The gating weights may be negative (``bias_in_weights`` with a negative
        bias), so the tokens an expert was not chosen by rank below every chosen one (-inf)."""
        t, k = routing.expert_ids.shape
        capacity = int(-(-float(self.capacity_factor) * t * k // self.num_experts))
        gates = torch.zeros_like(routing.probs).scatter(-1, routing.expert_ids, routing.weights.detach())  # [T, E]
        chosen = torch.zeros_like(gates, dtype=torch.bool).scatter(-1, routing.expert_ids, True)
        gates = gates.masked_fill(~chosen, float("-inf"))
        top = torch.topk(gates, min(capacity, t), dim=0).indices  # [C, E] best tokens of each expert
        keep = torch.zeros_like(chosen).scatter(0, top, True) & chosen  # [T, E]
        kept = keep.gather(-1, routing.expert_ids)  # [T, k]
        return routing.expert_ids.masked_fill(~kept, self.num_experts)

    def _routed(self, h: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{ids[t, j]}(h[t]) for every token: sort the T k slots by expert, dispatch,
        run the experts, combine, unsort, weight. Slots with id E (dropped) contribute 0."""
        t, k = expert_ids.shape
        slots = SlotOrder(expert_ids)  # slots grouped by expert, token order inside a group
        counts = _count(expert_ids, self.num_experts + 1)[: self.num_experts]  # id E: dropped slots
        dropped = self.capacity_factor is not None and self.training
        kept = int(counts.sum()) if dropped else t * k
        x_local, local_counts, ctx = self.dispatcher.dispatch(slots.permute(h, kept), counts)  # [N, d] sorted
        y_sorted = self.dispatcher.combine(self.experts(x_local, local_counts), ctx)  # [N, d]
        return slots.combine(y_sorted, weights, fused=self.fused_combine).to(h.dtype)


# ------------------------------------------------------------------ what the trainer calls
def moe_layers(model_parts: Iterable[nn.Module]) -> list[tuple[int, MoEMLP]]:
    """(layer index, module) of every :class:`MoEMLP` in ``model_parts``, by layer index (from ``layers.<i>.``)."""
    found = []
    for part in model_parts:
        for name, module in part.named_modules():
            if isinstance(module, MoEMLP):
                m = re.search(r"layers\.(\d+)\.", name)
                found.append((int(m.group(1)) if m else len(found), module))
    return sorted(found, key=lambda item: item[0])


def set_moe_loss_scale(model_parts: Iterable[nn.Module], scale: float) -> None:
    """Gradient given to each forward's auxiliary loss: the trainer passes micro-batch / global batch size, so
    the step's objective is CE + the mean over micro-batches (and data-parallel ranks) of the aux losses."""
    for _, module in moe_layers(model_parts):
        module.loss_scale = float(scale)


def set_moe_balance_group(model_parts: Iterable[nn.Module], group) -> None:
    """The process group over which ``model.moe.balance_over=global_batch`` sums each micro-batch's expert counts
    (the ranks routing different tokens through the same layers: data and context parallel; None: this rank only)."""
    for _, module in moe_layers(model_parts):
        module.balance_group = group


@torch.no_grad()
def moe_step(model_parts: Iterable[nn.Module], group=None) -> None:
    """End of an optimizer step: sum this step's statistics over ``group`` (the ranks that routed different tokens
    through the same layers: data and context parallel ranks, not TP peers), keep them as ``last_*``, move the
    aux-loss-free bias, and zero the step counters. One all-reduce for all layers; a no-op for dense models.

    Bias update (DeepSeek-V3, Liu et al. 2024, sec. 2.1.2): ``b_i += gamma * sign(mean_j c_j - c_i)`` with c the
    step's routed tokens per expert over the global batch (overloaded experts get a lower bias).
    """
    layers = [m for _, m in moe_layers(model_parts)]
    if not layers:
        return
    packed = torch.cat([torch.cat([m.step_tokens, m.step_losses]) for m in layers])
    if group is not None and torch.distributed.is_initialized():
        torch.distributed.all_reduce(packed, group=group)
    offset = 0
    for m in layers:
        e = m.num_experts
        tokens, losses = packed[offset:offset + e], packed[offset + e:offset + e + 3]
        offset += e + 3
        m.last_tokens.copy_(tokens)
        m.last_losses.copy_(losses[:2] / losses[2].clamp(min=1.0))
        if m.bias_update_rate > 0:  # (a step that routed no tokens leaves the bias alone; no host sync)
            m.router.bias += m.bias_update_rate * torch.sign(tokens.mean() - tokens) * (tokens.sum() > 0)
        m.step_tokens.zero_()
        m.step_losses.zero_()
        m.balance_tokens.zero_()


def moe_step_stats(model_parts: Iterable[nn.Module]) -> tuple[list[int], Optional[torch.Tensor]]:
    """The last step's statistics of every MoE layer (after :func:`moe_step`) as one tensor on the layers' device,
    computed there without a host sync, so that a step's statistics can be copied to the host behind its outcome while
    the next step runs: (the layers' block indices, float64 [L, 4] rows of (max / mean of the experts' routed tokens,
    NaN for a layer that routed none; aux loss; z loss; L2 norm of the router bias)); ([], None) for a dense model.
    :func:`moe_metrics_of` turns them into metrics."""
    layers = moe_layers(model_parts)
    if not layers:
        return [], None
    rows = [torch.stack([(m.last_tokens.max() / m.last_tokens.mean()).double(), m.last_losses[0].double(),
                         m.last_losses[1].double(), m.router.bias.norm().double()]) for _, m in layers]
    return [i for i, _ in layers], torch.stack(rows)


def moe_metrics_of(layer_ids: list[int], stats: Optional[torch.Tensor], pp_group=None) -> dict[str, float]:
    """Metrics of :func:`moe_step_stats`' ``layer_ids`` and ``stats`` (on any device), empty for dense models:

    ``moe/load_max_mean`` (max over experts / mean over experts of the routed tokens, averaged over layers; 1 is
    perfect balance) and per layer ``moe/load_max_mean/<i>``; ``moe/aux_loss`` and ``moe/z_loss`` (summed over
    layers, coefficients included: what they add to the loss); ``moe/bias_norm`` (L2 norm of the router bias,
    averaged over layers). ``pp_group``: pipeline stages hold different layers; their values are gathered (every
    stage calls this).
    """
    per_layer = {} if stats is None else {i: tuple(row) for i, row in zip(layer_ids, stats.tolist())}
    if pp_group is not None:
        gathered = [None] * torch.distributed.get_world_size(pp_group)
        torch.distributed.all_gather_object(gathered, per_layer, group=pp_group)
        per_layer = {k: v for part in gathered for k, v in part.items()}
    if not per_layer:
        return {}
    layers = sorted(per_layer)
    out = {
        "moe/load_max_mean": sum(per_layer[i][0] for i in layers) / len(layers),
        "moe/aux_loss": sum(per_layer[i][1] for i in layers),
        "moe/z_loss": sum(per_layer[i][2] for i in layers),
        "moe/bias_norm": sum(per_layer[i][3] for i in layers) / len(layers),
    }
    out.update({f"moe/load_max_mean/{i}": per_layer[i][0] for i in layers})
    return out


def moe_metrics(model_parts: Iterable[nn.Module], pp_group=None) -> dict[str, float]:
    """:func:`moe_metrics_of` the layers' statistics now (the last step's; a host sync)."""
    return moe_metrics_of(*moe_step_stats(model_parts), pp_group)


__all__ = [
    "AttachAuxLoss", "GroupedExperts", "LocalDispatcher", "MoEMLP", "Routing", "SharedExperts", "TopKRouter",
    "expert_ffn_size", "first_k_dense", "grouped_mm_supported", "grouped_topk", "is_moe_layer", "shared_ffn_size",
    "load_balancing_loss", "moe_config",
    "moe_inactive_params", "moe_layers", "moe_metrics", "moe_metrics_of", "moe_step", "moe_step_stats",
    "router_z_loss", "set_moe_loss_scale",
]
