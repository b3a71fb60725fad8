"""The peak memory of a real training step, traced without a device.

The run's model (the torch kernel set, activation checkpointing as ``parallel.activation_checkpointing`` sets it),
its AdamW and a noised micro-batch of the run's shape are built from ``FakeTensorMode`` tensors
(``torch._subclasses.fake_tensor``): every operator computes its output's shape, dtype and strides and allocates
nothing. ``torch.distributed._tools.mem_tracker.MemTracker`` (a ``TorchDispatchMode``) follows every storage the
step creates, until its last reference dies, and keeps the peak of their sum by kind (parameters, gradients,
activations, backward temporaries, optimizer state). Two optimizer steps run, so the second carries the AdamW
moments as a training run does from its second step on; with gradient accumulation each step runs two
micro-batches, the second with the first's gradients held. A 1.7B model at S = 4096 costs tens of seconds of host
time and no memory; the tests run reduced depths.

The fake tensors live on the CPU (a CPU build of torch cannot run autograd on fake CUDA tensors), so the step runs
the CPU's kernels of the same operators: ``torch.autocast("cpu", bfloat16)``, whose casts and cache follow CUDA's
for the GEMMs and norms; SDPA's CPU flash kernel, which saves what CUDA's flash / cuDNN kernels save (the output and
an FP32 log-sum-exp per row); TE's fused cross-entropy as a twin that keeps what it keeps (the logits, whose
gradient it writes in place, and two FP32 statistics a row) where ``model.fused_cross_entropy`` is on, else the
unfused one. Not traced: ``precision=fp8`` and ``model.backend=te`` (Transformer Engine's modules need a GPU),
mixtures of experts (the routing's counts are data), the CUDA allocator's rounding (512 bytes a block), its
fragmentation and kernel workspaces (cuBLAS, cuDNN), which ``torch.cuda.max_memory_allocated`` partly counts.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from difflm.errors import DifflmError


@dataclass
class TracedPeak:
    """The traced step's peak: ``peak_bytes`` (int), its ``parts`` by MemTracker kind (``Parameter``,
    ``Gradient``, ``Activation``, ``Temp``, ``Optstate``, ...; bytes), the ``phase`` it fell in (``forward``, which
    includes the loss, ``backward`` or ``optimizer``) and the innermost module running then (``""``: none, the loss)."""

    peak_bytes: int
    parts: dict[str, int] = field(default_factory=dict)
    phase: str = ""
    module: str = ""


def untraceable_reason(cfg) -> str | None:
    """Why :func:`traced_peak` cannot trace the run ``cfg``, or None."""
    if cfg.precision.name == "fp8":
        return "precision=fp8 runs Transformer Engine's FP8 GEMMs, which need a GPU: trace precision=bf16"
    if str(cfg.model.get("backend", "torch")) == "te":
        return "model.backend=te builds Transformer Engine modules, which need a GPU: trace model.backend=torch"
    from difflm.model.lora import lora_enabled

    if int(cfg.model.moe.num_experts) > 0:
        return ("model.moe.num_experts>0 is not traced: the router's token counts per expert are data, which fake "
                "tensors do not carry; trace the dense model of the same width")

    if lora_enabled(cfg.get("lora")):
        return "lora.* is not traced: trace the full fine-tuning run"
    return None


class _FusedRMSNormTwin(torch.autograd.Function):
    """What CUDA's fused RMSNorm (``aten::_fused_rms_norm``, which ``F.rms_norm`` runs on CUDA) keeps for the
    backward: the input and one FP32 ``rstd`` per row. The CPU's ``F.rms_norm`` is a composite that also keeps the
    normalised input. Shapes only: the trace's tensors carry no values."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
        ctx.save_for_backward(x, rstd, weight)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        x, _, weight = ctx.saved_tensors
        return torch.empty_like(x), None if weight is None else torch.empty_like(weight), None


def _rms_norm_twin(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`difflm.model.layers.rms_norm` as CUDA runs it (FP32 statistics, the fused kernel's saves)."""
    return _FusedRMSNormTwin.apply(x.float(), weight.float(), eps).to(x.dtype)


def _qkv_twin_forward(qkv, cos, sin, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim, dense_v=True):
    a0, a1 = qkv.shape[:2]
    return (qkv.new_empty(a0, a1, num_heads, head_dim), qkv.new_empty(a0, a1, num_kv_heads, head_dim),
            qkv.new_empty(a0, a1, num_kv_heads, head_dim))


def _qkv_twin_backward(gq, gk, gv, qkv, cos, sin, q_weight, k_weight, *dims, dqkv=None):
    return (qkv.new_empty(qkv.shape) if dqkv is None else dqkv,
            None if q_weight is None else torch.empty_like(q_weight),
            None if k_weight is None else torch.empty_like(k_weight))


class _FusedCrossEntropyTwin(torch.autograd.Function):
    """Shape-only twin of TE's ``parallel_cross_entropy`` with ``overwrite_input`` (what
    :func:`difflm.objectives.cross_entropy.token_cross_entropy` runs in a training step): [1, N, V] logits ->
    [1, N] FP32 losses; it keeps the logits and the rows' max and sum of exponentials (FP32) and writes the gradient
    into the logits, so its backward allocates nothing [N, V]."""

    @staticmethod
    def forward(ctx, logits, targets):
        stats = logits.new_empty(logits.shape[:-1] + (2,), dtype=torch.float32)
        ctx.save_for_backward(logits, stats)
        return logits.new_empty(logits.shape[:-1], dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        logits, _ = ctx.saved_tensors
        return logits, None


def _fused_cross_entropy_twin(logits, targets, overwrite_input: bool = False, **_):
    if not overwrite_input:  # TE keeps its own copy of the logits for the gradient
        logits = logits.clone()
    return _FusedCrossEntropyTwin.apply(logits, targets)


@contextlib.contextmanager
def fused_cross_entropy_twin():
    """:func:`difflm.objectives.cross_entropy.token_cross_entropy` takes TE's fused path, run by
    :class:`_FusedCrossEntropyTwin`, on the CPU's fake tensors."""
    from difflm.objectives import cross_entropy

    saved = (cross_entropy.fused_cross_entropy_available, cross_entropy._te_cross_entropy)
    cross_entropy.fused_cross_entropy_available = lambda logits: logits.dim() == 2 and logits.shape[0] > 0
    cross_entropy._te_cross_entropy = lambda: _fused_cross_entropy_twin
    try:
        yield
    finally:
        cross_entropy.fused_cross_entropy_available, cross_entropy._te_cross_entropy = saved


@contextlib.contextmanager
def cuda_kernel_twins():
    """The step's CUDA-only kernels in shape-only twins that keep what they keep for the backward: the fused RMSNorm
    (:class:`_FusedRMSNormTwin`) and the Triton QKV split / QK-norm / RoPE (:mod:`difflm.kernels.qkv_triton`, which
    keeps only the QKV projection's output; the CPU's eager composition keeps the FP32 norm inputs too)."""
    from difflm.kernels import qkv_triton
    from difflm.model import layers, moe, qkv

    saved = (qkv_triton.forward, qkv_triton.backward, qkv.triton_runs, qkv.plain_tensors, layers.rms_norm, moe.rms_norm)
    qkv_triton.forward, qkv_triton.backward = _qkv_twin_forward, _qkv_twin_backward
    qkv.triton_runs = lambda t, cos, sin, fused: bool(fused) and t.dim() == 3
    qkv.plain_tensors = lambda *ts: True  # fake parameters are tensor subclasses; no DTensor is traced
    layers.rms_norm = moe.rms_norm = _rms_norm_twin  # what the norm modules call (module-level names)
    try:
        yield
    finally:
        (qkv_triton.forward, qkv_triton.backward, qkv.triton_runs, qkv.plain_tensors, layers.rms_norm,
         moe.rms_norm) = saved


def _peak_tracker():
    """A MemTracker that also notes the phase and innermost module of each new peak."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class PeakTracker(MemTracker):
        where = ("", "")

        def _update_peak_stats(self, peak_state) -> None:  # MemTracker's hook after every operator
            before = sum(self._peak_mem.values())
            super()._update_peak_stats(peak_state)
            if sum(self._peak_mem.values()) > before:
                phase = "optimizer" if self._in_opt else "backward" if self._mod_tracker.is_bw else "forward"
                inner = [p for p in self._mod_tracker.parents if p != "Global"]
                self.where = (phase, max(inner, key=len) if inner else "")

    return PeakTracker()


def _fake_model(cfg, causal: bool, mode):
    """The run's model (torch kernels, no weights) with fake FP32 parameters on the CPU, checkpointed as
    ``parallel.activation_checkpointing`` says (:meth:`difflm.training.trainer.Trainer._build_single_model`)."""
    from difflm.model import build_model
    from difflm.parallel.fsdp import apply_activation_checkpointing

    m = cfg.model.copy()
    m.compile = False
    model = build_model(m, causal=causal, device=torch.device("cpu"), seed=None, precision=cfg.precision, meta=True)
    with mode:  # meta -> fake in place: to_empty cannot swap a plain parameter for a tensor subclass
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None:
                    mod._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                               requires_grad=p.requires_grad)
            for name, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[name] = torch.empty(b.shape, dtype=b.dtype)
    apply_activation_checkpointing(model, str(cfg.parallel.activation_checkpointing))
    return model


def noised_batch(cfg, objective, micro_batch: int, loss_fraction: float | None = None):
    """A noised micro-batch of random tokens of the run's shape on the host (a ``NoisedBatch``). With
    ``loss_fraction``, exactly that share of the noised positions (the first ``data.seq_len`` of each row) carries
    the loss: the share :mod:`difflm.plan.memory` plans for (:func:`difflm.plan.memory.peak_loss_fraction`)."""
    vocab, seq = int(cfg.model.vocab_size), int(cfg.data.seq_len)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab - 1, (micro_batch, seq), generator=g)
    batch = objective.noise(tokens, range(micro_batch), (int(cfg.train.seed), 0), micro_batch)
    if loss_fraction is not None and cfg.objective.name != "ar":
        rows = torch.zeros(micro_batch * seq, dtype=torch.bool)
        rows[torch.randperm(micro_batch * seq, generator=g)[:round(loss_fraction * micro_batch * seq)]] = True
        mask = torch.zeros_like(batch.loss_mask)
        mask[:, :seq] = rows.view(micro_batch, seq)  # bd3lm's [x_t ; x_0]: the loss rows lie in x_t
        batch = type(batch)(**{**batch.__dict__, "loss_mask": mask, "loss_index": None})
    return batch.pinned(False)


def _fake_batch(cfg, objective, mode, micro_batch: int, loss_fraction: float | None):
    """:func:`noised_batch` copied to fake tensors of the same shapes (the loss rows' count is data)."""
    batch = noised_batch(cfg, objective, micro_batch, loss_fraction)
    with mode:
        fields = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in batch.__dict__.items()}
    return type(batch)(**fields)


def traced_peak(cfg, micro_batch: int | None = None, steps: int = 2, loss_fraction: float | None = None) -> TracedPeak:
    """The peak bytes of ``steps`` training steps of the run ``cfg`` on one process, traced under fake tensors.

    Args:
        cfg: the composed train config with ``model.vocab_size`` and ``model.head_dim`` set; its kernel keys may be
            ``auto`` (the torch kernel set and SDPA are traced whatever they say).
        micro_batch: samples per micro-batch (default ``train.micro_batch_size``). Each step runs two micro-batches
            when the global batch holds several (the second runs with the first's gradients held, as every later
            one does), else one.
        steps: optimizer steps (the second is the first with AdamW's moments allocated).
        loss_fraction: the share of positions that carry the loss (default: the planner's peak share,
            :func:`difflm.plan.memory.peak_loss_fraction`).
    Returns: the :class:`TracedPeak`.
    Raises: DifflmError for what cannot be traced (:func:`untraceable_reason`).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from difflm.objectives import build_objective
    from difflm.objectives.base import weighted_ce_sum
    from difflm.plan.memory import peak_loss_fraction
    from difflm.training.optimizer import build_optimizer
    from difflm.training.precision import autocast_context

    if (reason := untraceable_reason(cfg)) is not None:
        raise DifflmError(reason)
    from difflm.model.auto_kernels import cpu_kernels

    cfg = cfg.copy()
    cfg.model = cpu_kernels(cfg.model, keep_explicit=False)  # the torch kernels, which the trace runs on the CPU
    mb = int(micro_batch or cfg.train.micro_batch_size)
    n_micro = 2 if int(cfg.train.global_batch_size) // mb > 1 else 1
    objective = build_objective(cfg.objective, int(cfg.model.vocab_size) - 1)
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # host constants (masks' index tensors) enter as they are
    model = _fake_model(cfg, objective.causal, mode)
    if loss_fraction is None:
        loss_fraction = peak_loss_fraction(cfg.objective, mb, int(cfg.train.global_batch_size), int(cfg.data.seq_len))
    batch = _fake_batch(cfg, objective, mode, mb, loss_fraction)
    with mode:
        optimizer = build_optimizer(model, cfg.optim, torch.device("cuda"))  # fused AdamW, as on a GPU
    tracker = _peak_tracker()
    tracker.track_external(model, optimizer)
    fused = bool(cfg.model.get("fused_cross_entropy", True))
    with mode, tracker, cuda_kernel_twins(), (fused_cross_entropy_twin() if fused else contextlib.nullcontext()):
        for _ in range(steps):
            for _ in range(n_micro):
                with autocast_context(cfg.precision, torch.device("cpu")):
                    logits = model(batch.input_ids, batch.logits_selector(), **batch.model_kwargs())
                # logits stay referenced through the backward, as in the trainer's step
                loss = weighted_ce_sum(logits, batch, cfg.objective.loss_norm, 1.0, fused=fused, consume_logits=True)
                loss.backward()
                del logits, loss
                tracker.reset_mod_stats()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    parts = {str(getattr(k, "value", k)): int(v) for k, v in peak.items() if str(k) != "Total" and v}
    return TracedPeak(int(peak.get("Total", 0)), parts, *tracker.where)
