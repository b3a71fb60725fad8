"""Which checkpoints to keep: the ``train.keep_last`` most recent, plus every step that is a multiple of
``train.keep_every`` (kept for good). ``keep_last=0`` keeps everything."""
from __future__ import annotations


def steps_to_delete(steps: list[int], keep_last: int, keep_every: int) -> list[int]:
    """Steps (ascending input) whose checkpoints may be deleted under the retention policy."""
    if keep_last <= 0:
        return []
    recent = set(sorted(steps)[-keep_last:])
    return [s for s in sorted(steps) if s not in recent and not (keep_every > 0 and s % keep_every == 0)]
