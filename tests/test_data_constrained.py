"""The data-constrained recipe (scripts/data_constrained.py, conf experiment/data_constrained): the crossover and the
plot from finished jobs, the experiment config, and (slow) the whole sweep + plot on CPU with a tiny model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, compose_run, load_script

dc = load_script("data_constrained")


def test_crossover_is_interpolated_in_log_epochs():
    ar = {1: 5.0, 4: 4.0, 16: 4.2, 64: 6.0}
    mdlm = {1: 5.5, 4: 4.5, 16: 3.9, 64: 3.8}
    # AR - MDLM: -0.5, -0.5, +0.3 -> crosses between 4 and 16 epochs at log2 = 2 + 2 * 0.5 / 0.8
    assert dc.crossover(ar, mdlm) == pytest.approx(2 ** (2 + 2 * 0.5 / 0.8))
    assert dc.crossover({1: 6.0}, {1: 5.0}) == 1  # MDLM ahead from the first grid point
    assert dc.crossover({1: 4.0, 2: 3.0}, {1: 5.0, 2: 4.0}) is None  # never
    assert dc.crossover({1: 4.0}, {2: 3.0}) is None  # no common epochs


def write_job(root, job, objective, budget, epochs, losses):
    d = root / str(job)
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(f"objective:\n  name: {objective}\ndata:\n  max_train_tokens: {budget}\n"
                                   f"train:\n  epochs: {epochs}\n  max_steps: {10 * len(losses)}\n")
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": 10 * i, "val_nelbo": v}) + "\n"
                                             for i, v in enumerate(losses)))


def test_collect_and_plot_from_job_dirs(tmp_path):
    job = 0
    for objective, curves in (("ar", {1: [6, 5.5], 4: [6, 5.0, 5.4], 16: [6, 5.1, 7]}),
                              ("mdlm", {1: [6, 5.9], 4: [6, 5.3, 5.2], 16: [6, 5, 4.8]})):
        for epochs, losses in curves.items():
            write_job(tmp_path, job, objective, 1000, epochs, losses)
            job += 1
    assert dc.main(["--plot-only", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    best = {(r["objective"], r["epochs"]): (r["best"], r["best_step"]) for r in res["jobs"]}
    assert best[("ar", 16.0)] == (5.1, 10) and best[("mdlm", 16.0)] == (4.8, 20)
    assert 4 < res["by_budget"]["1000"]["crossover_epochs"] < 16
    png = (tmp_path / "data_constrained.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_a_new_sweep_sets_the_earlier_one_aside(tmp_path, monkeypatch):
    """A sweep into an --out holding an earlier sweep of more jobs: the table and plot hold the new jobs only, the
    earlier jobs and results are moved into previous/<time>/ (not deleted, not mixed in), the token cache stays."""
    for job, (objective, epochs) in enumerate((("ar", 1), ("ar", 2), ("mdlm", 1), ("mdlm", 2))):
        write_job(tmp_path, job, objective, 1000, epochs, [6, 5.0 + job])
    (tmp_path / "results.json").write_text("{}")
    (tmp_path / "data_cache").mkdir()

    def sweep(data, out, budgets, epochs, overrides):  # the new grid: 2 jobs, epochs 3
        assert not (out / "2").exists() and not (out / "results.json").exists()
        for job, objective in enumerate(("ar", "mdlm")):
            write_job(out, job, objective, 1000, 3, [6, 4.0 + job])
        return 0

    monkeypatch.setattr(dc, "run_sweep", sweep)
    assert dc.main(["--data", "books/", "--out", str(tmp_path), "--budgets", "1000", "--epochs", "3"]) == 0
    jobs = json.loads((tmp_path / "results.json").read_text())["jobs"]
    assert sorted((r["objective"], r["epochs"], r["best"]) for r in jobs) == [("ar", 3.0, 4.0), ("mdlm", 3.0, 5.0)]
    earlier, = (tmp_path / "previous").iterdir()
    assert sorted(p.name for p in earlier.iterdir()) == ["0", "1", "2", "3", "results.json"]
    assert (tmp_path / "data_cache").is_dir()


def test_experiment_config_is_the_papers_setup():
    cfg = compose_run(["experiment=data_constrained", "data.path=/books"])
    assert (cfg.model.name, cfg.data.seq_len, cfg.train.global_batch_size, cfg.precision.name) == ("125m", 1024, 64, "bf16")
    assert cfg.train.epochs == 16 and cfg.data.max_train_tokens == 1_000_000 and cfg.data.path == "/books"
    assert cfg.train.eval_windows >= 52  # every validation window of the books


@pytest.mark.slow
def test_sweep_and_plot_end_to_end_on_cpu(tmp_path):
    text = (REPO / "difflm/assets/corpora/tinyshakespeare/input.txt").read_text(encoding="utf-8")[:30000]
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "sweep"
    code = dc.main(["--data", str(tmp_path / "corpus.txt"), "--out", str(out), "--budgets", "1024", "--epochs", "1,2",
                    "--", "model=tiny", "device=cpu", "precision=fp32", "data.seq_len=32", "train.global_batch_size=4",
                    "train.micro_batch_size=4", "model.hidden_size=32", "model.num_layers=1", "model.ffn_hidden_size=64",
                    "model.num_heads=2", "model.num_kv_heads=2", "train.eval_every=4", "train.eval_mc_samples=1",
                    "logger.progress_bar=false"])
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    assert sorted((r["objective"], r["epochs"], r["steps"]) for r in res["jobs"]) == [
        ("ar", 1.0, 8), ("ar", 2.0, 16), ("mdlm", 1.0, 8), ("mdlm", 2.0, 16)]  # 1024 tokens = 32 windows = 8 steps/epoch
    assert (out / "data_constrained.png").stat().st_size > 10_000


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_experiment_without_data_path_is_one_line(tmp_path):
    from conftest import run_cli

    out = run_cli("difflm.train", "experiment=data_constrained", "model=tiny", "device=cpu", "precision=fp32",
                  f"run.dir={tmp_path / 'r'}", timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "set data.path to the Gutenberg books" in out.stderr.strip().splitlines()[-1]


def test_without_data_the_embedded_corpus_with_a_budget_it_holds(monkeypatch, tmp_path):
    """Without --data the sweep reads the embedded tinyshakespeare (not a corpus of one machine) at a budget below its
    training windows: 340,240 GPT-NeoX tokens = 332 windows of 1024, the last 5 % held out, leave 315 >= 250k / 1024."""
    seen = {}
    monkeypatch.setattr(dc, "run_sweep", lambda data, out, budgets, epochs, overrides: seen.update(
        data=data, budgets=budgets, epochs=epochs) or 1)
    assert dc.main(["--out", str(tmp_path)]) == 1  # no finished jobs
    assert Path(seen["data"]).is_file() and seen["data"].endswith("tinyshakespeare/input.txt")
    assert seen["budgets"] == [250_000] and seen["epochs"] == [2, 8, 32]
    windows = 340_240 // 1024
    assert 250_000 // 1024 <= windows - round(0.05 * windows)
    dc.main(["--out", str(tmp_path), "--budgets", "4096"])  # budgets given: kept
    assert seen["budgets"] == [4096]
    dc.main(["--out", str(tmp_path), "--data", "books/"])  # a corpus given: the scale's budgets
    assert seen["data"] == "books/" and seen["budgets"] == [1_000_000]
