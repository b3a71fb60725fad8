"""Model construction: the one Llama-style transformer (:mod:`difflm.model.transformer`) with the kernel set of
``model.backend``: pure PyTorch (``torch``) or Transformer Engine (``te``, :mod:`difflm.model.te_kernels`, imported
lazily)."""
from __future__ import annotations

from typing import Optional

import torch

from difflm.errors import DifflmError
from difflm.model.kernels import TorchKernels
from difflm.model.transformer import Transformer


def resolve_model_config(cfg, vocab_size: int) -> None:
    """Fill the keys that come from elsewhere: ``model.vocab_size`` (tokenizer, padded) and ``model.head_dim``."""
    cfg.vocab_size = vocab_size
    if cfg.head_dim is None:
        cfg.head_dim = cfg.hidden_size // cfg.num_heads


def build_model(cfg, *, causal: bool, device: torch.device, seed: Optional[int], precision=None, meta: bool = False,
                **te_parallel) -> Transformer:
    """Build on the meta device (no memory), materialise on ``device``, then initialise with ``seed``.

    Args:
        cfg: ``model`` config with ``vocab_size`` and ``head_dim`` resolved. ``model.backend`` picks the kernel set
            (:func:`build_kernels`); every kernel set starts from the same weights for the same
            seed. ``model.compile`` compiles each block. ``model.moe.num_experts`` > 0 puts a mixture-of-experts MLP
            in every block (:mod:`difflm.model.moe`).
        causal: attention type (True for the ``ar`` objective).
        seed: the keyed initialisation's seed; None leaves the parameters uninitialised (``device="meta"`` for
            counting parameters, or callers that initialise on the device themselves, e.g. scripts/benchmark.py,
            where the keyed CPU draw of billions of values would dominate).
        precision: the ``precision`` config; the TE kernels read ``fp8_weights`` / ``fp8_skip_first_last``.
        meta: stop after building on the meta device (``device`` is only checked): the caller lays the model out
            and materialises each rank's shards (:func:`difflm.parallel.materialize.materialize`).
        te_parallel: TE process-group arguments (``tp_group``, ``sequence_parallel``, ``cp_group``, ...).
    Returns: a :class:`Transformer` with FP32 parameters on ``device`` in train mode (on ``meta`` with ``meta``).
    Raises: DifflmError for ``backend=te`` without Transformer Engine or CUDA, and for a kernel key still ``auto``
    (:func:`difflm.model.auto_kernels.choose_kernels` picks them for a device before the model is built).
    """
    device = torch.device(device)
    moe = getattr(cfg, "moe", None)
    still_auto = [k for k in ("backend", "attention_backend", "fused_mlp", "fused_mlp_autotune")
                  if str(getattr(cfg, k, "")) == "auto"]
    if moe is not None and int(getattr(moe, "num_experts", 0) or 0) > 0 \
            and str(getattr(moe, "fused_experts", "")) == "auto":
        still_auto.append("moe.fused_experts")
    if still_auto:
        raise DifflmError(f"model.{still_auto[0]}=auto is chosen for a device before the model is built: compose "
                          "with difflm.config.compose.compose_train_config(overrides, device=...) (or call "
                          "difflm.model.auto_kernels.choose_kernels), or give model." + still_auto[0] + " a value")
    if getattr(cfg, "backend", "torch") == "te":
        from difflm.model.te_kernels import check_te_device
        from difflm.training.precision import import_te

        import_te()  # its absence is the clearer message
        if device.type != "meta":
            check_te_device(device)
    kernels = build_kernels(cfg, "meta", precision, **te_parallel)
    fp8_weights = getattr(kernels, "fp8_weights_recipe", None) is not None
    if meta:
        if fp8_weights:
            raise DifflmError("precision.fp8_weights=true creates TE's FP8 weights on the GPU and cannot be built "
                              "on the meta device for a parallel layout: set precision.fp8_weights=false")
        return Transformer(cfg, causal=causal, kernels=kernels)
    if fp8_weights:  # TE creates FP8 weights on the GPU directly
        kernels.device = device
    model = Transformer(cfg, causal=causal, kernels=kernels)
    if not fp8_weights:
        model.to_empty(device=device)
    if seed is not None:
        model.init_weights(seed)
    if getattr(cfg, "compile", False):
        compile_blocks(model)
    return model


def build_kernels(cfg, device, precision=None, **te_parallel):
    """The kernel set of ``model.backend`` (``torch`` or ``te``) building on ``device``.

    ``te_parallel`` holds Transformer Engine's process-group arguments (``tp_group``, ``sequence_parallel``,
    ``cp_group``, ...; :func:`difflm.parallel.mesh.te_process_groups`); the torch set takes none.
    Raises: DifflmError for ``te`` without Transformer Engine or CUDA.
    """
    if getattr(cfg, "backend", "torch") == "te":
        from difflm.model.te_kernels import TEKernels

        return TEKernels(cfg, device=device, precision=precision, **te_parallel)
    if te_parallel:
        raise TypeError(f"model.backend=torch takes no TE process groups, got {sorted(te_parallel)}")
    return TorchKernels(cfg, device=device)


def compile_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile`` every block in place (``nn.Module.compile``: parameter names are unchanged).

    Blocks share one compiled graph; the fusions (RMSNorm, RoPE, SwiGLU, residual adds) are what the
    eager torch kernels lack against TE (docs/performance.md).
    """
    for _, layer in model.blocks():
        layer.compile()
    return model


__all__ = ["Transformer", "build_kernels", "build_model", "compile_blocks", "resolve_model_config"]
