"""Model construction: the Llama-style transformer, pure PyTorch (``model.backend=torch``) or on
Transformer Engine modules (``model.backend=te``, :mod:`difflm.model.te_backend`, imported lazily)."""
from __future__ import annotations

import torch

from difflm.model.transformer import Transformer


def resolve_model_config(cfg, vocab_size: int) -> None:
    """Fill the keys that come from elsewhere: ``model.vocab_size`` (tokenizer, padded) and ``model.head_dim``."""
    cfg.vocab_size = vocab_size
    if cfg.head_dim is None:
        cfg.head_dim = cfg.hidden_size // cfg.num_heads


def build_model(cfg, *, causal: bool, device: torch.device, seed: int, precision=None, **te_parallel) -> torch.nn.Module:
    """Build on the meta device (no memory), materialise on ``device``, then initialise with ``seed``.

    Args:
        cfg: ``model`` config with ``vocab_size`` and ``head_dim`` resolved. ``model.backend`` picks the
            pure-PyTorch :class:`Transformer` (``torch``) or :class:`difflm.model.te_backend.TETransformer`
            (``te``); both start from the same weights for the same seed. ``model.compile`` compiles each block.
            ``model.moe.num_experts`` > 0 puts a mixture-of-experts MLP in every block (:mod:`difflm.model.moe`).
        causal: attention type (True for the ``ar`` objective).
        precision: the ``precision`` config; the TE backend reads ``fp8_weights`` / ``fp8_skip_first_last``.
        te_parallel: TE process-group arguments (``tp_group``, ``sequence_parallel``, ``cp_group``, ...).
    Returns: a model with FP32 parameters on ``device`` in train mode.
    Raises: DifflmError for ``backend=te`` without Transformer Engine or CUDA.
    """
    if getattr(cfg, "backend", "torch") == "te":
        from difflm.model.te_backend import build_te_model

        model = build_te_model(cfg, causal=causal, device=device, seed=seed, precision=precision, **te_parallel)
    else:
        with torch.device("meta"):
            model = Transformer(cfg, causal=causal)
        model.to_empty(device=device)
        model.init_weights(seed)
    if getattr(cfg, "compile", False):
        compile_blocks(model)
    return model


def compile_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile`` every block in place (``nn.Module.compile``: parameter names are unchanged).

    Blocks share one compiled graph; the fusions (RMSNorm, RoPE, SwiGLU, residual adds) are what the
    eager torch backend lacks against TE (docs/performance.md).
    """
    for layer in model.layers:
        layer.compile()
    return model


__all__ = ["Transformer", "build_model", "compile_blocks", "resolve_model_config"]
