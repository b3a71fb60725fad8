"""Format reward: does the completion follow the answer format the prompt asked for?

d1 (Zhao et al. 2025, App. B) rewards ``<reasoning>...</reasoning><answer>...</answer>`` completions; GSM8K's own
format ends in ``#### <number>``. :func:`format_match` gives 1.0 when the completion matches a regular expression
(``re.search``, DOTALL), else 0.0.
"""
from __future__ import annotations

import re
from typing import Optional

GSM8K_FORMAT = r"####\s*-?\d[\d,]*(?:\.\d+)?\s*$"
TAG_FORMAT = r"<answer>.*?</answer>"


def format_match(prompt: str, completion: str, answer: Optional[str] = None, pattern: str = GSM8K_FORMAT) -> float:
    """1.0 when ``pattern`` is found in ``completion`` (DOTALL, stripped), else 0.0."""
    return float(re.search(pattern, completion.strip(), flags=re.S) is not None)


__all__ = ["GSM8K_FORMAT", "TAG_FORMAT", "format_match"]
