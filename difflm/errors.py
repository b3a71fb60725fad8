"""The one error type that reaches users as a single line (see :func:`difflm.cli.run_cli`)."""


class DifflmError(Exception):
    """A user-facing mistake: bad config, missing file, unsupported hardware.

    The message must name the offending key and say what to do, e.g.
    ``data.path='x.txt' does not exist: point data.path at a .txt/.jsonl file, a directory or a glob``.
    Entry points print it as one line and exit with status 2, without a traceback.
    """
