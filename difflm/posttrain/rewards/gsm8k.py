"""Verifiable GSM8K answer match (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems"; the data's
``answer`` field ends in ``#### <number>``).

The completion's answer is the number after its last ``####`` (the dataset's format), else inside its last
``<answer>...</answer>`` (d1's format), else its last number; commas and a trailing ``.`` are dropped. The
reward is 1.0 when it equals the reference number numerically, else 0.0.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

GSM8K_SAMPLE = Path(__file__).resolve().parents[2] / "assets" / "corpora" / "gsm8k" / "test_sample.jsonl"
"""32 rows of the GSM8K test split shipped with difflm (MIT; ``SOURCE.md`` beside it)."""

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_number(text: str) -> Optional[float]:
    """The final numeric answer of ``text`` (module docstring), or None when it has no number."""
    for pattern in (r"####\s*([^\n]*)", r"<answer>(.*?)</answer>"):
        found = re.findall(pattern, text, flags=re.S)
        if found:
            text = found[-1]
            break
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    try:
        return float(numbers[-1].replace(",", "").rstrip("."))
    except ValueError:
        return None


def gsm8k_answer_match(prompt: str, completion: str, answer: Optional[str] = None) -> float:
    """1.0 when the completion's final number equals the reference ``answer``'s (a GSM8K ``answer`` field or a
    bare number), else 0.0. Raises ValueError when the reference has no number (a data error)."""
    if answer is None:
        raise ValueError("gsm8k_answer_match needs the reference answer (the dataset's answer field)")
    want = extract_number(str(answer))
    if want is None:
        raise ValueError(f"reference answer {answer!r} holds no number")
    got = extract_number(completion)
    return float(got is not None and abs(got - want) < 1e-6)


gsm8k_answer_match.needs_answer = True  # difflm-rl refuses it without data.answer_field (WeightedReward.needs_answer)


__all__ = ["extract_number", "gsm8k_answer_match"]
