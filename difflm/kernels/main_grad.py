"""FP32 master weights whose gradients accumulate in ``main_grad`` (Megatron-LM's ``main_grad``, TE's
``fuse_wgrad_accumulation``), and their BF16 copies cast once per optimizer step, shared by the TE kernel set
(:mod:`difflm.model.te_kernels`) and the fused kernels of this package (:mod:`difflm.kernels.quack_mlp`,
:mod:`difflm.kernels.quack_norm_linear`, :mod:`difflm.kernels.embedding`)."""
from __future__ import annotations

import functools

import torch

from difflm.training.precision import fp8_is_active

MAIN_GRAD_NAMES = "main_grad_weight_names"  # module attribute: its weights whose gradients live in main_grad


_STEPS = [0]  # optimizer steps taken in this process (any torch optimizer)


@functools.lru_cache(maxsize=None)
def _count_optimizer_steps() -> None:
    def after_step(optimizer, args, kwargs):
        _STEPS[0] += 1

    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(after_step)


def _optimizer_steps() -> int:
    _count_optimizer_steps()
    return _STEPS[0]


def accumulates_in_main_grad(cfg, *, sharded: bool, pipelined: bool) -> bool:
    """Whether a run on the TE kernel set builds it with ``fuse_wgrad_accumulation`` (its GEMMs' weight gradients in
    FP32 ``main_grad``, :func:`accumulate_into_grad`; the MoE experts' kernels need it):
    ``model.fuse_wgrad_accumulation`` on, no FSDP2 (``sharded``: data or context parallel ranks; its reduce-scatter hooks and the pipeline schedules
    (``pipelined``) read the gradients autograd hands back), no LoRA (frozen weights have no gradient to accumulate)
    and no ``precision.fp8_weights`` (``TEKernels`` leaves it off). ``cfg``: the run config."""
    if sharded or pipelined:  # first: the planner asks for every weight of every layout it weighs, and the config
        return False          # keys below cost an OmegaConf lookup each
    lora = cfg.get("lora")
    return (bool(cfg.model.get("fuse_wgrad_accumulation", True))
            and not (lora is not None and int(lora.get("rank", 0) or 0) > 0)
            and not bool(cfg.precision.get("fp8_weights", False)))


def accumulate_into_grad(module: torch.nn.Module, names) -> None:
    """Give the weights ``names`` of a TE module built with ``fuse_wgrad_accumulation=True`` the buffer (in the
    parameters' dtype, FP32) its weight-gradient GEMMs accumulate into (``main_grad``, TE docs:
    ``te.Linear(fuse_wgrad_accumulation)``), shown to the optimizer, the clipping and the checkpoints as the
    parameter's ``.grad``; and, under FP8, tell the module which micro-batch of the step it runs
    (``is_first_microbatch``).

    A forward pre-hook, before each forward that records gradients: weights whose ``.grad`` is None (a new step:
    ``optimizer.zero_grad(set_to_none=True)`` cleared it) get their buffer zeroed and set as ``.grad``; later
    micro-batches find the buffers there and their gradients accumulate on. ``zero_grad(set_to_none=False)`` zeroes
    the same buffers. TE returns no gradient for these weights, so autograd neither writes nor adds a second copy.
    Inside an FP8 region the module runs with ``is_first_microbatch=True`` when its weights may have changed since
    its last FP8 cast (an optimizer step was taken, or their version counters moved: a checkpoint load) and
    ``False`` otherwise, so TE casts the weights to FP8 once per step and reuses them in the other micro-batches,
    whichever way the gradients are zeroed. That is TE's and Megatron-LM's contract: one forward with gradients per module and
    micro-batch (the first one's weight gradient overwrites the buffer), which difflm's training step keeps.
    Forwards without gradients (evaluation, sampling) leave everything as it is and cache nothing.
    """
    # kept on the module: materialising the model (``to_empty``, sharding) replaces its parameter objects, and with
    # them any attribute set on them here. The hook marks the live weights (attach_main_grads); main_grad_weights
    # finds them for difflm.training.cuda_graphs.
    setattr(module, MAIN_GRAD_NAMES, tuple(names))

    def before_forward(mod, args, kwargs):
        weights = [getattr(mod, name) for name in names]
        if not torch.is_grad_enabled() or not any(p.requires_grad for p in weights):
            return None
        attach_main_grads(weights)
        if not fp8_is_active():  # the FP8 weight cache is all it buys; BF16 modules get no micro-batch contract
            return None
        return args, dict(kwargs, is_first_microbatch=weights_changed_since_cast(mod, weights))

    module.register_forward_pre_hook(before_forward, with_kwargs=True)


def main_grad_weights(module: torch.nn.Module) -> list:
    """The weights of ``module`` and its submodules whose gradients accumulate in ``main_grad``
    (:func:`accumulate_into_grad`), as the parameter objects the modules hold now."""
    return [getattr(m, name) for m in module.modules() for name in getattr(m, MAIN_GRAD_NAMES, ())]


def attach_main_grads(weights) -> None:
    """The start of a step for weights whose gradients accumulate in ``main_grad`` (:func:`accumulate_into_grad`):
    those whose ``.grad`` is None (``zero_grad(set_to_none=True)`` cleared it) get their FP32 buffer zeroed (created
    on first use, or after the weights moved device) and set as ``.grad``; the others are left to accumulate. Each
    weight is marked ``accumulates_in_main_grad``, which the quack modules' backward reads (weight-gradient GEMMs
    that add in place) where TE reads ``main_grad`` itself."""
    for p in weights:
        p.accumulates_in_main_grad = True
        if p.requires_grad and p.grad is None:
            main_grad = getattr(p, "main_grad", None)
            if main_grad is None or main_grad.device != p.device:  # first step, or moved (to_empty)
                p.main_grad = torch.zeros_like(p)
            else:
                p.main_grad.zero_()
            p.grad = p.main_grad


def weights_changed_since_cast(owner, weights) -> bool:
    """Whether ``weights`` may have changed since ``owner`` (a module) last cast them to FP8, recording this call as
    the new cast: TE's ``is_first_microbatch``. What changes weights: an optimizer step (counted by a global
    torch.optim hook: fused AdamW does not bump version counters) or another in-place write (a checkpoint load, which
    does)."""
    state = (_optimizer_steps(), tuple(p._version for p in weights))
    first = state != getattr(owner, "_fp8_cast_state", None)
    owner._fp8_cast_state = state
    return first


def weights_cast_once_per_step(owner, weights, dtype: torch.dtype) -> tuple:
    """``weights`` (FP32 masters) in ``dtype`` for a forward of ``owner`` (a module): in forwards that record gradients
    (training micro-batches) of weights whose gradients accumulate in ``main_grad`` (:func:`accumulate_into_grad`:
    whole weights on this rank, one forward per module and micro-batch), cast once and reused until the weights may
    have changed, i.e. once per optimizer step at any number of micro-batches (the key of
    :func:`weights_changed_since_cast`: optimizer steps, version counters, plus the storages and the dtype). Other
    forwards (evaluation, sampling) and other weights (FSDP2's gathered shards, pipeline stages) cast afresh and
    cache nothing, so no gathered copy outlives its forward.

    Returns: a tuple of tensors, ``dtype`` each, the weights themselves where they already have it. The cache holds
    one copy per weight (half the FP32 size in BF16) between steps."""
    if not torch.is_grad_enabled() or not all(getattr(w, "accumulates_in_main_grad", False) for w in weights):
        return tuple(w.to(dtype) for w in weights)
    return converted_once_per_step(owner, weights, dtype, lambda ws: tuple(w.detach().to(dtype) for w in ws))


def converted_once_per_step(owner, weights, tag, convert) -> tuple:
    """``convert(weights)`` (a tuple of tensors derived from the FP32 masters ``weights``: their BF16 copies, FP8
    copies with scales), computed once and kept on ``owner`` until the weights may have changed (an optimizer step,
    an in-place write, new storage) or ``tag`` differs. For forwards that record gradients of weights whose
    gradients accumulate in ``main_grad`` (:func:`accumulate_into_grad`): the caller checks that; see
    :func:`weights_cast_once_per_step`. The cache holds one result per owner."""
    key = (_optimizer_steps(), tuple((w._version, w.data_ptr(), w.device) for w in weights), tag)
    cached = getattr(owner, "_cast_weights", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    owner._cast_weights = None  # release the stale copies before converting the new ones
    with torch.no_grad():
        result = tuple(convert(weights))
    owner._cast_weights = (key, result)
    return result


__all__ = ["MAIN_GRAD_NAMES", "accumulate_into_grad", "accumulates_in_main_grad", "attach_main_grads",
           "converted_once_per_step", "main_grad_weights", "weights_cast_once_per_step", "weights_changed_since_cast"]
