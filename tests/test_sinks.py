"""What a run shows: the offline W&B run read back with wandb's own reader (``wandb leet inspect --json``) holds
the resolved config, every metrics dict, the throughput and the samples table; logged samples are not copies."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml

from difflm.training.trainer import Trainer

SAMPLES = 3


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory):
    from conftest import FAST, compose_run

    tmp = tmp_path_factory.mktemp("wandb")
    cfg = compose_run([*FAST, f"run.dir={tmp / 'run'}", f"data.cache_dir={tmp / 'cache'}", "logger=wandb",
                       "logger.mode=offline", "logger.progress_bar=false", f"logger.num_samples={SAMPLES}",
                       "logger.log_every=2", "train.max_steps=4", "train.eval_every=4", "train.save_every=0",
                       "gen.length=8", "gen.steps=8", "gen.block_length=8", "gen.temperature=0"])
    trainer = Trainer(cfg, tmp / "run", torch.device("cpu"))
    trainer.peak = 1e12  # a CPU has no listed peak: give one so that MFU is a number to check
    trainer.fit()
    return trainer, tmp / "run"


def _records(run_dir):
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", str(offline), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return offline, [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_offline_wandb_run_holds_config_metrics_throughput_and_samples(wandb_run):
    _, run_dir = wandb_run
    offline, records = _records(run_dir)

    (run,) = [r["run"] for r in records if r["type"] == "run"]
    config = run["config"]["update"]
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    for group in ("model", "data", "objective", "optim", "train", "logger"):
        assert config[group] == resolved[group], group  # the resolved config, nested as in config.yaml

    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    metric_rows = [h for h in history if "loss" in h or "val_nelbo" in h]
    jsonl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in metric_rows] == [row["step"] for row in jsonl] == [0, 2, 4]
    for h, row in zip(metric_rows, jsonl):
        for key, value in row.items():
            if key == "objective":  # metrics.jsonl names it per record; W&B holds it in the run's config
                assert value == config["objective"]["name"] == "mdlm"
            elif value is None:
                assert key not in h
            else:
                assert h[key] == pytest.approx(value, rel=1e-12), (row["step"], key)
    trained = [h for h in metric_rows if "loss" in h]
    for key in ("loss", "lr", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "mem_gib", "grad_norm"):
        assert all(key in h for h in trained), key
    assert all(h["tokens_per_s"] > 0 and 0 < h["mfu"] < 1 and h["mem_gib"] > 0 for h in trained)
    assert [h["step"] for h in metric_rows if "val_nelbo" in h] == [0, 4]

    # every chart is drawn against the trainer's step, and the summary holds the throughput and best values
    metrics = {r["metric"].get("name") or r["metric"].get("glob_name"): r["metric"]
               for r in records if r["type"] == "metric"}
    assert metrics["*"]["step_metric"] == "step"
    summary = {}
    for r in records:
        if r["type"] == "summary":
            summary.update(r["summary"].get("update", {}))
    speeds = [row["tokens_per_s"] for row in jsonl if row.get("tokens_per_s") is not None]
    assert summary["tokens_per_s"]["mean"] == pytest.approx(sum(speeds) / len(speeds), rel=1e-9)
    assert summary["val_nelbo"]["min"] == pytest.approx(min(r["val_nelbo"] for r in jsonl if "val_nelbo" in r))

    tables = [h for h in history if h.get("samples._type") == "table-file"]
    assert [h["step"] for h in tables] == [4, 4]  # at each eval step and at the end
    last = json.loads((offline / "files" / tables[-1]["samples.path"]).read_text())
    assert last["columns"] == ["step", "sample"] and len(last["data"]) == SAMPLES
    written = (run_dir / "samples.txt").read_text()
    for i, (step, text) in enumerate(last["data"]):
        assert step == 4 and f"--- step 4 sample {i} ---\n{text}\n" in written


def test_logged_samples_differ_and_the_first_is_greedy(wandb_run):
    trainer, run_dir = wandb_run
    texts = (run_dir / "samples.txt").read_text().split("--- step 4 sample ")[1:]
    samples = [t.split(" ---\n", 1)[1].rstrip("\n") for t in texts]
    assert len(samples) == SAMPLES and all(s.startswith("ROMEO:") for s in samples)
    assert len(set(samples)) > 1, samples  # gen.temperature=0 alone would give SAMPLES copies
    assert trainer.generate_samples("ROMEO:", 1) == samples[:1]  # sample 0: what difflm-generate prints
