"""``auto``: the fastest kernels that are installed and valid for a run, chosen once before the model is built.

``model.backend``, ``model.attention_backend``, ``model.fused_mlp`` and ``model.fused_mlp_autotune`` default to
``auto``. :func:`choose_kernels` replaces every ``auto`` in a composed run config with a concrete value, in this
order, each step falling back to the next candidate when one is missing or cannot take the run:

* ``model.backend``: ``te`` (Transformer Engine's fused norm + GEMM modules, FP8) when it imports on a CUDA device
  and the run does not ask for what only the torch kernels do (``model.compile``, MoE under tensor parallelism);
  else ``torch``.
* ``model.attention_backend``: ``te`` where the layout or precision needs it (context parallelism under the TE
  kernels, FP8 and ``precision.fp8_attention``); else FlashAttention 4 (``flash``, ``flash_attn.cute``) for
  BF16/FP16 attention without a mask it cannot take (not ``objective=bd3lm``, not context parallelism); else
  ``te`` under the TE kernels (cuDNN fused attention); else ``sdpa`` (cuDNN / flash kernels through PyTorch, and the
  CPU's).
* ``model.fused_mlp``: quack's fused norm + SwiGLU MLP + residual GEMMs (:mod:`difflm.kernels.quack_mlp`) for the TE
  kernels in BF16 on a Hopper/Blackwell GPU with quack installed, for a dense model without tensor parallelism or
  CUDA graphs.
* ``model.fused_mlp_autotune``: with the fused MLP, for models of ``hidden_size >= 1024`` (quack tunes each
  training GEMM shape once, minutes, kept in its disk cache; below that width the default tiles lose little).
* ``model.moe.fused_experts``: quack's grouped GEMMs for the routed experts (:mod:`difflm.kernels.quack_experts`:
  SwiGLU and the FP32 ``main_grad`` accumulation in the GEMMs' epilogues) for an MoE model on the TE kernels in BF16
  on a Hopper/Blackwell GPU with quack, where the experts' gradients accumulate in ``main_grad``
  (:func:`difflm.kernels.main_grad.accumulates_in_main_grad`: no data / context parallel ranks, no pipeline, no
  LoRA) and ``model.moe.fp8_experts`` is off; else the ``torch._grouped_mm`` experts.

The order is the one the benchmark measured fastest on an H200 (docs/performance.md: TE + FA4 + fused, autotuned
MLP ahead of TE + cuDNN attention ahead of SDPA; docs/moe.md: the fused experts 1.33x the grouped-GEMM ones). On a
CPU every ``auto`` resolves to what runs there (``torch``, ``sdpa``, no fused MLP, the grouped-GEMM experts). An explicit value is kept as given, and the checks of :mod:`difflm.config.validate` refuse
it in one line when it cannot run. The result is written back into the config (so ``config.yaml`` of a run records
what ran) together with :attr:`KernelChoice.line` in ``model.auto_reason``; the same line is what the trainer
prints first.

The probes (:func:`te_import_error`, :func:`fa4_installed`, :func:`quack_reason`) are module-level so tests can
pretend any installation; ``choose_kernels(..., installed=...)`` answers them for a machine that is not this one
(:data:`FULL_INSTALL`: what ``difflm-plan`` assumes of the GPU it plans for).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from difflm.config.schema import override_value
from difflm.errors import DifflmError

AUTO = "auto"
KEYS = ("backend", "attention_backend", "fused_mlp", "fused_mlp_autotune")
MOE_KEY = "moe.fused_experts"  # chosen for MoE models only (model.moe is None for dense ones)
AUTOTUNE_MIN_HIDDEN = 1024  # quack's tuned tiles pay at the 1.7B shape (docs/performance.md, "fused MLP")


def te_import_error() -> Optional[str]:
    """Why Transformer Engine cannot be imported here, or None (:func:`difflm.training.precision.te_import_error`)."""
    from difflm.training.precision import te_import_error as probe

    return probe()


def fa4_installed() -> bool:
    """Whether FlashAttention 4 (``flash_attn.cute``) is the FlashAttention that :mod:`difflm.model.attention` runs."""
    from difflm.model.attention import flash_attn_module

    found = flash_attn_module()
    return found is not None and found[1] == 4


def quack_reason(device: torch.device) -> Optional[str]:
    """Why quack's fused MLP cannot run on ``device``, or None (:func:`difflm.kernels.quack_mlp.quack_unavailable_reason`)."""
    from difflm.kernels.quack_mlp import quack_unavailable_reason

    return quack_unavailable_reason(device)


@dataclass(frozen=True)
class Installed:
    """The probes' answers for a machine other than this one: ``te_error`` (:func:`te_import_error`, None: Transformer
    Engine imports), ``fa4`` (:func:`fa4_installed`), ``quack_error`` (:func:`quack_reason`, None: quack runs)."""

    te_error: Optional[str] = None
    fa4: bool = True
    quack_error: Optional[str] = None


# a Hopper or Blackwell GPU with difflm's te, flash and quack extras installed (pyproject.toml)
FULL_INSTALL = Installed()


@dataclass
class KernelChoice:
    """What :func:`choose_kernels` picked. ``values``: key -> value for the keys of :data:`KEYS`, and :data:`MOE_KEY`
    for MoE models; ``why``: key -> the reason, for the keys that were ``auto`` only."""

    values: dict = field(default_factory=dict)
    why: dict = field(default_factory=dict)

    @property
    def line(self) -> str:
        """One line: ``kernels auto on cuda: model.backend=te (...), model.attention_backend=flash (...), ...``;
        empty when no key was ``auto``."""
        if not self.why:
            return ""
        parts = [f"model.{k}={override_value(self.values[k])} ({self.why[k]})" for k in (*KEYS, MOE_KEY) if k in self.why]
        return f"kernels auto on {self.values['device']}: " + ", ".join(parts)


def is_auto(value) -> bool:
    return isinstance(value, str) and value == AUTO


def _flag(value, key: str) -> bool:
    """An explicit ``true``/``false`` (YAML bool, or its string from a command line) as a bool."""
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in ("true", "false"):
        return text == "true"
    raise DifflmError(f"model.{key}={value!r} is not one of: auto, true, false")


def choose_kernels(cfg, device: torch.device, world_size: int = 1, forward_only: bool = False,
                   installed: Optional[Installed] = None) -> KernelChoice:
    """Resolve the ``auto`` values of ``cfg.model`` (see the module docstring) for a run on ``device``, in place.

    Args:
        cfg: the composed run config (``model``, ``precision``, ``objective``, ``parallel``, ``data``, ``train``).
        device: the run's device (:func:`difflm.config.validate.resolve_device`).
        world_size: processes of the run (unused by the rules today; the layout comes from ``parallel``).
        forward_only: sampling and evaluation (``difflm-generate``, ``difflm-eval``): attention through SDPA, which
            takes the dense masks of padded prompts and cached blocks.
        installed: the probes' answers for another machine (:class:`Installed`; ``difflm-plan`` passes
            :data:`FULL_INSTALL` with a CUDA ``device``); None: probe this one.
    Returns: the :class:`KernelChoice`; ``cfg.model`` then holds concrete values and ``model.auto_reason`` its line
        (unchanged when nothing was ``auto``; calling again is a no-op).
    Raises: DifflmError for ``precision=fp8`` when Transformer Engine, the only FP8 path, cannot be imported, and for a
        ``fused_mlp`` value that is neither auto nor a bool.
    """
    m = cfg.model
    if not unresolved(cfg):  # nothing to choose (explicit values, or chosen already)
        values = {k: _get(m, k) for k in KEYS}
        if _get(m, MOE_KEY) is not None:
            values[MOE_KEY] = _get(m, MOE_KEY)
        return KernelChoice(values={"device": device.type, **values})
    p, o, par = cfg.precision, cfg.objective, cfg.parallel
    t = cfg.train
    choice = KernelChoice(values={"device": device.type})
    cuda = device.type == "cuda"
    precision = p.name
    moe = m.get("moe")
    experts = int(moe.num_experts) if moe is not None else 0
    tp, cp = int(par.get("tp", 1)), int(par.get("cp", 1))
    fp8_attention = bool(p.get("fp8_attention", False))
    lora = cfg.get("lora") is not None and int(cfg.lora.get("rank", 0) or 0) > 0  # difflm.model.lora.lora_enabled

    # --- model.backend
    backend = m.backend
    if is_auto(backend):
        te_error = (te_import_error() if installed is None else installed.te_error) if cuda else None
        if not cuda:
            backend, why = "torch", f"{device.type}: Transformer Engine runs CUDA kernels only"
        elif m.get("compile", False):
            backend, why = "torch", "model.compile=true compiles the torch kernels"
        elif te_error is not None:
            if precision == "fp8" and not forward_only:
                raise DifflmError(f"precision=fp8 runs through Transformer Engine, which could not be imported "
                                  f"({te_error}): pip install 'difflm[te]', or use precision=bf16")
            backend, why = "torch", f"Transformer Engine does not import ({te_error.split(':')[0]})"
        elif tp > 1 and experts:
            backend, why = "torch", "MoE layers under parallel.tp>1 run on the torch kernels"
        elif tp > 1 and lora:
            backend, why = "torch", "LoRA under parallel.tp>1 runs on the torch kernels' DTensor layout"
        else:
            backend, why = "te", "Transformer Engine imports"
        m.backend = backend
        choice.why["backend"] = why
    choice.values["backend"] = backend

    # --- model.attention_backend
    attention = m.attention_backend
    if is_auto(attention):
        attention, why = _attention(backend, cuda, precision, o.name, cp, fp8_attention, device, forward_only,
                                    installed)
        m.attention_backend = attention
        choice.why["attention_backend"] = why
    choice.values["attention_backend"] = attention

    # --- model.fused_mlp
    fused = m.get("fused_mlp", False)
    if is_auto(fused):
        fused, why = _fused_mlp(backend, cuda, precision, experts, tp, bool(t.get("cuda_graphs", False)), device,
                                lora, installed)
        choice.why["fused_mlp"] = why
    else:
        fused = _flag(fused, "fused_mlp")
    m.fused_mlp = fused
    choice.values["fused_mlp"] = fused

    # --- model.fused_mlp_autotune
    tune = m.get("fused_mlp_autotune", False)
    if is_auto(tune):
        if not fused:
            tune, why = False, "no fused MLP"
        elif int(m.hidden_size) < AUTOTUNE_MIN_HIDDEN:
            tune, why = False, f"model.hidden_size={m.hidden_size} < {AUTOTUNE_MIN_HIDDEN}: default tiles"
        else:
            tune, why = True, "each GEMM shape tuned once, kept in quack's disk cache"
        choice.why["fused_mlp_autotune"] = why
    else:
        tune = _flag(tune, "fused_mlp_autotune")
    m.fused_mlp_autotune = tune
    choice.values["fused_mlp_autotune"] = tune

    # --- model.moe.fused_experts
    if moe is not None:
        value = moe.get("fused_experts", False)
        if is_auto(value) and not experts:
            value = False  # a dense model: nothing to choose, nothing to say
        elif is_auto(value):
            value, why = _fused_experts(cfg, backend, cuda, precision, device, forward_only, installed)
            choice.why[MOE_KEY] = why
        else:
            value = _flag(value, "moe.fused_experts")
        moe.fused_experts = value
        if experts:
            choice.values[MOE_KEY] = value

    if choice.why and "auto_reason" in m:
        m.auto_reason = choice.line
    return choice


def _attention(backend: str, cuda: bool, precision: str, objective: str, cp: int, fp8_attention: bool,
               device: torch.device, forward_only: bool = False,
               installed: Optional[Installed] = None) -> tuple[str, str]:
    """(attention backend, reason) for ``model.attention_backend=auto``."""
    if not cuda:
        return "sdpa", f"{device.type}: PyTorch's SDPA"
    if forward_only:
        return "sdpa", "sampling and evaluation pass dense masks (padded prompts, cached blocks)"
    if cp > 1:  # the context-parallel paths: TE's inside its module, PyTorch's patching SDPA
        return ("te", "parallel.cp>1 runs inside te.DotProductAttention") if backend == "te" else \
            ("sdpa", "parallel.cp>1 patches SDPA")
    if backend == "te" and (precision == "fp8" or fp8_attention):
        return "te", "precision=fp8: TE's attention (FP8 with precision.fp8_attention)"
    if objective == "bd3lm":
        return "sdpa", "objective=bd3lm needs the block-diffusion mask, which FlashAttention and TE do not take"
    if precision in ("bf16", "fp16") and (fa4_installed() if installed is None else installed.fa4):
        return "flash", f"FlashAttention 4 imports, {precision}, no mask it cannot take"
    missing = "FlashAttention 4 not installed" if precision in ("bf16", "fp16") else f"precision={precision}"
    if backend == "te":
        return "te", f"{missing}: TE's cuDNN attention"
    return "sdpa", f"{missing}: PyTorch's SDPA (cuDNN first on Hopper)"


def _fused_mlp(backend: str, cuda: bool, precision: str, experts: int, tp: int, cuda_graphs: bool,
               device: torch.device, lora: bool = False, installed: Optional[Installed] = None) -> tuple[bool, str]:
    """(fused MLP on, reason) for ``model.fused_mlp=auto``."""
    if not cuda:
        return False, f"{device.type}: quack runs CUDA kernels only"
    if lora:
        return False, "lora.rank>0 (quack's kernels read the MLP weights themselves, without the adapters)"
    if backend != "te":
        return False, "a slot of the TE kernel set"
    if precision != "bf16":
        return False, f"precision={precision}: quack's GEMMs here are BF16"
    if experts:
        return False, "MoE layers (it fuses the dense MLP)"
    if tp > 1:
        return False, "parallel.tp>1 (TE's LayerNormMLP splits over TP)"
    if cuda_graphs:
        return False, "train.cuda_graphs=true graphs TE's own modules"
    reason = quack_reason(device) if installed is None else installed.quack_error
    if reason is not None:
        return False, "quack cannot run here"
    return True, "quack on a Hopper/Blackwell GPU, BF16, dense"


def _fused_experts(cfg, backend: str, cuda: bool, precision: str, device: torch.device,
                   forward_only: bool = False, installed: Optional[Installed] = None) -> tuple[bool, str]:
    """(fused experts on, reason) for ``model.moe.fused_experts=auto``. The layout is read from the ``parallel``
    degrees as given: one of ``dp_replicate``, ``dp_shard``, ``cp`` at -1 (the rest of the world) or above 1 may shard
    the gradients (FSDP2), so the experts keep the grouped-GEMM kernels there."""
    from difflm.kernels.main_grad import accumulates_in_main_grad

    par = cfg.parallel
    if not cuda:
        return False, f"{device.type}: quack runs CUDA kernels only"
    if forward_only:
        return False, "sampling and evaluation: the grouped-GEMM experts (the fused ones keep training's main_grad)"
    if backend != "te":
        return False, "the experts' main_grad kernels are the TE kernel set's"
    if precision != "bf16":
        return False, f"precision={precision}: quack's grouped GEMMs here are BF16"
    if bool(_flag(cfg.model.moe.get("fp8_experts", False), "moe.fp8_experts")):
        return False, "model.moe.fp8_experts=true runs the same GEMMs"
    sharded = any(int(par.get(k, 1)) != 1 for k in ("dp_replicate", "dp_shard", "cp"))
    if not accumulates_in_main_grad(cfg, sharded=sharded, pipelined=int(par.get("pp", 1)) != 1):
        return False, "no FP32 main_grad accumulation (data / context parallel ranks, a pipeline, LoRA or " \
                      "model.fuse_wgrad_accumulation=false)"
    reason = quack_reason(device) if installed is None else installed.quack_error
    if reason is not None:
        return False, "quack cannot run here"
    return True, "quack's grouped GEMMs, SwiGLU and main_grad in their epilogues"


def _get(model_cfg, key: str):
    """``model_cfg``'s value of a :data:`KEYS` entry or :data:`MOE_KEY` (None for a dense model, which has no experts
    to choose kernels for)."""
    if key.startswith("moe."):
        moe = model_cfg.get("moe")
        return None if moe is None or not int(moe.get("num_experts", 0) or 0) else moe.get(key[4:])
    return model_cfg.get(key)


def unresolved(cfg) -> list[str]:
    """The keys of ``cfg.model`` still ``auto`` (empty after :func:`choose_kernels`)."""
    return [f"model.{k}" for k in (*KEYS, MOE_KEY) if is_auto(_get(cfg.model, k))]


# what every ``auto`` key becomes on a CPU, where only the torch kernels run
CPU_CHOICE = {"backend": "torch", "attention_backend": "sdpa", "fused_mlp": False, "fused_mlp_autotune": False}


def cpu_kernels(model_cfg, keep_explicit: bool = True):
    """A copy of ``model_cfg`` with the kernels that run on a CPU (:data:`CPU_CHOICE`, and the MoE experts'
    ``torch._grouped_mm`` path), for the host-side builds that convert or count weights (import, planning): every
    kernel set holds the same parameters. ``keep_explicit``: only the keys still ``auto`` change."""
    out = model_cfg.copy()
    for key, value in CPU_CHOICE.items():
        if not keep_explicit or is_auto(out.get(key)):
            out[key] = value
    moe = out.get("moe")
    if moe is not None and (not keep_explicit or is_auto(moe.get("fused_experts"))):
        moe.fused_experts = False
    return out


__all__ = ["AUTO", "CPU_CHOICE", "FULL_INSTALL", "KEYS", "MOE_KEY", "Installed", "KernelChoice", "choose_kernels",
           "cpu_kernels", "is_auto", "unresolved"]
