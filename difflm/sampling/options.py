"""The settings of one generation call, shared by every sampler (:class:`GenerationOptions`).

:func:`difflm.sampling.diffusion_generate` (LLaDA), :func:`difflm.sampling.block_diffusion_generate` (BD3-LM) and
:func:`difflm.sampling.autoregressive_generate` take one :class:`GenerationOptions`, built once from the ``gen.*``
config and the model's facts by :meth:`GenerationOptions.from_config`; each sampler reads the fields it uses.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

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
# blocks of at most this many tokens, the largest that divide gen.length (:func:`fitted_block_length`; difflm-rl's
# rollouts: difflm.config.schema.RL_BLOCK_LENGTH)
DEFAULT_BLOCK_LENGTH = 64
# gen.steps=null: at most this many denoising steps, fewer for a shorter gen.length (:func:`resolve_steps`; difflm-rl's
# rollouts: difflm.config.schema.RL_STEPS)
DEFAULT_STEPS = 64
# what gen.steps and gen.block_length were before null fitted them to gen.length: a run's stored config.yaml may hold
# them; read as null, which gives the same numbers wherever these fit (:func:`unread_stored_settings`)
FORMER_DEFAULTS = {"steps": 64, "block_length": 64}


def run_block_size(objective) -> Optional[int]:
    """The block size a run decodes in by construction: ``objective.block_size`` of a ``bd3lm`` run (an objective
    config, or anything with ``name`` and ``block_size``); None for the other objectives and for None."""
    if objective is None or getattr(objective, "name", None) != "bd3lm":
        return None
    return int(objective.block_size)


def fitted_block_length(length: int, default: int = DEFAULT_BLOCK_LENGTH) -> int:
    """The LLaDA block length ``gen.block_length=null`` gives ``gen.length=length`` tokens on a run without blocks of
    its own: the largest divisor of ``length`` not above ``default``. That is ``length`` itself when it is at most
    ``default`` (one block), ``default`` when it divides ``length`` (64 for 128, 256, ...), else the largest divisor
    below it (48 for 96, 50 for 1000) while it is at least ``default // 4``. A length without such a divisor (a prime
    above ``default``: 67, 127) is one block of ``length``, not blocks of a few tokens decoded token by token; give
    ``gen.block_length`` for another split. Both arguments >= 1."""
    if length <= default:
        return max(1, int(length))
    divisor = next(d for d in range(int(default), 0, -1) if length % d == 0)
    return divisor if divisor >= max(1, int(default) // 4) else int(length)


def resolve_block_length(block_length: Optional[int], block_size: Optional[int] = None,
                         default: int = DEFAULT_BLOCK_LENGTH, length: Optional[int] = None) -> int:
    """The block length a sampler decodes in for ``gen.block_length``: a value given is that value (the LLaDA
    sampler honours it where it divides ``gen.length``, refusing it elsewhere; on a ``bd3lm`` run
    :meth:`GenerationOptions.check_block_diffusion` refuses one other than the run's block size); null is the run's
    block size: ``block_size`` (:func:`run_block_size`) for a ``bd3lm`` run, else the largest divisor of ``length``
    (``gen.length``) not above ``default`` (:func:`fitted_block_length`; ``default`` itself when ``length`` is not
    known). What every sampler entry point reads ``gen.block_length`` through (difflm-generate, difflm-rl, the
    end-of-training samples, the lm-eval harness, the HF export)."""
    if block_length is not None:
        return int(block_length)
    if block_size is not None:
        return int(block_size)
    return fitted_block_length(int(length), int(default)) if length is not None else int(default)


def resolve_steps(steps: Optional[int], length: int, block_length: Optional[int] = None,
                  default: int = DEFAULT_STEPS) -> int:
    """The denoising steps in all for ``gen.steps``: a value given is that value (refused by the sampler where it
    does not fit); null is ``min(default, length)`` (never more steps than tokens: at least one token a step),
    rounded down to a multiple of the LLaDA sampler's block count ``length //
    block_length`` and at least one step per block (an equal number per block). ``block_length``: the LLaDA block
    (None for the block-diffusion and autoregressive samplers, which need no multiple; a block that does not divide
    ``length`` is the sampler's to refuse, and counts as one block here)."""
    if steps is not None:
        return int(steps)
    length = int(length)
    blocks = 1
    if block_length is not None and 0 < block_length <= length and length % block_length == 0:
        blocks = length // block_length
    return max(blocks, min(int(default), length) // blocks * blocks)


def unread_stored_settings(objective: Optional[str], stored: Any = None) -> dict:
    """What a run's stored ``gen.*`` (its ``config.yaml``) is reset to before a caller's keys are laid over it, for
    the keys that run's own sampler never read: an ``ar`` run's diffusion-only keys (their defaults; left-to-right
    decoding), a ``bd3lm`` run's ``block_length`` (null: it decodes in its ``objective.block_size``, and its record
    may hold the schema's former default 64). ``objective``: the run's objective name. ``stored`` (the stored
    ``gen`` mapping, optional): its ``steps`` and ``block_length`` at :data:`FORMER_DEFAULTS` (64, what runs recorded
    before null fitted them to ``gen.length``) are reset to null too, which gives 64 wherever 64 fits and a value
    that fits elsewhere (``gen.length=16`` typed on such a run)."""
    out = {k: None for k, v in FORMER_DEFAULTS.items() if stored is not None and stored.get(k) == v}
    if objective == "ar":
        return {**out, **DIFFUSION_DEFAULTS}
    if objective == "bd3lm":
        return {**out, "block_length": None}
    return out


def check_read_settings(gen: Any, typed: Iterable[str], causal: bool = False, prefix: str = "gen.") -> None:
    """Refuse a setting the caller typed that the other settings leave unread, instead of ignoring it: ReMDM's
    ``remdm_sigma`` (other than 0) or ``remdm_schedule`` (other than ``cap``) without ``remasking=remdm`` on a
    diffusion run (an ``ar`` run refuses them with every diffusion-only key,
    :meth:`GenerationOptions.check_autoregressive`), and the ``top_k`` (> 0) or ``top_p`` (< 1) filter at
    ``temperature=0``: greedy decoding keeps the argmax whatever the filter.

    Args:
        gen: the settings sampled with (a ``gen`` config, DictConfig or dict: the run's stored ``gen.*`` with the
            caller's keys over them).
        typed: the keys the caller set (``top_k`` for ``gen.top_k=5``); only these are judged, so a run's stored
            ``config.yaml`` (whose ``top_k`` a later ``temperature`` may read) is never refused.
        causal: an ``ar`` run.
        prefix: how the caller spells the keys (``gen.`` on the command line, none in the lm-eval harness's
            model_args).
    Raises: GenerationConfigError naming the key and the fix, e.g. ``gen.top_k=5 has no effect with
        gen.temperature=0 (greedy): set gen.temperature>0 or drop it``.
    """
    get = gen.get if hasattr(gen, "get") else lambda k, d=None: getattr(gen, k, d)
    typed = set(typed)
    unread = []
    if not causal and get("remasking", "low_confidence") != REMDM:
        unread += [(k, f"without {prefix}remasking=remdm", f"set {prefix}remasking=remdm")
                   for k, off in (("remdm_sigma", 0.0), ("remdm_schedule", "cap"))
                   if k in typed and get(k, off) is not None and get(k, off) != off]
    temperature = get("temperature", 0.0)
    if temperature is not None and float(temperature) == 0:
        unread += [(k, f"with {prefix}temperature=0 (greedy)", f"set {prefix}temperature>0")
                   for k, off in (("top_k", 0), ("top_p", 1.0))
                   if k in typed and get(k, off) is not None and get(k, off) != off]
    if unread:
        key, why, fix = unread[0]
        raise GenerationConfigError(f"{prefix}{key}={get(key)} has no effect {why}: {fix} or drop it")


@dataclass(frozen=True)
class GenerationOptions:
    """Sampler settings: the ``gen.*`` keys plus the facts of the model and tokenizer that a sampler needs.

    Fields (config key in brackets; samplers that read it):
        mask_id: the mask token id (diffusion samplers).
        length: tokens to generate [``gen.length``] (all).
        steps: denoising steps in all [``gen.steps``; None (null): fitted to ``length`` and the block count,
            :func:`resolve_steps`, at construction]; bd3lm spreads them over its blocks,
            ``max(1, steps * block_size // length)`` per block (diffusion samplers).
        block_length: LLaDA's semi-autoregressive block [``gen.block_length``; None (null): the run's block size,
            ``block_size`` for bd3lm, else the largest divisor of ``length`` up to 64, :func:`resolve_block_length`,
            at construction] (LLaDA sampler; a bd3lm run's must be its ``block_size``).
        remasking: confidence rule, one of :data:`REMASKING`, or ``remdm``: ``low_confidence`` unmasking plus
            ReMDM's remasking of decoded tokens (:mod:`difflm.sampling.remdm`) [``gen.remasking``] (diffusion
            samplers).
        remdm_sigma: ReMDM's eta: the cap of sigma_t (``cap``, >= 0) or its share of sigma_t^max (``rescale``, in
            [0, 1]); 0 = no remasking [``gen.remdm_sigma``] (with ``remasking=remdm``).
        remdm_schedule: ``cap`` or ``rescale``, ReMDM's sigma_t schedules [``gen.remdm_schedule``].
        temperature: >= 0 and finite, 0 = greedy [``gen.temperature``] (all).
        top_k, top_p: nucleus / top-k filters, 0 / 1 = off [``gen.top_k``, ``gen.top_p``] (all).
        cfg_scale: classifier-free guidance, >= 0 and finite, 0 = off [``gen.cfg_scale``] (LLaDA sampler).
        threshold: Fast-dLLM confidence threshold in (0, 1], None = fixed schedule [``gen.threshold``]
            (diffusion samplers; not with ``remasking=entropy``, whose confidence is minus an entropy).
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
        fitted: set at construction: which of ``steps`` / ``block_length`` were None and were fitted to
            ``length`` (a ``replace`` of ``length`` fits them again; one given to ``replace`` is taken as given).

    Raises:
        GenerationConfigError: at construction, for a value out of range (naming the ``gen.*`` key).
    """

    mask_id: int
    length: int = 64
    steps: Optional[int] = None
    block_length: Optional[int] = None
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
    fitted: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "forbid_ids", tuple(int(i) for i in self.forbid_ids))
        if self.length < 1:
            raise GenerationConfigError(f"gen.length={self.length} must be >= 1")
        if self.block_size is not None and self.block_size < 1:
            raise GenerationConfigError(f"objective.block_size={self.block_size} must be >= 1")
        # null: fitted to the length (a bd3lm run's own blocks), then checked as a value given
        fitted = tuple(k for k in ("block_length", "steps") if getattr(self, k) is None or k in self.fitted)
        object.__setattr__(self, "fitted", fitted)
        if "block_length" in fitted:
            object.__setattr__(self, "block_length", resolve_block_length(None, self.block_size, length=self.length))
        if "steps" in fitted:
            block = None if self.block_size is not None else self.block_length
            object.__setattr__(self, "steps", resolve_steps(None, self.length, block))
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
        if self.remasking == "entropy" and self.threshold is not None:  # -entropy <= 0 never reaches it
            raise GenerationConfigError(f"gen.threshold={self.threshold} is compared with a confidence in (0, 1], and "
                                        "gen.remasking=entropy gives minus an entropy (<= 0), which never reaches it: "
                                        "every step would unmask one token whatever gen.steps; set "
                                        "gen.remasking=low_confidence or margin, or gen.threshold=null")
        if not 0 <= self.temperature < math.inf:  # an infinite one scales every logit to nan (forbidden ids too)
            raise GenerationConfigError(f"gen.temperature={self.temperature} must be >= 0 and finite (0 = greedy)")
        if self.top_k < 0:
            raise GenerationConfigError(f"gen.top_k={self.top_k} must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise GenerationConfigError(f"gen.top_p={self.top_p} must be in (0, 1] (1 = off)")
        if not 0 <= self.cfg_scale < math.inf:
            raise GenerationConfigError(f"gen.cfg_scale={self.cfg_scale} must be >= 0 and finite (0 = off)")
        if self.threshold is not None and not 0.0 < self.threshold <= 1.0:
            raise GenerationConfigError(f"gen.threshold={self.threshold} must be in (0, 1] or null")
        if self.cache not in CACHES:
            raise GenerationConfigError(f"gen.cache={self.cache!r} must be one of {CACHES}")

    @classmethod
    def from_config(cls, gen: Any, *, mask_id: int, forbid_ids: Sequence[int] = (), shift_logits: bool = False,
                    block_size: Optional[int] = None, causal_prefix: bool = False) -> "GenerationOptions":
        """Options from a ``gen`` config (:class:`difflm.config.schema.GenerateConfig`, a DictConfig or a dict;
        missing optional keys take the defaults above) and the model's facts. ``block_length`` null (or missing) is
        the run's block size (:func:`resolve_block_length`): ``block_size`` for a bd3lm run, else the largest
        divisor of ``gen.length`` up to :data:`DEFAULT_BLOCK_LENGTH`; ``steps`` null is fitted to the length and
        the blocks (:func:`resolve_steps`)."""
        get = gen.get if hasattr(gen, "get") else lambda k, d=None: getattr(gen, k, d)
        keys = ("length", "steps", "block_length", "remasking", "temperature", "top_k", "top_p", "cfg_scale",
                "threshold", "cache", "remdm_sigma", "remdm_schedule")
        values = {k: v for k in keys if (v := get(k, None)) is not None}
        return cls(mask_id=int(mask_id), forbid_ids=tuple(forbid_ids), shift_logits=bool(shift_logits),
                   block_size=block_size, causal_prefix=bool(causal_prefix), **values)

    def diffusion_settings(self, prefix: str = "gen.") -> list[str]:
        """``<prefix><key>=<value>`` for each setting only the diffusion samplers read (:data:`DIFFUSION_ONLY`) that
        is not at its default: what left-to-right decoding (``objective=ar``) would silently ignore. ``steps`` and
        ``block_length`` are at their default when null (:attr:`fitted`); a run's stored former default 64 is reset to
        null where it is read (:func:`unread_stored_settings`), so a 64 here was typed."""
        return [f"{prefix}{k}={getattr(self, k)}" for k, default in DIFFUSION_DEFAULTS.items()
                if getattr(self, k) != default and k not in self.fitted]

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
        """A copy with ``changes`` applied (validated again); ``steps`` / ``block_length`` that were null stay
        fitted to the (new) ``length`` unless ``changes`` gives them."""
        fitted = tuple(k for k in self.fitted if k not in changes)
        return dataclasses.replace(self, **{**changes, "fitted": fitted})


# their defaults: a run's stored gen.* reset to these is what an ``ar`` run's decoding reads
DIFFUSION_DEFAULTS = {k: GenerationOptions.__dataclass_fields__[k].default for k in DIFFUSION_ONLY}

__all__ = ["CACHES", "DEFAULT_BLOCK_LENGTH", "DEFAULT_STEPS", "DIFFUSION_DEFAULTS", "DIFFUSION_ONLY",
           "FORMER_DEFAULTS", "GenerationConfigError", "GenerationOptions", "REMASKING", "REMDM", "REMDM_SCHEDULES",
           "check_read_settings", "fitted_block_length", "resolve_block_length", "resolve_steps", "run_block_size",
           "unread_stored_settings"]
