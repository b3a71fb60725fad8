"""Numeric precision of a step: ``torch.autocast`` for bf16/fp16, Transformer Engine FP8 for fp8.

Parameters and optimizer state stay FP32 in every mode (mixed precision, Micikevicius et al. 2018);
only the matrix products and activations run in the lower precision.

* ``bf16`` / ``fp16``: ``torch.autocast`` (fp16 adds dynamic loss scaling through
  ``torch.amp.GradScaler`` in the trainer).
* ``fp8``: ``torch.autocast(bfloat16)`` for everything outside Transformer Engine's GEMMs plus
  ``te.autocast(recipe=...)`` (``te.fp8_autocast`` on TE 2.x releases before the rename). Recipes
  (TE docs, "Using FP8 with Transformer Engine", and ``transformer_engine.common.recipe``):

  ============  ===============================  =======================================================
  fp8_recipe    TE recipe                        hardware
  ============  ===============================  =======================================================
  ``delayed``   ``DelayedScaling(HYBRID)``       compute capability >= 8.9 (Ada, Hopper, Blackwell)
  ``current``   ``Float8CurrentScaling(HYBRID)`` compute capability >= 8.9
  ``block``     ``Float8BlockScaling()``         compute capability >= 9.0 and CUDA >= 12.9
  ``mxfp8``     ``MXFP8BlockScaling()``          compute capability 10.x (Blackwell) only
  ============  ===============================  =======================================================

  HYBRID = E4M3 in the forward pass, E5M2 for gradients (Micikevicius et al. 2022, "FP8 Formats for
  Deep Learning"). Transformer Engine is imported only when an FP8 context is built.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Optional, Union

import torch

from difflm.errors import DifflmError

FP8_RECIPES = ("delayed", "current", "block", "mxfp8")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def precision_name(precision) -> str:
    """``precision`` as a name: accepts the string or the ``precision`` config (anything with ``.name``)."""
    return precision if isinstance(precision, str) else precision.name


def compute_dtype(precision) -> Optional[torch.dtype]:
    """Autocast dtype of a precision (bf16 for fp8's non-FP8 operations); None for fp32."""
    return _DTYPES.get(precision_name(precision))


def fp8_unsupported_reason(recipe: str, capability: Optional[tuple[int, int]], cuda_version: Optional[str]) -> Optional[str]:
    """Why ``precision.fp8_recipe=recipe`` cannot run on a GPU, or None when it can.

    Args:
        recipe: one of :data:`FP8_RECIPES`.
        capability: CUDA compute capability (major, minor), None without a GPU.
        cuda_version: ``torch.version.cuda`` (e.g. ``"12.8"``), None for CPU builds.
    The thresholds are Transformer Engine's own (``transformer_engine.pytorch.quantization``:
    ``_compute_fp8_support``, ``_compute_fp8_block_scaling_support``, ``_compute_mxfp8_support``).
    """
    if recipe not in FP8_RECIPES:
        return f"precision.fp8_recipe={recipe!r} is not one of: {', '.join(FP8_RECIPES)}"
    if capability is None:
        return ("precision=fp8 needs an FP8-capable NVIDIA GPU (Ada/Hopper or newer): "
                "use precision=bf16 or precision=fp32 on this machine")
    cc = tuple(capability)
    if cc < (8, 9):
        return (f"precision=fp8 needs compute capability >= 8.9 (this GPU is {cc[0]}.{cc[1]}): "
                "use precision=bf16")
    if recipe == "block":
        cuda = tuple(int(x) for x in (cuda_version or "0.0").split(".")[:2])
        if cc < (9, 0) or cuda < (12, 9):
            return (f"precision.fp8_recipe=block needs compute capability >= 9.0 and CUDA >= 12.9 "
                    f"(found {cc[0]}.{cc[1]}, CUDA {cuda_version}): use precision.fp8_recipe=delayed or current")
    if recipe == "mxfp8" and not (10, 0) <= cc < (12, 0):
        return (f"precision.fp8_recipe=mxfp8 (MXFP8BlockScaling) runs on Blackwell (compute capability 10.x) only, "
                f"this GPU is {cc[0]}.{cc[1]}: on Hopper use precision.fp8_recipe=delayed, current or block")
    return None


def device_fp8_unsupported_reason(recipe: str, device: torch.device) -> Optional[str]:
    """:func:`fp8_unsupported_reason` for a torch device (CPU devices always get a reason)."""
    if device.type != "cuda":
        return fp8_unsupported_reason(recipe, None, None)
    return fp8_unsupported_reason(recipe, torch.cuda.get_device_capability(device), torch.version.cuda)


def te_import_error() -> Optional[str]:
    """Why ``transformer_engine.pytorch`` cannot be imported (exception type and first line), or None when it can.

    TE raises ImportError without its packages, and RuntimeError/OSError when present without its CUDA
    libraries or with a broken plugin (e.g. FlashAttention 4 without its CUTLASS DSL libraries).
    """
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure means "not usable here", reported with its reason
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return None


def import_te():
    """``transformer_engine.pytorch``, or a DifflmError that says why it failed and how to install it."""
    error = te_import_error()
    if error is not None:
        raise DifflmError(f"Transformer Engine could not be imported ({error}): "
                          "pip install 'transformer-engine[pytorch]' on a CUDA machine, "
                          "or use model.backend=torch with precision=bf16")
    import transformer_engine.pytorch as te

    return te


@functools.lru_cache(maxsize=None)
def _recipe(name: str, amax_history_len: int, fp8_dpa: bool):
    from transformer_engine.common import recipe as R

    dpa = {"fp8_dpa": True} if fp8_dpa else {}
    if name == "delayed":
        return R.DelayedScaling(fp8_format=R.Format.HYBRID, amax_history_len=amax_history_len,
                                amax_compute_algo="max", **dpa)
    if name == "current":
        return R.Float8CurrentScaling(fp8_format=R.Format.HYBRID, **dpa)
    if name == "block":
        return R.Float8BlockScaling(**dpa)
    if name == "mxfp8":
        return R.MXFP8BlockScaling(**dpa)
    raise DifflmError(f"precision.fp8_recipe={name!r} is not one of: {', '.join(FP8_RECIPES)}")


def build_fp8_recipe(precision):
    """The Transformer Engine recipe object of ``precision`` (config node, or the name ``"fp8"``).

    One object per distinct setting (cached), so TE sees the same recipe every step.
    Raises: DifflmError for an unknown ``fp8_recipe`` or when TE is missing.
    """
    import_te()
    if isinstance(precision, str):
        name, hist, dpa = "delayed", 1024, False
    else:
        name = precision.fp8_recipe
        hist = int(getattr(precision, "fp8_amax_history_len", 1024))
        dpa = bool(getattr(precision, "fp8_attention", False))
    return _recipe(name, hist, dpa)


def te_autocast(enabled: bool = True, recipe=None, amax_reduction_group=None):
    """``te.autocast`` where it exists (TE >= 2.8), else ``te.fp8_autocast`` (older TE 2.x)."""
    te = import_te()
    if hasattr(te, "autocast"):
        return te.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=amax_reduction_group)
    return te.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=amax_reduction_group)


def quantized_model_init(enabled: bool = True, recipe=None):
    """``te.quantized_model_init`` (TE >= 2.8), else ``te.fp8_model_init``: TE modules built inside
    keep their weights only in FP8 (the optimizer must then hold FP32 master weights)."""
    te = import_te()
    if hasattr(te, "quantized_model_init"):
        return te.quantized_model_init(enabled=enabled, recipe=recipe)
    return te.fp8_model_init(enabled=enabled, recipe=recipe)


def fp8_is_active() -> bool:
    """True inside an enabled TE FP8 autocast region (False when TE is not imported at all)."""
    import sys

    if "transformer_engine.pytorch" not in sys.modules:
        return False
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:  # TE 2.x before the quantization module
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    return bool(FP8GlobalStateManager.is_fp8_enabled())


def autocast_context(precision: Union[str, object], device: torch.device, amax_reduction_group=None):
    """The context a forward pass runs in.

    Args:
        precision: ``fp32 | bf16 | fp16 | fp8``, or the ``precision`` config (needed to pick an FP8 recipe
            other than the default ``delayed``).
        device: where the model runs.
        amax_reduction_group: for fp8, the ranks whose amaxes TE reduces when the region exits (every rank
            holding the same layers: data, context and tensor parallel peers, as Megatron-LM's amax group),
            so all of them quantize with the same scales; None for one process.
    Returns: ``torch.autocast`` for bf16/fp16; for fp8, ``torch.autocast(bfloat16)`` entered first and
        then the TE FP8 autocast with :func:`build_fp8_recipe`; a null context for fp32.
    Raises: DifflmError for fp8 when Transformer Engine cannot be imported.
    """
    name = precision_name(precision)
    if name in ("bf16", "fp16"):
        return torch.autocast(device.type, dtype=_DTYPES[name])
    if name == "fp8":
        return _FP8Autocast(device, build_fp8_recipe(precision), amax_reduction_group)
    return contextlib.nullcontext()


class _FP8Autocast:
    """``torch.autocast(bfloat16)`` then TE's FP8 autocast, entered on ``__enter__`` and left in reverse."""

    def __init__(self, device: torch.device, recipe, amax_reduction_group=None):
        self.device, self.recipe, self._stack = device, recipe, None
        self.group = amax_reduction_group

    def __enter__(self):
        stack = contextlib.ExitStack()
        with stack:  # unwinds what was entered if the TE context fails to enter
            stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
            stack.enter_context(te_autocast(True, self.recipe, self.group))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc):
        stack, self._stack = self._stack, None
        return stack.__exit__(*exc)


__all__ = [
    "FP8_RECIPES", "autocast_context", "build_fp8_recipe", "compute_dtype", "device_fp8_unsupported_reason",
    "fp8_is_active", "fp8_unsupported_reason", "import_te", "te_import_error", "precision_name", "quantized_model_init", "te_autocast",
]
