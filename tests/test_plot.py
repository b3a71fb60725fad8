"""difflm-plot: one panel per metric, one line per run, from metrics.jsonl; multirun dirs and resumed runs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from difflm.errors import DifflmError
from difflm.plot import default_out, expand_run_dirs, parse_args, plot_runs, read_metrics

from conftest import run_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(path, slope, steps=20, resumed_at=None):
    path.mkdir(parents=True)
    rows = []
    for step in range(0, steps + 1, 2):
        row = {"step": step, "loss": None if step == 0 else 10 - slope * step, "lr": 1e-3 * min(1, step / 4),
               "tokens_per_s": None if step == 0 else 1000.0 + step, "mfu": None}
        if step % 10 == 0:
            row["val_nelbo"] = 10.5 - slope * step
        rows.append(row)
    if resumed_at is not None:  # a resumed run logs the steps after its checkpoint again; the last record wins
        rows += [dict(r, loss=r["loss"] - 1) for r in rows if r["step"] > resumed_at]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plot_has_one_panel_per_metric_and_one_line_per_run(tmp_path):
    _write_run(tmp_path / "mdlm", 0.2)
    _write_run(tmp_path / "ar", 0.3, resumed_at=10)
    fig = plot_runs([tmp_path / "mdlm", tmp_path / "ar"], tmp_path / "out" / "curves.png")
    assert (tmp_path / "out" / "curves.png").read_bytes()[:8] == PNG_MAGIC
    assert [ax.get_title() for ax in fig.axes] == ["training loss (nats/token)", "validation NELBO (nats/token)",
                                                   "learning rate", "throughput (tokens/s)"]
    for ax in fig.axes:
        assert [line.get_label() for line in ax.get_lines()] == ["mdlm", "ar"]
    loss_ar = fig.axes[0].get_lines()[1]
    assert list(loss_ar.get_xdata()) == list(range(2, 21, 2))  # step 0 has no loss; resumed steps once
    assert loss_ar.get_ydata()[-1] == pytest.approx(10 - 0.3 * 20 - 1)  # the resumed (last) record
    assert list(fig.axes[1].get_lines()[0].get_xdata()) == [0, 10, 20]
    assert len(read_metrics(tmp_path / "ar")) == 11


def test_multirun_dir_globs_and_keys(tmp_path):
    for job in range(3):
        _write_run(tmp_path / "sweep" / str(job), 0.1 * (job + 1))
    (tmp_path / "sweep" / ".submitit").mkdir()
    assert [p.name for p in expand_run_dirs([str(tmp_path / "sweep")])] == ["0", "1", "2"]
    assert [p.name for p in expand_run_dirs([str(tmp_path / "sweep" / "[01]")])] == ["0", "1"]
    fig = plot_runs(expand_run_dirs([str(tmp_path / "sweep")]), tmp_path / "s.png", keys=("loss", "val_nelbo", "lr"))
    assert len(fig.axes) == 3 and all(len(ax.get_lines()) == 3 for ax in fig.axes)
    assert parse_args(["run.dir=a", "run.dir=b", "out=x.png", "keys=loss,lr"]) == \
        (["a", "b"], Path("x.png"), ("loss", "lr"))
    with pytest.raises(DifflmError, match="unknown key"):
        parse_args(["run.dir=a", "dir=b"])
    assert parse_args(["run.dir=a", "keys=loss, lr,loss,"])[2] == ("loss", "lr")  # spaces, repeats, a last comma
    with pytest.raises(DifflmError, match=r"^keys=, names no metric: give keys of metrics.jsonl, e.g. "
                                          r"keys=loss,val_nelbo,lr,tokens_per_s$"):
        parse_args(["run.dir=a", "keys=,"])
    with pytest.raises(DifflmError, match="no metrics.jsonl"):
        plot_runs([tmp_path], tmp_path / "t.png")


def test_cli_writes_the_png(tmp_path):
    _write_run(tmp_path / "a", 0.2)
    _write_run(tmp_path / "b", 0.25)
    out = run_cli("difflm.plot", f"run.dir={tmp_path / 'a'}", f"run.dir={tmp_path / 'b'}",
                  f"out={tmp_path / 'ab.png'}", timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(tmp_path / "ab.png")
    assert (tmp_path / "ab.png").read_bytes()[:8] == PNG_MAGIC
    bad = run_cli("difflm.plot", f"run.dir={tmp_path / 'missing'}", timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("difflm: error: ") and "Traceback" not in bad.stderr


def test_default_out_and_refused_outs(tmp_path):
    for job in range(2):
        _write_run(tmp_path / "sweep" / str(job), 0.1 * (job + 1))
    sweep = str(tmp_path / "sweep")
    assert default_out([sweep], expand_run_dirs([sweep])) == tmp_path / "sweep" / "curves.png"  # not ./curves.png
    one = str(tmp_path / "sweep" / "0")
    assert default_out([one], expand_run_dirs([one])) == tmp_path / "sweep" / "0" / "curves.png"
    assert default_out([sweep + "/*"], expand_run_dirs([sweep + "/*"])) == Path("curves.png")
    _write_run(tmp_path / "single" / "0", 0.1)  # a sweep of one job (or one job drawn): the sweep's folder still
    single = str(tmp_path / "single")
    assert default_out([single], expand_run_dirs([single])) == tmp_path / "single" / "curves.png"
    dirs = expand_run_dirs([sweep])
    with pytest.raises(DifflmError, match=r"^out='.*x.foo': matplotlib writes .*\.png.*end out with one of them"):
        plot_runs(dirs, tmp_path / "x.foo")
    (tmp_path / "afile").write_text("")
    with pytest.raises(DifflmError, match=r"^out='.*afile/x.png' cannot be written .*choose a folder you can write in"):
        plot_runs(dirs, tmp_path / "afile" / "x.png")
    (tmp_path / "d.png").mkdir()
    with pytest.raises(DifflmError, match=r"^out='.*d.png' is a directory: give a file path"):
        plot_runs(dirs, tmp_path / "d.png")


def test_resumed_branch_replaces_the_abandoned_one_without_mixing(tmp_path):
    """Resumed from step 10 after the first branch logged to step 20 (with an evaluation at step 15): steps 11-20
    come from the resumed branch only, and no value of the abandoned branch (its val_nelbo at 15) is kept."""
    from difflm.plot import read_metrics

    rows = [{"step": s, "loss": 10.0 - s / 10, "lr": 3e-4} for s in range(1, 21)]
    rows.insert(15, {"step": 15, "val_nelbo": 9.0})
    rows += [{"step": s, "loss": 5.0 - s / 10, "lr": 1e-5} for s in range(11, 18)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = {r["step"]: r for r in read_metrics(tmp_path)}
    assert sorted(got) == list(range(1, 18))
    assert got[10] == {"step": 10, "loss": 9.0, "lr": 3e-4}
    assert got[15] == {"step": 15, "loss": 5.0 - 1.5, "lr": 1e-5}  # no val_nelbo of the abandoned branch


def test_a_run_resumed_with_another_objective_gets_one_line_per_objective(tmp_path):
    """val_nelbo is the NELBO bound under mdlm and the exact NLL under ar: a run resumed as ar after step 10 is drawn
    as two lines, not one line across the switch; a run of one objective keeps its plain label."""
    rows = [{"step": s, "loss": 10.0 - s / 10, "val_nelbo": 9.0 - s / 10, "objective": "mdlm"} for s in range(0, 12, 2)]
    rows += [{"step": s, "loss": 5.0 - s / 10, "val_nelbo": 4.0 - s / 10, "objective": "ar"} for s in range(10, 20, 2)]
    (tmp_path / "switched").mkdir()
    (tmp_path / "switched" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _write_run(tmp_path / "plain", 0.2)
    fig = plot_runs([tmp_path / "switched", tmp_path / "plain"], tmp_path / "c.png", keys=("val_nelbo",))
    lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["switched (mdlm)", "switched (ar)", "plain"]
    assert list(lines[0].get_xdata()) == [0, 2, 4, 6, 8] and list(lines[1].get_xdata()) == [10, 12, 14, 16, 18]
    assert list(lines[1].get_ydata()) == [4.0 - s / 10 for s in range(10, 20, 2)]  # step 10 from the resumed branch


def test_help_prints_usage_and_exits_0(capsys):
    from difflm.plot import main

    main(["--help"])  # used to exit 2 with "'--help': arguments are key=value"
    out = capsys.readouterr().out
    assert out.startswith("`difflm-plot` (also `python -m difflm.plot`)") and "keys=loss,val_nelbo" in out


def test_missing_run_dir_says_it_does_not_exist(tmp_path):
    missing = tmp_path / "nonexist"
    with pytest.raises(DifflmError, match=r"^run.dir='.*nonexist' does not exist: point run.dir at"):
        expand_run_dirs([str(missing)])
    with pytest.raises(DifflmError, match=r"^run.dir='.*nonexist' does not exist"):
        read_metrics(missing)


def test_multirun_legend_names_the_swept_values_and_an_empty_run_is_noted(tmp_path, capsys):
    for job, (lr, slope) in enumerate([("0.001", 0.1), ("0.003", 0.2)]):
        _write_run(tmp_path / "sweep" / str(job), slope)
        (tmp_path / "sweep" / str(job) / ".hydra").mkdir()
        (tmp_path / "sweep" / str(job) / ".hydra" / "overrides.yaml").write_text(
            f"- model=tiny\n- optim.lr={lr}\n- run.dir=sweep\n")
    fig = plot_runs(expand_run_dirs([str(tmp_path / "sweep")]), tmp_path / "s.png", keys=("loss",))
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["optim.lr=0.001", "optim.lr=0.003"]
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    fig = plot_runs([tmp_path / "sweep" / "0", tmp_path / "empty"], tmp_path / "e.png", keys=("loss",))
    assert len(fig.axes[0].get_lines()) == 1
    assert capsys.readouterr().err == (f"difflm-plot: note: {tmp_path / 'empty' / 'metrics.jsonl'} is empty (the run "
                                       "logged no step): empty is not drawn\n")


def test_an_empty_value_or_a_file_as_run_dir_is_named(tmp_path):
    """run.dir= (empty) would plot every run below the current folder: refused; a file as run.dir is named as a
    file (its folder is the fix), not as an out= that cannot be written."""
    for arg in ("run.dir=", "keys=", "out="):
        with pytest.raises(DifflmError) as err:
            parse_args(["run.dir=r", arg])
        assert str(err.value) == (f"{arg} is empty: give a value (run.dir=DIR [run.dir=DIR ...] [out=PNG] "
                                  "[keys=loss,val_nelbo,lr,tokens_per_s])")
    _write_run(tmp_path / "run", 0.1)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DifflmError) as err:
        expand_run_dirs([str(tmp_path / "notes.txt")])
    assert str(err.value) == (f"run.dir={str(tmp_path / 'notes.txt')!r} is a file: point run.dir at a difflm-train "
                              "output directory (or a multirun directory holding several)")
    with pytest.raises(DifflmError) as err:
        expand_run_dirs([str(tmp_path / "run" / "metrics.jsonl")])
    assert str(err.value) == (f"run.dir={str(tmp_path / 'run' / 'metrics.jsonl')!r} is a file, not a folder: give "
                              f"the run's folder (run.dir={str(tmp_path / 'run')!r})")


def test_a_run_without_steps_and_unknown_keys_say_what_to_do(tmp_path, capsys):
    """An empty metrics.jsonl (a run that has not logged yet) says so, and keys= that no run logged lists the keys
    the runs did log."""
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "metrics.jsonl").write_text("")
    with pytest.raises(DifflmError) as err:
        plot_runs([tmp_path / "new"], tmp_path / "n.png")
    assert str(err.value) == (f"run.dir={str(tmp_path / 'new')!r} has logged no step yet (metrics.jsonl is empty): "
                              "plot again once a run has logged its first step (logger.log_every)")
    _write_run(tmp_path / "run", 0.1)
    with pytest.raises(DifflmError) as err:
        plot_runs([tmp_path / "run"], tmp_path / "r.png", keys=("los",))
    assert str(err.value) == ("no run logged any of keys=los: give keys= from those the runs logged (loss, lr, "
                              "tokens_per_s, val_nelbo)")
    for job in ("0", "1"):
        _write_run(tmp_path / "sweep" / job, 0.1)
    (tmp_path / "sweep" / "2" / ".hydra").mkdir(parents=True)  # a job that failed before its first step
    (tmp_path / "sweep" / ".submitit").mkdir()
    capsys.readouterr()
    assert [p.name for p in expand_run_dirs([str(tmp_path / "sweep")])] == ["0", "1"]
    assert capsys.readouterr().err == (f"difflm-plot: note: {tmp_path / 'sweep' / '2'} has no metrics.jsonl (the job "
                                       "logged no step): not drawn\n")


def test_a_panel_no_run_logged_says_so_and_steps_are_whole(tmp_path, capsys):
    """A key no run logged beside ones they did (val_nelbo with train.eval_every=0, mfu on CPUs, a mistyped key)
    gets a panel that says so, with a note listing the logged keys, instead of an empty 0-1 frame; step ticks are
    whole numbers on a short run."""
    (tmp_path / "run").mkdir()
    rows = [{"step": s, "loss": 10.0 - s, "mfu": None, "lr": 1e-3} for s in (1, 2, 3)]
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = plot_runs([tmp_path / "run"], tmp_path / "c.png", keys=("loss", "mfu", "los"))
    loss, mfu, typo = fig.axes
    assert len(loss.get_lines()) == 1 and not mfu.get_lines() and not typo.get_lines()
    assert [t.get_text() for t in mfu.texts] == ["no run logged mfu"] and list(mfu.get_xticks()) == []
    assert [t.get_text() for t in typo.texts] == ["no run logged los"]
    assert not loss.texts and all(float(x).is_integer() for x in loss.get_xticks())
    assert capsys.readouterr().err.splitlines() == [
        "difflm-plot: note: no run logged mfu: its panel is empty (the runs logged loss, lr)",
        "difflm-plot: note: no run logged los: its panel is empty (the runs logged loss, lr)"]


def _write_overrides(run, *overrides):
    (run / ".hydra").mkdir()
    (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))


def test_separate_runs_get_short_distinct_labels_and_the_full_list_is_printed(tmp_path, capsys):
    """Separate runs differ in run.dir and data.path as well as in what was compared: the legend shows the fewest
    overrides that tell them apart (paths last, by their last part), one legend below the panels (no panel legend
    over the curves, no matplotlib warning on 2,000-point curves), and the full differing overrides are printed."""
    import warnings

    from difflm.plot import main

    runs = []
    for name, lr, corpus in (("mdlm-lr1", "0.001", "/data/corpora/gutenberg/books.txt"),
                             ("mdlm-lr3", "0.003", "/data/corpora/gutenberg/books.txt")):
        run = tmp_path / "runs" / name
        _write_run(run, 0.002, steps=4000)
        _write_overrides(run, "model=tiny", f"optim.lr={lr}", f"data.path={corpus}", f"run.dir={run}")
        runs.append(run)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = plot_runs(runs, tmp_path / "two.png", keys=("loss", "val_nelbo"))
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["optim.lr=0.001", "optim.lr=0.003"]
    assert all(ax.get_legend() is None for ax in fig.axes) and len(fig.legends) == 1
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["optim.lr=0.001", "optim.lr=0.003"]
    # the same colour for a run in every panel
    assert [line.get_color() for line in fig.axes[0].get_lines()] == [line.get_color() for line in fig.axes[1].get_lines()]
    main([f"run.dir={runs[0]}", f"run.dir={runs[1]}", f"out={tmp_path / 'two.png'}"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[:2] == [f"optim.lr=0.001: optim.lr=0.001,run.dir={runs[0]}",
                           f"optim.lr=0.003: optim.lr=0.003,run.dir={runs[1]}"]

    # only paths differ: the path's last part; when even those are alike, the runs' names
    other = tmp_path / "other" / "news"
    _write_run(other, 0.001)
    _write_overrides(other, "model=tiny", "optim.lr=0.001", "data.path=/data/corpora/web/news.txt", f"run.dir={other}")
    fig = plot_runs([runs[0], other], tmp_path / "p.png", keys=("loss",))
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["data.path=books.txt", "data.path=news.txt"]
    (runs[1] / ".hydra" / "overrides.yaml").write_text(f"- optim.lr=0.001\n- run.dir={'/very/long' * 8}/b\n")
    (runs[0] / ".hydra" / "overrides.yaml").write_text(f"- optim.lr=0.001\n- run.dir={'/very/long' * 8}/b/c/d\n")
    fig = plot_runs(runs, tmp_path / "n.png", keys=("loss",))
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["mdlm-lr1", "mdlm-lr3"]
