"""The settings of one generation call, shared by every sampler (:class:`GenerationOptions`).

:func:`difflm.sampling.diffusion_generate` (LLaDA), :func:`difflm.sampling.block_diffusion_generate` (BD3-LM) and
:func:`difflm.sampling.autoregressive_generate` take one :class:`GenerationOptions`, built once from the ``gen.*``
config and the model's facts by :meth:`GenerationOptions.from_config`; each sampler reads the fields it uses.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from difflm.errors import DifflmError

REMASKING = ("low_confidence", "random", "margin", "entropy")
# ReMDM (Wang et al. 2025): low_confidence unmasking plus remasking of decoded tokens (difflm.sampling.remdm)
REMDM = "remdm"
REMDM_SCHEDULES = ("cap", "rescale")
CACHES = ("none", "prefix", "dual")
# GenerationOptions fields that only the diffusion samplers read (the autoregressive one ignores them)
DIFFUSION_ONLY = ("steps", "block_length", "remasking", "cfg_scale", "threshold", "cache", "remdm_sigma",
                  "remdm_schedule")


class GenerationConfigError(DifflmError, ValueError):
    """A bad ``gen.*`` setting (a ``ValueError`` that the CLI prints as one line)."""


# gen.block_length=null on a run without blocks of its own (every objective but bd3lm): LLaDA's semi-autoregressive
# blocks of this many tokens (difflm-rl's rollouts: difflm.config.schema.RL_BLOCK_LENGTH)
DEFAULT_BLOCK_LENGTH = 64


def run_block_size(objective) -> Optional[int]:
    """The block size a run decodes in by construction: ``objective.block_size`` of a ``bd3lm`` run (an objective
    config, or anything with ``name`` and ``block_size``); None for the other objectives and for None."""
    if objective is None or getattr(objective, "name", None) != "bd3lm":
        return None
    return int(objective.block_size)


def resolve_block_length(block_length: Optional[int], block_size: Optional[int] = None,
                         default: int = DEFAULT_BLOCK_LENGTH) -> int:
    """The block length a sampler decodes in for ``gen.block_length``: a value given is that value (the LLaDA
    sampler honours it; on a ``bd3lm`` run :meth:`GenerationOptions.check_block_diffusion` refuses one other than the
    run's block size); null is the run's block size: ``block_size`` (:func:`run_block_size`) for a ``bd3lm`` run,
    else ``default``. What every sampler entry point reads ``gen.block_length`` through (difflm-generate, difflm-rl,
    the end-of-training samples, the lm-eval harness, the HF export)."""
    if block_length is not None:
        return int(block_length)
    return int(block_size) if block_size is not None else int(default)


def unread_stored_settings(objective: Optional[str]) -> dict:
    """What a run's stored ``gen.*`` (its ``config.yaml``) is reset to before a caller's keys are laid over it, for
    the keys that run's own sampler never read: an ``ar`` run's diffusion-only keys (their defaults; left-to-right
    decoding), a ``bd3lm`` run's ``block_length`` (null: it decodes in its ``objective.block_size``, and its record
    may hold the schema's former default 64). ``objective``: the run's objective name."""
    if objective == "ar":
        return dict(DIFFUSION_DEFAULTS)
    if objective == "bd3lm":
        return {"block_length": None}
    return {}


@dataclass(frozen=True)
class GenerationOptions:
    """Sampler settings: the ``gen.*`` keys plus the facts of the model and tokenizer that a sampler needs.

    Fields (config key in brackets; samplers that read it):
        mask_id: the mask token id (diffusion samplers).
        length: tokens to generate [``gen.length``] (all).
        steps: denoising steps in all [``gen.steps``]; bd3lm spreads them over its blocks,
            ``max(1, steps * block_size // length)`` per block (diffusion samplers).
        block_length: LLaDA's semi-autoregressive block [``gen.block_length``, null: the run's block size,
            :func:`resolve_block_length`] (LLaDA sampler; a bd3lm run's must be its ``block_size``).
        remasking: confidence rule, one of :data:`REMASKING`, or ``remdm``: ``low_confidence`` unmasking plus
            ReMDM's remasking of decoded tokens (:mod:`difflm.sampling.remdm`) [``gen.remasking``] (diffusion
            samplers).
        remdm_sigma: ReMDM's eta: the cap of sigma_t (``cap``, >= 0) or its share of sigma_t^max (``rescale``, in
            [0, 1]); 0 = no remasking [``gen.remdm_sigma``] (with ``remasking=remdm``).
        remdm_schedule: ``cap`` or ``rescale``, ReMDM's sigma_t schedules [``gen.remdm_schedule``].
        temperature: >= 0, 0 = greedy [``gen.temperature``] (all).
        top_k, top_p: nucleus / top-k filters, 0 / 1 = off [``gen.top_k``, ``gen.top_p``] (all).
        cfg_scale: classifier-free guidance, 0 = off [``gen.cfg_scale``] (LLaDA sampler).
        threshold: Fast-dLLM confidence threshold in (0, 1], None = fixed schedule [``gen.threshold``]
            (diffusion samplers).
        cache: ``none``, ``prefix`` or ``dual`` [``gen.cache``]: Fast-dLLM's block cache for the LLaDA sampler;
            for bd3lm any value but ``none`` turns on its exact cache of finished blocks.
        forbid_ids: token ids never emitted (the mask id, the embedding's padding rows) (all).
        shift_logits: ``logits_fn`` shifts its logits as ``model.shift_logits`` does (Dream: position i's logits
            come from the hidden state at i - 1); the samplers then give position i the logits of the state
            at the previous *real* position, also under padding and the KV cache (diffusion samplers).
        block_size: the bd3lm model's ``objective.block_size`` (block sampler only; None elsewhere).
        causal_prefix: the bd3lm model was trained with ``objective.clean_attention=causal``: finished blocks attend
            causally, as its clean half did (block sampler only).
        infill: the prompt's ``mask_id`` positions are sampled too (infilling, as Dream's ``diffusion_generate``
            with mask tokens in its input), the given prompt tokens kept; False: the prompt is kept whole, mask ids
            included (diffusion samplers; the autoregressive one refuses it). ``difflm-generate`` sets it for a
            prompt with ``mask_placeholder`` text.

    Raises:
        GenerationConfigError: at construction, for a value out of range (naming the ``gen.*`` key).
    """

    mask_id: int
    length: int = 64
    steps: int = 64
    block_length: int = DEFAULT_BLOCK_LENGTH
    remasking: str = "low_confidence"
    remdm_sigma: float = 0.0
    remdm_schedule: str = "cap"
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    cfg_scale: float = 0.0
    threshold: Optional[float] = None
    cache: str = "none"
    forbid_ids: Sequence[int] = ()
    shift_logits: bool = False
    block_size: Optional[int] = None
    causal_prefix: bool = False
    infill: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "forbid_ids", tuple(int(i) for i in self.forbid_ids))
        if self.length < 1:
            raise GenerationConfigError(f"gen.length={self.length} must be >= 1")
        if self.steps < 1:
            raise GenerationConfigError(f"gen.steps={self.steps} must be >= 1")
        if self.block_length < 1:
            raise GenerationConfigError(f"gen.block_length={self.block_length} must be >= 1")
        if self.remasking not in REMASKING + (REMDM,):
            raise GenerationConfigError(f"gen.remasking={self.remasking!r} must be one of {REMASKING + (REMDM,)}")
        if self.remdm_schedule not in REMDM_SCHEDULES:
            raise GenerationConfigError(f"gen.remdm_schedule={self.remdm_schedule!r} must be one of {REMDM_SCHEDULES}")
        if not self.remdm_sigma >= 0:
            raise GenerationConfigError(f"gen.remdm_sigma={self.remdm_sigma} must be >= 0 (0 = no remasking)")
        if self.remdm_schedule == "rescale" and self.remdm_sigma > 1:
            raise GenerationConfigError(f"gen.remdm_sigma={self.remdm_sigma} must be in [0, 1] under "
                                        f"gen.remdm_schedule={self.remdm_schedule} (a share of sigma_t^max)")
        if self.remasking == REMDM and self.threshold is not None:
            raise GenerationConfigError("gen.remasking=remdm remasks against the fixed unmasking schedule: set "
                                        "gen.threshold=null")
        if not self.temperature >= 0:
            raise GenerationConfigError(f"gen.temperature={self.temperature} must be >= 0")
        if self.top_k < 0:
            raise GenerationConfigError(f"gen.top_k={self.top_k} must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise GenerationConfigError(f"gen.top_p={self.top_p} must be in (0, 1] (1 = off)")
        if not self.cfg_scale >= 0:
            raise GenerationConfigError(f"gen.cfg_scale={self.cfg_scale} must be >= 0 (0 = off)")
        if self.threshold is not None and not 0.0 < self.threshold <= 1.0:
            raise GenerationConfigError(f"gen.threshold={self.threshold} must be in (0, 1] or null")
        if self.cache not in CACHES:
            raise GenerationConfigError(f"gen.cache={self.cache!r} must be one of {CACHES}")
        if self.block_size is not None and self.block_size < 1:
            raise GenerationConfigError(f"objective.block_size={self.block_size} must be >= 1")

    @classmethod
    def from_config(cls, gen: Any, *, mask_id: int, forbid_ids: Sequence[int] = (), shift_logits: bool = False,
                    block_size: Optional[int] = None, causal_prefix: bool = False) -> "GenerationOptions":
        """Options from a ``gen`` config (:class:`difflm.config.schema.GenerateConfig`, a DictConfig or a dict;
        missing optional keys take the defaults above) and the model's facts. ``block_length`` null (or missing) is
        the run's block size (:func:`resolve_block_length`): ``block_size`` for a bd3lm run, else
        :data:`DEFAULT_BLOCK_LENGTH`."""
        get = gen.get if hasattr(gen, "get") else lambda k, d=None: getattr(gen, k, d)
        keys = ("length", "steps", "remasking", "temperature", "top_k", "top_p", "cfg_scale",
                "threshold", "cache", "remdm_sigma", "remdm_schedule")
        values = {k: v for k in keys if (v := get(k, None)) is not None}
        values["block_length"] = resolve_block_length(get("block_length", None), block_size)
        return cls(mask_id=int(mask_id), forbid_ids=tuple(forbid_ids), shift_logits=bool(shift_logits),
                   block_size=block_size, causal_prefix=bool(causal_prefix), **values)

    def diffusion_settings(self, prefix: str = "gen.") -> list[str]:
        """``<prefix><key>=<value>`` for each setting only the diffusion samplers read (:data:`DIFFUSION_ONLY`) that
        is not at its default: what left-to-right decoding (``objective=ar``) would silently ignore."""
        return [f"{prefix}{k}={getattr(self, k)}" for k, default in DIFFUSION_DEFAULTS.items()
                if getattr(self, k) != default]

    def check_autoregressive(self, prefix: str = "gen.") -> None:
        """Raises GenerationConfigError when a diffusion-only setting is set for an ``ar`` run's decoding, which
        reads only ``gen.length``, ``gen.temperature``, ``gen.top_k``, ``gen.top_p`` and ``gen.seed``. ``prefix``:
        how the caller spells the keys (``gen.`` on the command line, none in the lm-eval harness's model_args)."""
        if changed := self.diffusion_settings(prefix):
            keys = " ".join(c.split("=")[0] for c in changed)
            read = ", ".join(f"{prefix}{k}" for k in ("length", "temperature", "top_k", "top_p"))
            raise GenerationConfigError(f"{', '.join(changed)}: objective=ar runs decode left to right and read only "
                                        f"{read} and {prefix}seed: drop {keys}")

    def check_block_diffusion(self, prefix: str = "gen.") -> None:
        """Raises GenerationConfigError for settings a ``bd3lm`` run (block size :attr:`block_size`, its
        ``objective.block_size``) cannot sample with: ``cfg_scale`` (not implemented there), a ``block_length`` other
        than the model's block size (the blocks are the model's, so it would be ignored; ``gen.block_length=null``
        is the model's, :meth:`from_config`), and more ``steps`` than tokens (as for the LLaDA sampler: at least one
        token a step)."""
        if self.cfg_scale > 0:
            raise GenerationConfigError(f"{prefix}cfg_scale={self.cfg_scale}: classifier-free guidance is not "
                                        f"implemented for objective=bd3lm runs: set {prefix}cfg_scale=0")
        if self.block_length != self.block_size:
            raise GenerationConfigError(
                f"{prefix}block_length={self.block_length} is not read by objective=bd3lm runs, which sample in the "
                f"model's blocks of {self.block_size} tokens (its objective.block_size): drop {prefix}block_length")
        if self.steps > self.length:
            raise GenerationConfigError(f"{prefix}steps={self.steps} must be <= {prefix}length={self.length} (at least "
                                        f"one token per step): set {prefix}steps={self.length}")

    def replace(self, **changes: Any) -> "GenerationOptions":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


# their defaults: a run's stored gen.* reset to these is what an ``ar`` run's decoding reads
DIFFUSION_DEFAULTS = {k: GenerationOptions.__dataclass_fields__[k].default for k in DIFFUSION_ONLY}

__all__ = ["CACHES", "DEFAULT_BLOCK_LENGTH", "DIFFUSION_DEFAULTS", "DIFFUSION_ONLY", "GenerationConfigError",
           "GenerationOptions", "REMASKING", "REMDM", "REMDM_SCHEDULES", "resolve_block_length", "run_block_size",
           "unread_stored_settings"]
