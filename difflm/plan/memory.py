"""Bytes per GPU of a training run, by part.

Persistent state (exact, from :mod:`difflm.plan.shapes`): FP32 parameters, FP32 gradients (``.grad`` or TE's
``main_grad``), AdamW's two FP32 moments and its per-tensor ``step`` (torch.optim.AdamW). Transient peaks (models,
scaled by the calibration's ``activation_scale``):

* activations saved for the backward, per token and block (bytes; Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models", sec. 4, redone for this block: RMSNorm + fused QKV with QK-norm and RoPE,
  memory-efficient attention with no S x S scores, SwiGLU MLP, an FP32 residual stream under autocast)::

      2 r h + 2 a h + a (2 (q + 2 kv) + q) + 4 a f

  with ``r`` = 4 (the FP32 residual), ``a`` the compute dtype's bytes, ``h`` hidden, ``q`` / ``kv`` the query and
  key/value widths, ``f`` the MLP width (MoE: ``top_k x`` the expert width plus the shared experts): the norms' FP32
  inputs, the GEMMs' inputs in the compute dtype, the QKV output and its dense heads, the attention output, and
  the MLP's ``2 f`` wide first GEMM output with its SiLU and product (checked against the traced step,
  :mod:`difflm.plan.trace`). Under sequence parallelism every term but the attention's is divided by ``tp``; the
  attention's is divided by ``tp`` always (heads), and everything by ``cp``. A MoE slot runs replicated over TP on
  the whole sequence (its norm and ``4 a f``: not divided by ``tp``). That is the torch kernel set's count;
  Transformer Engine's (``model.backend=te``: a residual stream in the compute dtype, fewer saved tensors, FP8
  copies under ``precision=fp8``) is written from its modules in :mod:`difflm.plan.activations`, which also says
  how ``model.*=auto`` is planned. ``activation_checkpointing=full`` keeps the block input (``r h``; ``a h`` under
  TE) per block plus one block's activations; ``selective`` (every 2nd block) keeps half the blocks whole.
* in-flight micro-batches: 1 without pipelining; the first stage of 1F1B holds ``pp`` (GPipe: all of them);
* the logits of the loss rows (the LM head runs at masked positions only), planned for the micro-batch with the
  most of them (:func:`peak_loss_fraction`; all positions for ``ar``): with TE's fused cross-entropy the logits,
  whose gradient overwrites them; unfused, the logits in the compute dtype, the FP32 log-probabilities, their FP32
  gradient and the FP32 logits' gradient, which coexist at the start of the backward;
* BF16 weight casts: autocast caches each weight's cast while it is on (torch docs, "Automatic Mixed Precision");
  a GEMM saves its cast weight for the backward, so without checkpointing a stage's weights are held twice over
  until their block's backward; a checkpointed block saves none, and its casts go when the forward's autocast
  exits. FSDP2 gathers BF16 blocks instead: the unsharded block in use, the prefetched ones, and one block's
  gradient before its reduce-scatter. The TE kernel set with ``main_grad`` keeps some copies through the whole step
  instead (:func:`step_state`): FP8 weight workspaces with their transposes, BF16 tables cast once per step.

These parts do not peak together (:func:`plan_memory` takes the largest phase): at the loss, the saved activations,
logits and saved casts; in a checkpointed forward, every cast and one block's activations; at the end of the
backward, all gradients with the first block's activations. Gradients set to None after each step exist before the
backward only under gradient accumulation or pipelining; the TE kernel set's FP32 ``main_grad`` buffers
(:func:`difflm.plan.activations.step_state_bytes`) are never freed, so they are held in every phase.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from difflm.plan.activations import KernelSet, block_bytes_per_token, kernel_set, residual_bytes, step_state_bytes
from difflm.plan.activations import torch_bytes_per_token
from difflm.plan.activations import mlp_width  # noqa: F401  (also read from here: difflm.plan.step_time)
from difflm.plan.shapes import Param, last_stage_rank, local_numel, rank_layers, stage_of

GIB = 1024 ** 3


@dataclass
class Layout:
    """Degrees of a parallel layout (``parallel.*``), the batch split and checkpointing of one candidate."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    micro_batch: int = 1
    activation_checkpointing: str = "none"  # none | selective | full
    sequence_parallel: bool = True
    pp_schedule: str = "1F1B"
    pp_virtual_stages: int = 1  # parallel.pp_virtual_stages (interleaved schedules; ZBVZeroBubble always 2)

    @property
    def stages(self) -> tuple[int, int, str]:
        """(pp, virtual stages, schedule): how the pipeline ranks hold the stages
        (:func:`difflm.plan.shapes.stage_of`)."""
        return self.pp, self.pp_virtual_stages, self.pp_schedule

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp_replicate * self.dp_shard

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """FSDP2's shard degree for all parameters but the routed experts."""
        return self.dp_shard * self.cp

    def name(self) -> str:
        parts = [f"{k}{v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep)) if v > 1]
        if self.dp_shard > 1:
            parts.append(f"fsdp{self.dp_shard}")
        if self.dp_replicate > 1:
            parts.append(f"ddp{self.dp_replicate}")
        return "-".join(parts) or "single"


@dataclass
class MemoryPlan:
    """Predicted bytes on the most loaded GPU, by part (``parts``) at the peak, their sum (``total``), the
    ``phase`` of the step the peak falls in (``loss``, ``checkpointed forward`` or ``backward end``), and the kernel
    set whose saved tensors were counted (``kernels``, :meth:`difflm.plan.activations.KernelSet.describe`)."""

    parts: dict[str, float] = field(default_factory=dict)
    phase: str = ""
    kernels: str = ""

    @property
    def total(self) -> float:
        return float(sum(self.parts.values()))


def stage_params(params: list[Param], layout: Layout, num_layers: int) -> list[int]:
    """Elements held by one rank of each pipeline rank's stages (a list of ``pp`` counts)."""
    efsdp = max(layout.fsdp // layout.ep, 1)
    out = [0] * layout.pp
    for p in params:
        out[stage_of(p, num_layers, *layout.stages)] += local_numel(p, layout.tp, layout.ep, layout.fsdp, efsdp)
    return out


def stage_tensors(params: list[Param], layout: Layout, num_layers: int) -> list[int]:
    """Parameter tensors per pipeline rank (AdamW keeps one ``step`` scalar for each)."""
    out = [0] * layout.pp
    for p in params:
        out[stage_of(p, num_layers, *layout.stages)] += 1
    return out


def persistent_bytes(params: list[Param], layout: Layout, num_layers: int) -> list[dict[str, float]]:
    """FP32 parameters, gradients and AdamW state (two moments + a 4-byte ``step`` per tensor) per stage."""
    out = []
    for n, tensors in zip(stage_params(params, layout, num_layers), stage_tensors(params, layout, num_layers)):
        out.append({"parameters": 4.0 * n, "gradients": 4.0 * n, "optimizer": 8.0 * n + 4.0 * tensors})
    return out


def step_state(cfg, params: list[Param], layout: Layout, num_layers: int, kernels: KernelSet) -> list[dict[str, float]]:
    """Per stage, the bytes of the weight state the kernel set keeps through every phase of a step (and between
    steps): ``main_grad``, the FP32 gradient buffers of the weights that accumulate in place, and ``copies``, their
    weight copies cast once per step (FP8 workspaces with their transposes, BF16 tables); from
    :func:`difflm.plan.activations.step_state_bytes`, on this rank's shards. Zero for the torch kernel set, whose
    gradients are ``.grad`` (None between steps) and whose casts live in autocast's cache. Beside them,
    ``outside``: the elements of the weights outside the blocks that have no such copy (the LM head, the final
    norm), which autocast casts in the forward and their backward keeps until it runs (counted only where
    ``copies`` are)."""
    efsdp = max(layout.fsdp // layout.ep, 1)
    out = [{"main_grad": 0.0, "copies": 0.0, "outside": 0.0} for _ in range(layout.pp)]
    for p in params:
        grad, copy = step_state_bytes(cfg, kernels, layout, p.name)
        n = local_numel(p, layout.tp, layout.ep, layout.fsdp, efsdp)
        stage = out[stage_of(p, num_layers, *layout.stages)]
        stage["main_grad"] += float(grad * n)
        stage["copies"] += float(copy * n)
        if p.layer is None and not copy:
            stage["outside"] += float(n)
    return out


def activation_bytes_per_token(model_cfg, layout: Layout, act_bytes: int) -> float:
    """Bytes one block of the torch kernel set saves for its backward per token of the full sequence (module
    docstring's formula; :func:`difflm.plan.activations.torch_bytes_per_token`). The step-time model reads it as the
    block's activation traffic whatever the kernel set; the memory plan counts the run's own set
    (:func:`difflm.plan.activations.block_bytes_per_token`)."""
    return torch_bytes_per_token(model_cfg, layout, act_bytes)


def in_flight(layout: Layout, n_micro: int) -> int:
    """Micro-batches whose activations the first pipeline stage holds at once."""
    if layout.pp == 1:
        return 1
    if layout.pp_schedule == "GPipe":
        return n_micro
    return min(layout.pp, n_micro)


def loss_row_fraction(objective_cfg) -> float:
    """Expected fraction of a sequence's positions at which the LM head runs."""
    name = objective_cfg.name
    if name == "ar":
        return 1.0
    eps = float(objective_cfg.get("eps", 1e-3) or 0.0)
    return (1.0 + eps) / 2.0


PEAK_Z = 3.0  # iid times: plan for the mean + 3 standard deviations of a micro-batch's masked share


def peak_loss_fraction(objective_cfg, micro_batch: int, global_batch: int, seq_len: int) -> float:
    """The fraction of a micro-batch's positions at which the LM head runs, in the micro-batch that has the most.

    The memory peak is that of the micro-batch with the most loss rows, not of the average one. A position is masked
    with probability ``p = eps + (1 - eps) t`` (linear schedule); a micro-batch's share is the mean of ``p`` over
    its ``u`` time draws (``u`` = ``micro_batch`` samples; bd3lm draws one ``t`` per block: ``micro_batch x
    seq_len / block_size``). ``objective.t_sampling=iid``: the mean of ``u`` uniforms, planned at ``1/2 + 3
    sqrt(1 / (12 u))`` (at most 1). ``antithetic`` / ``stratified`` spread the times evenly over the global batch,
    so one micro-batch of consecutive samples covers an interval of width ``w = micro_batch / global_batch`` of
    ``[0, 1)``, the last of them ``[1 - w, 1)``: mean ``1 - w / 2``. ``ar``: 1.
    """
    if objective_cfg.name == "ar":
        return 1.0
    eps = float(objective_cfg.get("eps", 1e-3) or 0.0)
    draws = micro_batch
    if objective_cfg.name == "bd3lm":
        draws *= max(seq_len // int(objective_cfg.get("block_size", 1) or 1), 1)
    if str(objective_cfg.get("t_sampling", "iid")) in ("antithetic", "stratified"):
        mean_t = 1.0 - min(micro_batch / max(global_batch, 1), 1.0) / 2
    else:
        mean_t = min(0.5 + PEAK_Z * (1.0 / (12.0 * draws)) ** 0.5, 1.0)
    return eps + (1.0 - eps) * mean_t


def plan_memory(cfg, params: list[Param], layout: Layout, n_micro: int, activation_scale: float = 1.0,
                kernels: Optional[KernelSet] = None) -> MemoryPlan:
    """Predicted bytes on the most loaded GPU of ``layout`` for the run ``cfg`` (the composed train config).

    The transient parts do not all peak together (module docstring): the plan is the largest of the loss phase (the
    blocks' saved activations, the logits, the weight casts the GEMMs saved), the checkpointed forward (every cast
    in autocast's cache, one block's activations), and the end of the backward (all gradients, one block's
    activations and casts); gradients are held before the backward only when earlier micro-batches left them
    (gradient accumulation, pipelining), except the TE kernel set's ``main_grad`` buffers, held in every phase with
    the weight copies cast once per step (:func:`step_state`).

    Args:
        params: :func:`difflm.plan.shapes.model_params` of ``cfg.model``.
        n_micro: micro-batches per optimizer step and data-parallel rank (gradient accumulation steps).
        activation_scale: the calibration's factor on the activation model (1.0 uncalibrated).
        kernels: the run's kernel set under ``layout``, whose saved tensors are counted (default:
            :func:`difflm.plan.activations.kernel_set`, which plans ``model.*=auto`` as on a fully installed GPU).
    Returns: the :class:`MemoryPlan` of the stage with the largest total, its ``phase`` naming the peak.
    """
    m = cfg.model
    data_seq = int(cfg.data.seq_len)
    seq = data_seq * (2 if cfg.objective.name == "bd3lm" else 1)  # bd3lm runs [x_t ; x_0]
    precision = cfg.precision.name
    act_bytes = 4 if precision == "fp32" else 2
    num_layers = int(m.num_layers)
    vocab = int(m.vocab_size)
    persistent = persistent_bytes(params, layout, num_layers)
    layers_per_stage = rank_layers(num_layers, *layout.stages)
    tokens = layout.micro_batch * seq
    kernels = kernels or kernel_set(cfg, layout)
    per_token = block_bytes_per_token(m, kernels, layout, act_bytes) * activation_scale
    sp = layout.tp if layout.sequence_parallel and layout.tp > 1 else 1
    block_input = residual_bytes(kernels, act_bytes) * int(m.hidden_size) / layout.cp / sp
    fraction = peak_loss_fraction(cfg.objective, layout.micro_batch * layout.dp,
                                  int(cfg.train.global_batch_size), data_seq)
    kept = step_state(cfg, params, layout, num_layers, kernels)
    best = None
    for s, state in enumerate(persistent):
        n = max(layers_per_stage[s], 1)
        ac = layout.activation_checkpointing
        whole = {"full": 0, "selective": n - n // 2}.get(ac, n)  # blocks that keep their activations
        flights = in_flight(layout, n_micro) if s == 0 else max(1, in_flight(layout, n_micro) - s)
        saved = tokens * (whole * per_token + (n - whole) * block_input) * flights
        one_block = tokens * per_token
        logits = 0.0
        if s == last_stage_rank(*layout.stages):
            rows = layout.micro_batch * data_seq / layout.cp * fraction
            fused = kernels.fused_cross_entropy
            # fused: the gradient overwrites the logits; unfused: the logits, the FP32 log-probabilities, their
            # gradient and the FP32 logits' gradient at the log-softmax backward
            logits = rows * vocab / layout.tp * (act_bytes if fused else act_bytes + 12)
        stage_elems = state["parameters"] / 4.0
        casts_all = casts_saved = casts_block = 0.0
        if layout.fsdp > 1:  # FSDP2's gathered blocks: the one in use, the prefetched ones, one block's gradient
            block = stage_elems / n * layout.fsdp
            if precision != "fp32":
                prefetch = 1 + int(cfg.parallel.get("fsdp_prefetch", 0) or 1)
                casts_all = casts_saved = casts_block = block * 2 * (1 + prefetch) + block * 4
            else:
                casts_all = casts_saved = casts_block = block * 8
        elif precision != "fp32":  # autocast's BF16 casts; a checkpointed block's are dropped when autocast exits
            casts_all = 2.0 * stage_elems
            copies = kept[s]["copies"]
            if copies:  # copies cast once per step stay in every phase; the other weights are cast per forward:
                outside = 2.0 * kept[s]["outside"]  # the head's cast, saved until its backward, checkpointed or not
                per_block = casts_all - copies - outside  # the blocks' casts, saved by the whole blocks only
                casts_saved = copies + outside + per_block * whole / n
                casts_block = copies + per_block / n
            else:
                casts_saved = casts_all * whole / n
                casts_block = casts_all / n
        grads = state["gradients"]
        # main_grad buffers are never freed; the other gradients exist before the backward only when earlier
        # micro-batches left them
        held = grads if (n_micro > 1 or layout.pp > 1) else kept[s]["main_grad"]
        phases = {"loss": (held, saved, logits, casts_saved), "backward end": (grads, one_block, 0.0, casts_block)}
        if whole < n:
            phases["checkpointed forward"] = (held, saved + one_block, 0.0, casts_all)
        for phase, (g, act, lg, buf) in phases.items():
            parts = {"parameters": state["parameters"], "gradients": g, "optimizer": state["optimizer"],
                     "activations": act, "logits": lg, "buffers": buf}
            plan = MemoryPlan(parts, phase, kernels.describe())
            if best is None or plan.total > best.total:
                best = plan
    return best
