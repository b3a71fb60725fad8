"""The ``reward`` config group: reward functions and their weighted combination.

A reward function is any Python callable ``fn(prompt: str, completion: str, answer: str | None) -> float``;
``reward.terms`` lists them, each a Hydra ``_target_`` (with extra keyword arguments bound by Hydra's
``instantiate``, ``_partial_: true``) and a ``weight``:

    reward:
      terms:
        - {_target_: difflm.posttrain.rewards.gsm8k.gsm8k_answer_match, _partial_: true, weight: 1.0}
        - {_target_: difflm.posttrain.rewards.format.format_match, _partial_: true, weight: 0.1}

The reward of a completion is sum_j w_j r_j. A term that raises or returns a non-finite value scores 0 for that
completion, and the failure is reported with its prompt (:class:`WeightedReward`), so one bad completion or one
buggy reward never stops the step. A function that needs the reference answer says so with ``fn.needs_answer = True``
(difflm-rl then refuses a run without ``data.answer_field`` before its first rollout).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from difflm.errors import DifflmError

RewardFn = Callable[[str, str, Optional[str]], float]


@dataclass
class RewardFailure:
    """One reward term's failure on one completion: its name, the prompt and what went wrong."""

    term: str
    prompt: str
    error: str

    def __str__(self) -> str:
        prompt = self.prompt if len(self.prompt) <= 120 else self.prompt[:117] + "..."
        return f"reward {self.term} failed ({self.error}) on prompt {prompt!r}; it scores 0 for that completion"


@dataclass
class WeightedReward:
    """sum_j weight_j * fn_j(prompt, completion, answer) over ``terms`` [(name, fn, weight)]."""

    terms: Sequence[tuple[str, RewardFn, float]]
    failures: list = field(default_factory=list)

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 answers: Optional[Sequence[Optional[str]]] = None) -> list[float]:
        """Rewards of the completions (one float each); failures are appended to :attr:`failures`."""
        answers = answers if answers is not None else [None] * len(prompts)
        out = []
        for prompt, completion, answer in zip(prompts, completions, answers):
            total = 0.0
            for name, fn, weight in self.terms:
                try:
                    value = float(fn(prompt, completion, answer))
                except Exception as e:  # noqa: BLE001 - any error of a user reward is reported, the step goes on
                    self.failures.append(RewardFailure(name, prompt, f"{type(e).__name__}: {e}"))
                    continue
                if not math.isfinite(value):
                    self.failures.append(RewardFailure(name, prompt, f"returned {value}"))
                    continue
                total += weight * value
            out.append(total)
        return out

    def needs_answer(self) -> list[str]:
        """Names of the terms that compare with the reference answer (their function has ``needs_answer = True``):
        without ``data.answer_field`` every completion would fail them and score 0."""
        return [name for name, fn, _ in self.terms if getattr(getattr(fn, "func", fn), "needs_answer", False)]

    def take_failures(self) -> list:
        """The failures since the last call, cleared."""
        failures, self.failures = self.failures, []
        return failures


def check_reward_signature(fn, name: str, bound: list[str]) -> None:
    """Refuse a reward callable ``fn`` (``name``: its ``reward.terms[i]._target_=...``) that cannot be called as
    ``fn(prompt, completion, answer)`` with the keyword arguments its term binds (``bound``): every completion would
    fail it and score 0. A callable without a readable signature (a builtin) is taken as it is.

    Raises: DifflmError naming the term, the keys it binds and the fix."""
    import functools
    import inspect

    keys = f" with the keys of its term bound ({', '.join(bound)})" if bound else ""
    fix = "drop the keys it does not take" if bound else "give it the parameters (prompt, completion, answer)"
    try:
        signature = inspect.signature(fn)
    except ValueError:  # a partial whose bound keywords the function does not take, or a builtin
        if isinstance(fn, functools.partial):
            raise DifflmError(f"{name} does not take the keyword arguments its term binds ({', '.join(bound)}): "
                              f"{fix}") from None
        return
    except TypeError:
        return
    try:
        signature.bind("", "", None)
    except TypeError as e:
        raise DifflmError(f"{name} cannot be called as fn(prompt, completion, answer){keys} ({e}): {fix}") from None


def build_reward(cfg) -> WeightedReward:
    """The :class:`WeightedReward` of a ``reward`` config (``terms``: a list of ``_target_`` nodes with ``weight``).

    Raises: DifflmError naming ``reward.terms`` when it is empty, a target cannot be imported, is not callable or
    cannot be called as ``fn(prompt, completion, answer)`` (:func:`check_reward_signature`).
    """
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    terms_cfg = cfg.get("terms") if hasattr(cfg, "get") else getattr(cfg, "terms", None)
    if not terms_cfg:
        raise DifflmError("reward.terms is empty: name at least one reward function (e.g. reward=gsm8k)")
    terms = []
    for i, node in enumerate(terms_cfg):
        node = OmegaConf.to_container(node) if not isinstance(node, dict) else dict(node)
        weight = float(node.pop("weight", 1.0))
        target = node.get("_target_")
        if not target:
            raise DifflmError(f"reward.terms[{i}] has no _target_: name a Python callable (module.function)")
        try:
            fn = instantiate(node)
        except Exception as e:  # noqa: BLE001 - Hydra wraps import errors in its own types
            hint = "" if node.get("_partial_") else (" (a reward function of (prompt, completion, answer) is bound, "
                                                     "not called, with _partial_: true on its term)")
            raise DifflmError(f"reward.terms[{i}]._target_={target} cannot be instantiated: {' '.join(str(e).split())}"
                              f"{hint}") from None
        if not callable(fn):
            raise DifflmError(f"reward.terms[{i}]._target_={target} is not callable")
        check_reward_signature(fn, f"reward.terms[{i}]._target_={target}",
                               sorted(k for k in node if not k.startswith("_")))
        terms.append((target.rsplit(".", 1)[-1], fn, weight))
    return WeightedReward(terms)


__all__ = ["RewardFailure", "RewardFn", "WeightedReward", "build_reward", "check_reward_signature"]
