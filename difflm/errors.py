"""The one error type that reaches users as a single line (see :func:`difflm.cli.run_cli`)."""


class DifflmError(Exception):
    """A user-facing mistake: bad config, missing file, unsupported hardware.

    The message must name the offending key and say what to do, e.g.
    ``data.path='x.txt' does not exist: point data.path at a .txt/.jsonl file, a directory or a glob``.
    Entry points print it as one line and exit with status 2, without a traceback.
    """


def exception_chain(err: BaseException | None):
    """``err``, then what it was raised from or while handling (``__cause__``, else ``__context__`` unless
    ``raise ... from None`` suppressed it), each once: the chain a wrapping library (DCP, Hydra, lm-eval) leaves."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
