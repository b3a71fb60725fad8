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


USAGE = "run.dir=DIR [run.dir=DIR ...] [out=PNG] [keys=loss,val_nelbo,lr,tokens_per_s]"
POINT_AT_A_RUN = "point run.dir at a difflm-train output directory (or a multirun directory holding several)"


def _require_run_dir(run_dir) -> None:
    """DifflmError naming ``run.dir`` when it does not exist or is a file (the folder holding a ``metrics.jsonl``
    given as ``run.dir`` is named as the fix)."""
    path = Path(run_dir)
    if not path.exists():
        raise DifflmError(f"run.dir={str(run_dir)!r} does not exist: {POINT_AT_A_RUN}")
    if path.is_dir():
        return
    if path.name == "metrics.jsonl":
        raise DifflmError(f"run.dir={str(run_dir)!r} is a file, not a folder: give the run's folder "
                          f"(run.dir={str(path.parent)!r})")
    raise DifflmError(f"run.dir={str(run_dir)!r} is a file: {POINT_AT_A_RUN}")


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of ``<run_dir>/metrics.jsonl`` in step order, the records of each step merged (training and
    evaluation are logged as separate lines). A resumed run logs the steps after its checkpoint again: when the
    steps go backwards, the earlier records of those steps and every later one (the abandoned branch's) are
    dropped, so no row mixes values of two branches.

    A line that is not a JSON record with a ``step`` (cut short when the run stopped mid-write) is skipped with a
    note on stderr.

    Raises:
        DifflmError: the file is missing.
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
            step = int(row["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            # a line cut short (disk full, a kill mid-write) costs that line, not the run's plot
            print(f"difflm-plot: note: {path}:{number} is not a metrics record ({type(err).__name__}: {err}): "
                  "skipped", file=sys.stderr)
            continue
        if last is not None and step < last:  # a resume from an earlier checkpoint: its later steps are superseded
            rows = {s: r for s, r in rows.items() if s < step}
        rows[step] = {**rows.get(step, {}), **row}  # a step's training and evaluation records are separate lines
        last = step
    return [rows[step] for step in sorted(rows)]


def expand_run_dirs(patterns: list[str]) -> list[Path]:
    """Run directories from ``run.dir`` values: globs are expanded, and a directory without ``metrics.jsonl``
    stands for the runs directly below it (a Hydra multirun: ``<run.dir>/<job>/``); a job folder below it without
    ``metrics.jsonl`` (a job that failed before logging) is named in a note on stderr."""
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
            if jobs:  # a job that failed before its first logged step has no metrics.jsonl: say why it is absent
                for job in sorted(p for p in match.iterdir() if p.is_dir() and p not in jobs
                                  and (p.name.isdigit() or (p / ".hydra").is_dir())):
                    print(f"difflm-plot: note: {job} has no metrics.jsonl (the job logged no step): not drawn",
                          file=sys.stderr)
            dirs += jobs or [match]
    return dirs


def default_out(patterns: list[str], dirs: list[Path]) -> Path:
    """Where the figure goes without ``out=``: ``curves.png`` in the one run, or in the one folder named (a
    multirun's sweep directory), else in the current folder (several run.dir= or a glob)."""
    if len(patterns) == 1 and not glob.has_magic(patterns[0]):  # the run, or the sweep even with one job drawn
        return Path(patterns[0]) / "curves.png"
    if len(dirs) == 1:
        return dirs[0] / "curves.png"
    return Path("curves.png")


MAX_LABEL = 40  # characters of a legend entry; longer override labels give way to the runs' names


def _is_pathlike(key: str) -> bool:
    """Overrides that name folders or files (``run.dir``, ``data.path``, ``hydra.*``): they tell runs apart but say
    nothing about them, so a label prefers any other key, and shows only a path's last part."""
    return key.startswith("hydra") or key in ("run.dir", "out") or key.endswith(
        (".path", "_dir", ".dir", "tokenizer", "prompt_file"))


def _read_overrides(dirs: list[Path]) -> Optional[list[dict[str, str]]]:
    """Each run's Hydra overrides as {key: "key=value"}, from its ``.hydra/overrides.yaml``; None when a run has none
    (a multirun's jobs are named 0, 1, ..., which says nothing, so the overrides are what tells them apart)."""
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
    return overrides


def _differing(overrides: list[dict[str, str]]) -> list[str]:
    """The override keys whose value is not the same in every run, sorted."""
    keys = sorted({k for o in overrides for k in o})
    return [k for k in keys if len({o.get(k) for o in overrides}) > 1]


def _override_labels(dirs: list[Path]) -> Optional[list[str]]:
    """Short, distinct labels from the Hydra overrides that differ between the runs: the fewest differing keys that
    tell every run apart (``optim.lr=0.001``), keys naming paths after the others and shown by their last part,
    never ``run.dir`` (the runs' names say that better); None when no such labels of at most :data:`MAX_LABEL`
    characters exist."""
    from itertools import combinations

    overrides = _read_overrides(dirs)
    if overrides is None:
        return None
    differing = _differing(overrides)
    # what was compared first, then the data's paths; the run's own folder is what the fallback (its name) shows
    keys = sorted((k for k in differing if k not in ("run.dir", "out") and not k.startswith("hydra")), key=_is_pathlike)

    def shown(o: dict[str, str], k: str) -> str:
        key, _, value = o[k].partition("=")
        return f"{key}={Path(value.strip(chr(39) + chr(34))).name}" if _is_pathlike(k) else o[k]

    for size in range(1, min(3, len(keys)) + 1):
        for combo in combinations(keys, size):
            labels = [",".join(shown(o, k) for k in combo if k in o) for o in overrides]
            if all(labels) and len(set(labels)) == len(labels) and max(map(len, labels)) <= MAX_LABEL:
                return labels
    return None


def full_descriptions(dirs: list[Path]) -> Optional[list[str]]:
    """Every override that differs between the runs, per run (``optim.lr=0.001,run.dir=sweeps/lr/0``): what the
    short legend labels leave out, printed beside the PNG. None when the runs have no Hydra overrides."""
    overrides = _read_overrides(dirs)
    if overrides is None or len(dirs) < 2:
        return None
    differing = _differing(overrides)
    return [",".join(o[k] for k in differing if k in o) for o in overrides]


def _labels(dirs: list[Path]) -> list[str]:
    """Short, distinct legend labels: the overrides that tell the runs apart (:func:`_override_labels`), else the
    shortest trailing parts of the paths that do (the runs' names)."""
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
        DifflmError: matplotlib is missing, no run logged a step yet, or none logged any of ``keys`` (the message
        lists the keys they logged).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.backend_bases import FigureCanvasBase
        from matplotlib.ticker import MaxNLocator
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
    if not any(rows for _, rows in runs):
        who = "no run has logged a step" if len(runs) > 1 else f"run.dir={str(run_dirs[0])!r} has logged no step"
        raise DifflmError(f"{who} yet (metrics.jsonl is empty): plot again once a run has logged its first step "
                          "(logger.log_every)")
    logged = sorted({k for _, rows in runs for row in rows for k, v in row.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"})
    if not any(row.get(k) is not None for _, rows in runs for row in rows for k in keys):
        raise DifflmError(f"no run logged any of keys={','.join(keys)}: give keys= from those the runs logged "
                          f"({', '.join(logged)})")
    cols = min(2, len(keys))
    rows_n = -(-len(keys) // cols)
    names = list(dict.fromkeys(name for label, rows in runs for k in keys for name, _ in _stretches(rows, k, label)))
    palette = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    colors = {name: palette[i % len(palette)] for i, name in enumerate(names)}  # one colour per line in every panel
    ncol = min(3, max(1, len(names)))
    legend_rows = -(-len(names) // ncol)
    height = 4.0 * rows_n + 0.25 * legend_rows + 0.2
    fig, axes = plt.subplots(rows_n, cols, figsize=(6.4 * cols, height), squeeze=False)
    handles = {}
    for ax, key in zip(axes.flat, keys):
        for label, rows in runs:
            for name, points in _stretches(rows, key, label):
                steps, values = zip(*points)
                handles[name], = ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3,
                                         label=name, color=colors[name])
        ax.set_title(LABELS.get(key, key))
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.grid(alpha=0.3)
        if not ax.get_lines():  # a key no run logged (val_nelbo with train.eval_every=0, mfu on CPUs, a typo)
            ax.text(0.5, 0.5, f"no run logged {key}", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            print(f"difflm-plot: note: no run logged {key}: its panel is empty (the runs logged "
                  f"{', '.join(logged)})", file=sys.stderr)
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    for ax in list(axes.flat)[len(keys):]:
        ax.remove()
    # one legend for all panels, below them, so it covers no curve (a legend per panel at loc="best" did, and
    # matplotlib warns that placing it is slow on long runs)
    bottom = (0.25 * legend_rows + 0.2) / height
    fig.legend([handles[n] for n in names if n in handles], [n for n in names if n in handles], loc="lower center",
               ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return fig


def parse_args(argv: list[str]) -> tuple[list[str], Path | None, tuple[str, ...]]:
    """(``run.dir`` values, ``out``, ``keys``) from ``key=value`` words.

    Raises:
        DifflmError: an unknown key, a word without ``=``, an empty value, ``keys=`` without a key, or no
        ``run.dir``.
    """
    dirs, out, keys = [], None, DEFAULT_KEYS
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in ("run.dir", "out", "keys") and not value.strip():
            raise DifflmError(f"{key}= is empty: give a value ({USAGE})")
        if not sep:
            raise DifflmError(f"{arg!r}: arguments are key=value ({USAGE})")
        if key == "run.dir":
            dirs.append(value)
        elif key == "out":
            out = Path(value)
        elif key == "keys":  # 'keys=loss, lr' (a space after the comma) names lr; a key named twice is one panel
            keys = tuple(dict.fromkeys(k.strip() for k in value.split(",") if k.strip()))
            if not keys:
                raise DifflmError(f"keys={value} names no metric: give keys of metrics.jsonl, e.g. "
                                  f"keys={','.join(DEFAULT_KEYS)}")
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
    labels, descriptions = _labels(dirs), full_descriptions(dirs)
    if descriptions and labels != descriptions:  # the legend's short labels, and every override they leave out
        for label, description in zip(labels, descriptions):
            print(f"{label}: {description}")
    print(out)


if __name__ == "__main__":
    main()
