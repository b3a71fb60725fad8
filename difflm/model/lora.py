"""LoRA: low-rank adapters on the attention and MLP projections, applied as a model converter (docs/lora.md).

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3) keeps a weight W [d_out, d_in]
frozen and trains ``h = W x + (alpha / r) B A x`` with A [r, d_in], B [d_out, r]; B = 0 at the start, so the adapted
model begins as the base model. Initialisation and scaling follow ``peft`` (``LoraConfig(init_lora_weights=
"gaussian")``: A ~ N(0, (1/r)^2), B = 0; ``scaling = lora_alpha / r``), drawn with difflm's keyed init
(:func:`difflm.model.init.keyed_normal`, keyed by the adapter's parameter name) so every layout holds the same values.

:func:`apply_lora` converts a built :class:`~difflm.model.transformer.Transformer` in place, after it is built and
before a layout is applied (as torchtitan's Float8 converter). Base parameter names are unchanged
(``layers.0.attention.qkv.weight`` stays where it was: checkpoints, the keyed init, FSDP and the exports keep their
keys); each adapted module gains a ``lora`` ModuleDict keyed by the adapted parameter's name, e.g.
``layers.0.mlp.lora.fc1_weight.lora_A`` [r, d] and ``.lora_B`` [2 f, r]. Every non-adapter parameter is frozen.

Two ways to add ``B A x``, picked per module class:

* input side, the usual LoRA (torch kernels: ``nn.Linear``, :class:`~difflm.model.layers.LayerNormLinear`,
  :class:`~difflm.model.layers.LayerNormMLP`, :class:`~difflm.model.moe.SharedExperts`): the adapter runs on the
  module's own input (after its RMSNorm; ``fc2``'s on the SwiGLU output), with dropout on that input as peft's
  ``lora.Linear``; no weight-sized tensor is formed.
* weight side, for modules whose inputs live inside fused kernels (Transformer Engine's ``Linear``,
  ``LayerNormLinear``, ``LayerNormMLP``; the routed experts' grouped weights [E, d_out, d_in]): during the module's
  forward the parameter is replaced by ``W + (alpha / r) B A`` (per expert for 3-D weights), so TE's fused kernels run
  unchanged. Dropout cannot be factored out of ``B A`` there (peft's ``ParamWrapper`` refuses it for the same reason),
  so ``lora.dropout > 0`` is refused for these modules.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from difflm.errors import DifflmError
from difflm.model.layers import LayerNormLinear, LayerNormMLP, rms_norm

TARGETS = ("qkv", "proj", "fc1", "fc2")  # lora.targets: the attention's QKV and output, the MLP's two projections
MOE_POLICIES = ("freeze_experts", "adapt_experts")
ADAPTER_KEY = ".lora."  # in every adapter parameter's name


def lora_enabled(cfg) -> bool:
    """Whether the ``lora`` config (None or rank 0: off) adds adapters."""
    return cfg is not None and int(cfg.get("rank", 0) or 0) > 0


def is_adapter(name: str) -> bool:
    """Whether the parameter ``name`` (model or state-dict key) is a LoRA factor."""
    return ADAPTER_KEY in f".{name}"


class LoraFactors(nn.Module):
    """The two factors of one adapted weight.

    Args:
        d_in, d_out: the adapted weight is [d_out, d_in] (``experts`` > 0: [experts, d_out, d_in]).
        rank, alpha: r and alpha; ``scaling = alpha / r`` (Hu et al. 2021, sec. 4.1; peft ``LoraConfig``).
        dropout: dropout probability on the adapter's input (input-side modules only).
    Parameters: ``lora_A`` [r, d_in] (or [E, r, d_in]), ``lora_B`` [d_out, r] (or [E, d_out, r]), FP32, created on
    ``device`` uninitialised (:func:`init_adapters_` or :func:`difflm.model.init.megatron_init_` fill them).
    """

    def __init__(self, d_in: int, d_out: int, rank: int, alpha: float, dropout: float = 0.0, experts: int = 0,
                 device=None):
        super().__init__()
        lead = (experts,) if experts else ()
        self.lora_A = nn.Parameter(torch.empty(*lead, rank, d_in, device=device))
        self.lora_B = nn.Parameter(torch.empty(*lead, d_out, rank, device=device))
        self.scaling = float(alpha) / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True  # adapters_disabled() turns it off

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``scaling * B A dropout(x)``: x [..., d_in] -> [..., d_out] (2-D factors only). A plain x meeting DTensor
        factors (a layer run replicated over TP: the MoE's shared experts) takes their local tensors."""
        a, b = _as_input(self.lora_A, x), _as_input(self.lora_B, x)
        return F.linear(F.linear(self.dropout(x), a.to(x.dtype)), b.to(x.dtype)) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """``scaling * B @ A``: [d_out, d_in] (or [E, d_out, d_in]), in the factors' dtype."""
        return (self.lora_B @ self.lora_A) * self.scaling


def _as_input(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``t``, or its local tensor when ``t`` is a DTensor and ``x`` is not (the gradient keeps ``t``'s placements)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) and not isinstance(x, DTensor) else t


def active_factors(module: nn.Module, name: str) -> Optional[LoraFactors]:
    """The enabled :class:`LoraFactors` of ``module``'s parameter ``name``, or None (no adapter, or turned off)."""
    adapters = module._modules.get("lora")
    factors = adapters[name] if adapters is not None and name in adapters else None
    return factors if factors is not None and factors.enabled else None


# ------------------------------------------------------------------ input-side forwards (torch kernels)
def _linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    out = F.linear(x, self.weight, self.bias)
    f = active_factors(self, "weight")
    return out if f is None else out + f(x)


def _norm_linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    h = rms_norm(x, self.layer_norm_weight, self.eps)
    out = F.linear(h, self.weight, self.bias)
    f = active_factors(self, "weight")
    return out if f is None else out + f(h)


def _swiglu_lora(self, h: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
    a = F.linear(h, fc1)
    if (f1 := active_factors(self, "fc1_weight")) is not None:
        a = a + f1(h)
    gate, up = a.chunk(2, dim=-1)
    z = F.silu(gate) * up
    out = F.linear(z, fc2)
    if (f2 := active_factors(self, "fc2_weight")) is not None:
        out = out + f2(z)
    return out


def _norm_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return _swiglu_lora(self, rms_norm(x, self.layer_norm_weight, self.eps), self.fc1_weight, self.fc2_weight)


def _shared_experts_forward(self, x: torch.Tensor) -> torch.Tensor:
    return _swiglu_lora(self, x, _as_input(self.fc1_weight, x), _as_input(self.fc2_weight, x))


def _input_side_forwards() -> dict:
    from difflm.model.moe import SharedExperts

    return {nn.Linear: _linear_forward, LayerNormLinear: _norm_linear_forward, LayerNormMLP: _norm_mlp_forward,
            SharedExperts: _shared_experts_forward}


# ------------------------------------------------------------------ weight-side forward (fused modules)
def _weight_side_forward(self, *args, **kwargs):
    """The base class's forward with each adapted parameter replaced by ``W + scaling B A`` for this call."""
    saved = {}
    try:
        for name, factors in self.lora.items():
            if not factors.enabled:
                continue
            weight = self._parameters[name]
            merged = weight + factors.delta_weight().to(weight.dtype)
            del self._parameters[name]
            object.__setattr__(self, name, merged)
            saved[name] = weight
        return self.lora_base_class.forward(self, *args, **kwargs)  # not super(type(self)): FSDP2 subclasses it
    finally:
        for name, weight in saved.items():
            object.__delattr__(self, name)
            self._parameters[name] = weight


_CLASSES: dict = {}


def _lora_class(cls: type) -> type:
    """``cls`` with a LoRA forward (input side where :func:`_input_side_forwards` has one, else weight side); one
    subclass per base class, so ``isinstance`` checks and parameter names stay those of the base."""
    if cls not in _CLASSES:
        forward = _input_side_forwards().get(cls, _weight_side_forward)
        _CLASSES[cls] = type(f"Lora{cls.__name__}", (cls,), {"forward": forward, "lora_base_class": cls,
                                                              "lora_input_side": forward is not _weight_side_forward})
    return _CLASSES[cls]


def _targets_of(block, cfg) -> Iterator[tuple[str, nn.Module, str]]:
    """(target, module, parameter name) of one block for ``lora.targets`` and the ``lora.moe`` policy."""
    targets = set(cfg.targets)
    attn = block.attention
    if "qkv" in targets:
        yield "qkv", attn.qkv, "weight"
    if "proj" in targets:
        yield "proj", attn.proj, "weight"
    mlp = block.mlp
    experts = getattr(mlp, "experts", None)
    if experts is not None and cfg.moe != "adapt_experts":
        return  # freeze_experts: routed and shared experts stay the base's; the router is always frozen
    for target, pname in (("fc1", "fc1_weight"), ("fc2", "fc2_weight")):
        if target not in targets:
            continue
        if experts is None:
            yield target, mlp, pname
            continue
        yield target, experts, pname
        if getattr(mlp, "shared", None) is not None:
            yield target, mlp.shared, pname


def check_lora(cfg, model_cfg=None) -> None:
    """The ``lora`` keys on their own and against ``model`` (one line each, naming the key).

    Raises: DifflmError for a negative rank, alpha <= 0, dropout outside [0, 1), an unknown target or MoE policy,
    ``model.fused_mlp=true`` (quack's kernels read the weights themselves), dropout with ``model.backend=te``, or
    an MoE model with nothing adapted (``lora.moe=freeze_experts``, MLP targets only, no dense block).
    """
    if cfg is None:
        return
    rank = int(cfg.rank)
    if rank < 0:
        raise DifflmError(f"lora.rank={rank} must be >= 0 (0 turns LoRA off)")
    if rank == 0:
        return
    if not float(cfg.alpha) > 0:
        raise DifflmError(f"lora.alpha={cfg.alpha} must be positive (the adapters are scaled by alpha / rank)")
    if not 0.0 <= float(cfg.dropout) < 1.0:
        raise DifflmError(f"lora.dropout={cfg.dropout} must be in [0, 1)")
    bad = [t for t in cfg.targets if t not in TARGETS]
    if bad or not len(cfg.targets):
        raise DifflmError(f"lora.targets={list(cfg.targets)}: choose a non-empty subset of {list(TARGETS)}")
    if cfg.moe not in MOE_POLICIES:
        raise DifflmError(f"lora.moe={cfg.moe!r} is not one of: {', '.join(MOE_POLICIES)}")
    if model_cfg is None:
        return
    name, width = _narrowest_adapted_weight(cfg, model_cfg)
    if name is not None and rank > width:
        raise DifflmError(f"lora.rank={rank} is above the width of {name} ({width}): B A cannot have a rank above "
                          f"{width}, and the extra factors only add parameters; set lora.rank <= {width}")
    if _moe_blocks_unadapted(cfg, model_cfg) and int(model_cfg.moe.get("first_k_dense", 0) or 0) == 0:
        raise DifflmError(f"lora.targets={list(cfg.targets)} with lora.moe=freeze_experts adapts no weight of this "
                          "MoE model; add qkv or proj to lora.targets, or set lora.moe=adapt_experts")
    if bool(model_cfg.get("fused_mlp", False)):
        raise DifflmError("lora.rank > 0 with model.fused_mlp=true: quack's fused MLP reads its weights inside its "
                          "kernels; set model.fused_mlp=false")
    if model_cfg.get("backend", "torch") == "te" and float(cfg.dropout) > 0:
        raise DifflmError(f"lora.dropout={cfg.dropout} with model.backend=te: TE's fused modules take the adapter as a "
                          "weight update, where dropout cannot apply; set lora.dropout=0 or model.backend=torch")


SHAPE_KEYS = ("rank", "targets", "moe")  # the lora.* keys that decide which adapters exist and their shapes


def check_resume_lora(saved, cfg, where: str) -> None:
    """Refuse resuming adapters saved under ``saved`` (the ``lora`` config of the checkpoint ``where``) with other
    :data:`SHAPE_KEYS` in ``cfg``: the checkpoint holds other adapters than the model would build. One line naming
    the key, the saved value and the fix. ``lora.alpha`` / ``lora.dropout`` may change (a resume reports it)."""
    if saved is None or not lora_enabled(saved) or not lora_enabled(cfg):
        return
    show = lambda v: f"[{','.join(str(t) for t in v)}]" if not isinstance(v, (str, int)) else v  # noqa: E731
    for key in SHAPE_KEYS:
        old, new = saved.get(key), cfg.get(key)
        if old is None or new is None:
            continue
        same = sorted(old) == sorted(new) if key == "targets" else old == new
        if not same:
            raise DifflmError(f"lora.{key}={show(new)}: {where} holds the adapters of lora.{key}={show(old)}; resume "
                              f"with lora.{key}={show(old)}, or start a new run.dir")


def _narrowest_adapted_weight(cfg, model_cfg) -> tuple[Optional[str], int]:
    """(a description, min(d_in, d_out)) of the adapted weight of ``model_cfg`` with the smallest side under the
    ``lora`` config ``cfg`` (its ``targets`` and ``moe`` policy); (None, 0) when the dimensions are not all set."""
    try:
        d, hd = int(model_cfg.hidden_size), int(model_cfg.head_dim)
        h, kv, f = int(model_cfg.num_heads), int(model_cfg.num_kv_heads), int(model_cfg.ffn_hidden_size)
    except (TypeError, ValueError, AttributeError, KeyError):
        return None, 0
    t = set(cfg.targets)
    sides = {"attention.qkv": (d, (h + 2 * kv) * hd), "attention.proj": (h * hd, d)}
    sides = {k: v for k, v in sides.items() if k.split(".")[1] in t}
    moe = model_cfg.get("moe")
    experts = int(moe.get("num_experts", 0) or 0) if moe is not None else 0
    mlp = {}
    if experts == 0 or int(moe.get("first_k_dense", 0) or 0) > 0:
        mlp["mlp"] = f
    if experts and cfg.get("moe", "freeze_experts") == "adapt_experts":
        mlp["the routed experts' mlp"] = int(moe.get("ffn_hidden_size", 0) or 0) or f
        if int(moe.get("num_shared_experts", 0) or 0) > 0:
            from difflm.model.moe import shared_ffn_size

            mlp["the shared experts' mlp"] = shared_ffn_size(model_cfg)
    for where, width in mlp.items():
        if "fc1" in t:
            sides[f"{where}.fc1_weight"] = (d, 2 * width)
        if "fc2" in t:
            sides[f"{where}.fc2_weight"] = (width, d)
    if not sides:
        return None, 0
    name = min(sides, key=lambda k: min(sides[k]))
    d_in, d_out = sides[name]
    return f"{name} [{d_out}, {d_in}]", min(d_in, d_out)


def _moe_blocks_unadapted(cfg, model_cfg) -> bool:
    """Whether the MoE blocks of ``model_cfg`` get no adapter (``lora.moe=freeze_experts``, MLP targets only)."""
    moe = model_cfg.get("moe")
    return (moe is not None and int(moe.get("num_experts", 0) or 0) > 0 and cfg.moe == "freeze_experts"
            and not {"qkv", "proj"} & set(cfg.targets))


def check_lora_layout(cfg, dims, model_cfg=None) -> None:
    """Refuse, in one line naming the key, what LoRA's layouts do not cover: pipeline stages of MoE blocks without
    adapters (:func:`_moe_blocks_unadapted`: they would train nothing); under ``parallel.tp`` > 1 the TE kernels (plain
    local shards, no DTensor layout for the adapters) and dropout (the masks of a sharded input are not one
    process's). DDP/FSDP2/HSDP, DTensor TP (:mod:`difflm.parallel.tp_adapters`), pipeline stages (each holds its
    blocks' adapters), context parallelism (per-token maps, replicated over cp) and expert parallelism (expert
    adapters sharded with their experts, :func:`difflm.parallel.expert_parallel.apply_expert_parallel`) take them."""
    if not lora_enabled(cfg):
        return
    pp = int(getattr(dims, "pp", 1) or 1)
    if pp > 1 and model_cfg is not None and _moe_blocks_unadapted(cfg, model_cfg):
        raise DifflmError(f"lora.targets={list(cfg.targets)} with lora.moe=freeze_experts and parallel.pp={pp}: the "
                          "MoE blocks hold no adapter, so a stage of them would train nothing; add qkv or proj to "
                          "lora.targets, or set lora.moe=adapt_experts")
    tp = int(getattr(dims, "tp", 1) or 1)
    if tp == 1:
        return
    if model_cfg is not None and model_cfg.get("backend", "torch") == "te":
        raise DifflmError(f"lora.rank={cfg.rank} with parallel.tp={tp} and model.backend=te: LoRA under tensor "
                          "parallelism runs on the torch kernels' DTensor layout; set model.backend=torch or "
                          "parallel.tp=1")
    if float(cfg.dropout) > 0:
        raise DifflmError(f"lora.dropout={cfg.dropout} with parallel.tp={tp}: the adapters' dropout masks on "
                          "TP-sharded inputs differ from one process's; set lora.dropout=0 or parallel.tp=1")


def apply_lora(model: nn.Module, cfg, seed: Optional[int] = None) -> list[str]:
    """Add LoRA adapters to ``model`` in place and freeze everything else (the model converter).

    Args:
        model: a :class:`~difflm.model.transformer.Transformer` (any kernel set), on the meta device (a layout
            materialises it later: :func:`difflm.model.init.megatron_init_` initialises the factors by name) or
            materialised (then ``seed`` initialises the factors here, with the same keyed values).
        cfg: the ``lora`` config (``rank``, ``alpha``, ``dropout``, ``targets``, ``moe``).
        seed: ``train.seed`` for the factors' keyed init; None leaves them uninitialised.
    Returns: the adapted parameters' names (e.g. ``layers.0.attention.qkv.weight``).
    Raises: DifflmError for bad ``lora`` keys (:func:`check_lora`), a model that already has adapters, or dropout on
        a weight-side module.
    """
    check_lora(cfg)
    if any(is_adapter(n) for n, _ in model.named_parameters()):
        raise DifflmError("the model already has LoRA adapters")
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = []
    names = {id(m): n for n, m in model.named_modules()}
    for _, block in model.blocks():
        for _target, module, pname in _targets_of(block, cfg):
            weight = module._parameters[pname]
            experts = weight.shape[0] if weight.dim() == 3 else 0
            d_out, d_in = weight.shape[-2], weight.shape[-1]
            cls = type(module) if type(module) in _CLASSES.values() else _lora_class(type(module))
            if not cls.lora_input_side and float(cfg.dropout) > 0:
                raise DifflmError(f"lora.dropout={cfg.dropout}: {type(module).__name__} takes its adapter as a weight "
                                  "update, where dropout cannot apply; set lora.dropout=0")
            if getattr(module, "main_grad_weight_names", ()):  # difflm.model.te_kernels.MAIN_GRAD_NAMES
                raise DifflmError("LoRA on TE modules built with model.fuse_wgrad_accumulation=true: frozen weights "
                                  "have no gradient to accumulate; build with model.fuse_wgrad_accumulation=false")
            if experts and cls.lora_input_side:
                raise DifflmError(f"{type(module).__name__}: 3-D weights need the weight-side adapter")
            if "lora" not in module._modules:
                module.lora = nn.ModuleDict()
            module.lora[pname] = LoraFactors(d_in, d_out, int(cfg.rank), float(cfg.alpha), float(cfg.dropout),
                                             experts, device=weight.device)
            module.__class__ = cls
            adapted.append(f"{names[id(module)]}.{pname}")
    if seed is not None and not any(p.is_meta for p in model.parameters()):
        init_adapters_(model, seed)
    return adapted


@torch.no_grad()
def init_adapters_(model: nn.Module, seed: int, locate=None) -> None:
    """Keyed init of every adapter of ``model``: A ~ N(0, (1/r)^2), B = 0 (peft's ``init_lora_weights="gaussian"``),
    the values :func:`difflm.model.init.megatron_init_` gives any layout. ``locate`` (a
    :class:`difflm.parallel.materialize.ShardLocator` of a laid-out model; None: whole parameters) says which rows of
    which full tensor a sharded parameter holds."""
    from difflm.model.init import keyed_normal

    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue
        local = p.to_local() if hasattr(p, "to_local") else p
        if name.endswith("lora_B"):
            local.zero_()
            continue
        full_name, full_shape, index = locate(name, p) if locate is not None else (name, p.shape, (None, None))
        if local.numel():
            local.copy_(keyed_normal(seed, full_name, full_shape, index, adapter_init_std(full_shape))
                        .reshape(local.shape))


def adapter_init_std(shape) -> float:
    """Standard deviation of a ``lora_A`` factor [..., r, d_in]: 1 / r (peft's ``"gaussian"`` init)."""
    return 1.0 / int(shape[-2])


def adapter_factors(model: nn.Module) -> Iterator[tuple[str, LoraFactors]]:
    """(adapted parameter name, its :class:`LoraFactors`) of every adapter of ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, LoraFactors):
            owner, _, pname = name.rpartition(".lora.")
            yield f"{owner}.{pname}", module


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Run ``model`` (one module, or a list of a rank's model parts) as its base model: every adapter off inside
    the block, back on (as it was) after it. The frozen reference of a LoRA run (DESIGN.md "Post-training") without
    a second copy of the weights. Not re-entrant across threads."""
    parts = model if isinstance(model, (list, tuple)) else [model]
    factors = [m for part in parts for m in part.modules() if isinstance(m, LoraFactors)]
    before = [f.enabled for f in factors]
    for f in factors:
        f.enabled = False
    try:
        yield model
    finally:
        for f, on in zip(factors, before):
            f.enabled = on


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of ``model`` (whole tensors) with every adapter merged into its base weight,
    ``W + (alpha / r) B A`` (Hu et al. 2021, sec. 4.1 "No additional inference latency"), and no adapter keys: the
    base model's keys, loadable into a model without LoRA. Adapters turned off (:func:`adapters_disabled`) are left
    out: inside that block this is the base model's state dict."""
    state = {k: v for k, v in model.state_dict().items() if not is_adapter(k)}
    for name, factors in adapter_factors(model):
        if not factors.enabled:
            continue
        state[name] = (state[name].float() + factors.delta_weight().float()).to(state[name].dtype)
    return state


def trainable_parameter_count(model: nn.Module) -> int:
    """Parameters that require gradients (after :func:`apply_lora`: the adapters only)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def expected_adapter_count(model_cfg, cfg) -> int:
    """``sum over adapted weights of r * (d_in + d_out)`` (times the experts for routed-expert weights) for a model
    config, from the dimensions alone (docs/lora.md)."""
    if not lora_enabled(cfg):
        return 0
    d, hd, r = int(model_cfg.hidden_size), int(model_cfg.head_dim), int(cfg.rank)
    h, kv = int(model_cfg.num_heads), int(model_cfg.num_kv_heads)
    per_layer = 0
    t = set(cfg.targets)
    if "qkv" in t:
        per_layer += r * (d + (h + 2 * kv) * hd)
    if "proj" in t:
        per_layer += r * (h * hd + d)
    layers = int(model_cfg.num_layers)
    moe = model_cfg.get("moe")
    experts = int(moe.num_experts) if moe is not None else 0
    dense = layers if experts == 0 else int(getattr(moe, "first_k_dense", 0) or 0)  # the dense first blocks' MLPs
    mlp = [(dense, 1, int(model_cfg.ffn_hidden_size))]
    if experts and cfg.moe == "adapt_experts":
        from difflm.model.moe import expert_ffn_size, shared_ffn_size

        mlp += [(layers - dense, experts, expert_ffn_size(model_cfg)), (layers - dense, 1, shared_ffn_size(model_cfg))]
    total = layers * per_layer
    for blocks, n, f in mlp:
        if f == 0:  # no shared experts
            continue
        if "fc1" in t:
            total += blocks * n * r * (d + 2 * f)
        if "fc2" in t:
            total += blocks * n * r * (f + d)
    return total


__all__ = ["LoraFactors", "active_factors", "adapter_factors", "adapters_disabled", "apply_lora", "check_lora",
           "check_lora_layout", "check_resume_lora", "expected_adapter_count", "init_adapters_", "is_adapter",
           "lora_enabled", "merged_state_dict", "trainable_parameter_count"]
