"""What every entry point shares: user mistakes end as one line on stderr with exit status 2."""
from __future__ import annotations

import functools
import sys

from difflm.errors import DifflmError


def exits_cleanly(fn):
    """Wrap a Hydra task function: a :class:`DifflmError` prints ``difflm: error: <message>`` and exits 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DifflmError as err:
            print(f"difflm: error: {err}", file=sys.stderr, flush=True)
            sys.exit(2)

    return wrapper
