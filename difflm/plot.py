"""``difflm-plot`` (also ``python -m difflm.plot``): the curves of one or more runs in one PNG, from their
``metrics.jsonl``, for users without a W&B dashboard.

    difflm-plot run.dir=outputs/tiny-shakespeare                       # -> outputs/tiny-shakespeare/curves.png
    difflm-plot run.dir=runs/mdlm run.dir=runs/ar out=mdlm_vs_ar.png    # one line per run in every panel
    difflm-plot run.dir=sweeps/lr                                      # a multirun: every job -> sweeps/lr/curves.png
    difflm-plot run.dir='sweeps/lr/*' keys=loss,val_nelbo              # globs; pick the panels

Keys: ``run.dir=DIR`` (repeatable; a glob, or a multirun directory standing for its jobs, labelled by the
overrides that differ between them), ``out=PNG`` (default: ``curves.png`` in the run or the multirun directory),
``keys=loss,val_nelbo,lr,tokens_per_s`` (the panels: any keys of metrics.jsonl).

Arguments are ``key=value`` words like the other entry points, but ``run.dir`` may repeat, so this is a small
parser rather than a Hydra app. Needs matplotlib (``pip install matplotlib``, or ``pip install '.[plot]'`` from a clone).
"""
from __future__ import annotations

import glob
import json
import sys
from pathlib import Path
from typing import Optional

from difflm.cli import exits_cleanly, writable_output
from difflm.errors import DifflmError

DEFAULT_KEYS = ("loss", "val_nelbo", "lr", "tokens_per_s")
LABELS = {"loss": "training loss (nats/token)", "val_nelbo": "validation NELBO (nats/token)",
          "lr": "learning rate", "tokens_per_s": "throughput (tokens/s)", "mfu": "MFU",
          "grad_norm": "gradient norm", "mem_gib": "memory (GiB)"}


POINT_AT_A_RUN = "point run.dir at a difflm-train output directory (or a multirun directory holding several)"


def _require_run_dir(run_dir) -> None:
    """DifflmError naming ``run.dir`` when it does not exist."""
    if not Path(run_dir).exists():
        raise DifflmError(f"run.dir={str(run_dir)!r} does not exist: {POINT_AT_A_RUN}")


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of ``<run_dir>/metrics.jsonl`` in step order, the records of each step merged (training and
    evaluation are logged as separate lines). A resumed run logs the steps after its checkpoint again: when the
    steps go backwards, the earlier records of those steps and every later one (the abandoned branch's) are
    dropped, so no row mixes values of two branches.

    Raises:
        DifflmError: the file is missing or a line is not JSON.
    """
    path = Path(run_dir) / "metrics.jsonl"
    _require_run_dir(run_dir)
    if not path.is_file():
        raise DifflmError(f"run.dir={str(run_dir)!r} has no metrics.jsonl: {POINT_AT_A_RUN}")
    rows: dict[int, dict] = {}
    last = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DifflmError(f"{path}:{number} is not JSON ({err})") from err
        step = int(row["step"])
        if last is not None and step < last:  # a resume from an earlier checkpoint: its later steps are superseded
            rows = {s: r for s, r in rows.items() if s < step}
        rows[step] = {**rows.get(step, {}), **row}  # a step's training and evaluation records are separate lines
        last = step
    return [rows[step] for step in sorted(rows)]


def expand_run_dirs(patterns: list[str]) -> list[Path]:
    """Run directories from ``run.dir`` values: globs are expanded, and a directory without ``metrics.jsonl``
    stands for the runs directly below it (a Hydra multirun: ``<run.dir>/<job>/``)."""
    dirs: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise DifflmError(f"run.dir={pattern!r} matches nothing")
        _require_run_dir(matches[0])  # a plain path (a glob only matches what exists)
        for match in map(Path, matches):
            jobs = sorted((p for p in match.iterdir() if (p / "metrics.jsonl").is_file()),
                          key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name)) \
                if match.is_dir() and not (match / "metrics.jsonl").is_file() else []
            dirs += jobs or [match]
    return dirs


def default_out(patterns: list[str], dirs: list[Path]) -> Path:
    """Where the figure goes without ``out=``: ``curves.png`` in the one run, or in the one folder named (a
    multirun's sweep directory), else in the current folder (several run.dir= or a glob)."""
    if len(dirs) == 1:
        return dirs[0] / "curves.png"
    if len(patterns) == 1 and not glob.has_magic(patterns[0]):
        return Path(patterns[0]) / "curves.png"
    return Path("curves.png")


def _override_labels(dirs: list[Path]) -> Optional[list[str]]:
    """Labels from the Hydra overrides that differ between the runs (``optim.lr=0.001,train.seed=2``), read from
    each run's ``.hydra/overrides.yaml`` (a multirun's jobs are named 0, 1, ..., which says nothing); None when a
    run has no such file or the differing overrides do not tell the runs apart."""
    import yaml

    overrides = []
    for d in dirs:
        path = Path(d) / ".hydra" / "overrides.yaml"
        if not path.is_file():
            return None
        try:
            items = yaml.safe_load(path.read_text(encoding="utf-8")) or []
        except yaml.YAMLError:
            return None
        overrides.append({str(o).partition("=")[0]: str(o) for o in items})
    keys = sorted({k for o in overrides for k in o})
    differing = [k for k in keys if len({o.get(k) for o in overrides}) > 1]
    labels = [",".join(o[k] for k in differing if k in o) for o in overrides]
    return labels if differing and all(labels) and len(set(labels)) == len(labels) else None


def _labels(dirs: list[Path]) -> list[str]:
    """The overrides that differ between the runs (Hydra's ``.hydra/overrides.yaml``), else the shortest trailing
    parts of the paths that tell the runs apart."""
    if len(dirs) > 1 and (labels := _override_labels(dirs)):
        return labels
    parts = [Path(d).resolve().parts for d in dirs]
    for n in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-n:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(d) for d in dirs]


def _stretches(rows: list[dict], key: str, label: str) -> list[tuple[str, list[tuple[int, float]]]]:
    """(line label, [(step, value)]) of ``key`` in one run: one stretch, named ``label``, unless the run was resumed
    with another objective (records carry ``objective``), which changes what its metrics measure (``val_nelbo``:
    the NELBO bound for diffusion, the exact NLL for ``ar``); then one stretch per objective, ``label (objective)``."""
    stretches: list[tuple[Optional[str], list]] = []
    for r in rows:
        if r.get(key) is None:
            continue
        objective = r.get("objective")
        if not stretches or stretches[-1][0] != objective:
            stretches.append((objective, []))
        stretches[-1][1].append((r["step"], r[key]))
    if len({objective for objective, _ in stretches}) <= 1:
        return [(label, [p for _, points in stretches for p in points])] if stretches else []
    return [(f"{label} ({objective})", points) for objective, points in stretches]


def plot_runs(run_dirs: list[Path], out: Path, keys=DEFAULT_KEYS):
    """Draw one panel per metric in ``keys`` (against the step), one line per run, and save a PNG at ``out``.

    Returns the matplotlib Figure (``fig.axes[i].get_lines()``: one line per run that logged ``keys[i]``; a run
    resumed with another objective gets one line per objective, labelled ``run (objective)``).

    Raises:
        DifflmError: matplotlib is missing, or no run logged any of ``keys``.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as err:
        raise DifflmError("difflm-plot needs matplotlib: pip install matplotlib") \
            from err
    suffix = Path(out).suffix.lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix not in formats:
        raise DifflmError(f"out={str(out)!r}: matplotlib writes {', '.join('.' + f for f in sorted(formats))} files: "
                          "end out with one of them (e.g. curves.png)")
    out = writable_output("out", out)
    runs = [(label, read_metrics(d)) for label, d in zip(_labels(run_dirs), run_dirs)]
    for (label, rows), d in zip(runs, run_dirs):
        if not rows and len(runs) > 1:  # its lines are simply absent from every panel: say why
            print(f"difflm-plot: note: {Path(d) / 'metrics.jsonl'} is empty (the run logged no step): {label} is not "
                  "drawn", file=sys.stderr)
    if not any(row.get(k) is not None for _, rows in runs for row in rows for k in keys):
        raise DifflmError(f"no run logged any of keys={','.join(keys)}: check the key names in metrics.jsonl")
    cols = min(2, len(keys))
    rows_n = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(6.4 * cols, 4.0 * rows_n), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for label, rows in runs:
            for name, points in _stretches(rows, key, label):
                steps, values = zip(*points)
                ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3, label=name)
        ax.set_title(LABELS.get(key, key))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        if ax.get_lines():
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(keys):]:
        ax.remove()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return fig


def parse_args(argv: list[str]) -> tuple[list[str], Path | None, tuple[str, ...]]:
    """(``run.dir`` values, ``out``, ``keys``) from ``key=value`` words.

    Raises:
        DifflmError: an unknown key, a word without ``=``, or no ``run.dir``.
    """
    dirs, out, keys = [], None, DEFAULT_KEYS
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise DifflmError(f"{arg!r}: arguments are key=value (run.dir=DIR [run.dir=DIR ...] [out=PNG] "
                              "[keys=loss,val_nelbo,lr,tokens_per_s])")
        if key == "run.dir":
            dirs.append(value)
        elif key == "out":
            out = Path(value)
        elif key == "keys":
            keys = tuple(k for k in value.split(",") if k)
        else:
            raise DifflmError(f"unknown key {key!r}: difflm-plot takes run.dir= (repeatable), out= and keys=")
    if not dirs:
        raise DifflmError("give at least one run.dir=DIR (a difflm-train output directory)")
    return dirs, out, keys


@exits_cleanly
def main(argv: list[str] | None = None) -> None:
    """Entry point: parse, plot, print the PNG's path."""
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):  # like the Hydra entry points: help on stdout, status 0
        print((__doc__ or "").replace("``", "`").strip())
        return
    patterns, out, keys = parse_args(args)
    dirs = expand_run_dirs(patterns)
    if out is None:
        out = default_out(patterns, dirs)
    plot_runs(dirs, out, keys)
    print(out)


if __name__ == "__main__":
    main()
