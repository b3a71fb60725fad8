"""What a run shows: the offline W&B run read back with wandb's own reader (``wandb leet inspect --json``) holds
the resolved config, every metrics dict, the throughput and the samples table; logged samples are not copies."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.slow  # starts processes: make test-fast leaves it out
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


def test_console_without_progress_bar_prints_a_plain_line_per_logged_step(capsys):
    """logger.progress_bar=false: one line per logged step with what the bar shows (and the grad norm, epochs),
    eval steps with their NELBO on the same line; metrics that are None (MFU on a CPU) are left out."""
    from difflm.training.sinks import ConsoleSink

    sink = ConsoleSink(max_steps=20, start_step=0, progress_bar=False)
    sink.log({"step": 0, "loss": None, "lr": None, "tokens_per_s": None, "mfu": None, "val_nelbo": 7.25,
              "val_ppl_bound": 1408.1})
    sink.log({"step": 10, "loss": 5.4321, "grad_norm": 1.25, "lr": 3e-4, "tokens_per_s": 12345.6, "mfu": None,
              "mem_gib": 1.5, "skipped_steps": 0, "data_epochs": 0.125})
    sink.log({"step": 20, "loss": 4.5, "grad_norm": 0.5, "lr": 1e-4, "tokens_per_s": 1000.0, "mfu": 0.25,
              "mem_gib": 1.5, "skipped_steps": 2, "data_epochs": 0.25, "val_nelbo": 4.75, "val_ppl_bound": 115.58})
    sink.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "step 0/20: val_nelbo=7.2500 val_ppl_bound=1408.10",
        "step 10/20: loss=5.4321 grad_norm=1.250 lr=3.00e-04 tokens_per_s=12,346 mem_gib=1.5 data_epochs=0.125",
        "step 20/20: loss=4.5000 grad_norm=0.500 lr=1.00e-04 tokens_per_s=1,000 mfu=25.0% mem_gib=1.5 "
        "data_epochs=0.250 val_nelbo=4.7500 val_ppl_bound=115.58 skipped_steps=2",
    ]


def test_console_with_progress_bar_prints_only_eval_lines(capsys):
    """The bar mode is unchanged: training steps update the bar's postfix (stderr), only eval steps write a line."""
    from difflm.training.sinks import ConsoleSink

    sink = ConsoleSink(max_steps=20, start_step=0, progress_bar=True)
    sink.log({"step": 10, "loss": 5.4321, "lr": 3e-4, "tokens_per_s": 12345.6})
    sink.log({"step": 20, "loss": 4.5, "lr": 1e-4, "val_nelbo": 4.75, "val_ppl_bound": 115.58})
    sink.close()
    out = capsys.readouterr()
    assert out.out.splitlines() == ["step 20: loss=4.5000 val_nelbo=4.7500 lr=1.00e-04 val_ppl_bound=115.58"]
    assert "loss=5.4321" in out.err  # the bar's postfix


def test_training_without_progress_bar_prints_a_line_every_log_every_steps(fast_cfg, capsys):
    """The trainer hands the console every logged step: steps 2 and 4 of a 4-step run with logger.log_every=2."""
    cfg = fast_cfg("train.max_steps=4", "logger.log_every=2", "train.eval_every=0", "train.save_every=0")
    Trainer(cfg, Path(cfg.run.dir), torch.device("cpu")).fit()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert [ln.split(":")[0] for ln in lines] == ["step 2/4", "step 4/4"]
    for ln in lines:
        fields = dict(f.split("=") for f in ln.split(": ", 1)[1].split())
        assert {"loss", "grad_norm", "lr", "tokens_per_s", "mem_gib"} <= set(fields), ln
        assert 0 < float(fields["loss"]) < 20


def test_logger_mode_defaults_to_wandb_mode_and_an_explicit_mode_wins(monkeypatch):
    """wandb.init(mode=...) beats $WANDB_MODE, so the config's default has to come from it."""
    from conftest import compose_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    assert compose_run(["logger=wandb"]).logger.mode == "offline"
    assert compose_run(["logger=wandb", "logger.mode=online"]).logger.mode == "online"
    monkeypatch.delenv("WANDB_MODE")
    assert compose_run(["logger=wandb"]).logger.mode == "online"


def test_bad_wandb_mode_is_named(monkeypatch):
    from conftest import compose_run
    from difflm.config.validate import check_choices
    from difflm.errors import DifflmError

    monkeypatch.setenv("WANDB_MODE", "dryrun")
    with pytest.raises(DifflmError, match=r"logger.mode='dryrun' \(from WANDB_MODE\) is not one of"):
        check_choices(compose_run(["logger=wandb"]), ["logger.mode"])


def test_unreachable_wandb_server_is_one_line_with_the_offline_way(monkeypatch, tmp_path):
    import wandb
    from omegaconf import OmegaConf

    from difflm.errors import DifflmError
    from difflm.training.sinks import WandbSink

    def init(**kwargs):
        raise wandb.errors.CommError("Run initialization has timed out after 90.0 sec.\nPlease try again")

    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # an API key: online stays online
    monkeypatch.setattr(wandb, "init", init)
    lg = OmegaConf.create({"project": "p", "entity": None, "mode": "online"})
    with pytest.raises(DifflmError) as err:
        WandbSink(lg, tmp_path, {}, None)
    assert str(err.value) == ("logger.mode=online: W&B could not reach its server (Run initialization has timed out "
                              "after 90.0 sec.): log offline with logger.mode=offline (or WANDB_MODE=offline) and "
                              "`wandb sync` the run dir's wandb/ folder later, or use logger.mode=disabled")


def test_missing_wandb_is_refused_before_the_model_is_built(monkeypatch, tmp_path):
    from omegaconf import OmegaConf

    from conftest import compose_run
    from difflm.config.validate import check_run
    from difflm.errors import DifflmError
    from difflm.training.sinks import WandbSink

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(DifflmError, match=r"logger=wandb needs the wandb package.*pip install wandb"):
        check_run(compose_run(["logger=wandb", "logger.mode=offline"]))
    check_run(compose_run(["logger=wandb", "logger.mode=disabled"]))  # never imports wandb
    with pytest.raises(DifflmError, match="pip install wandb"):
        WandbSink(OmegaConf.create({"mode": "offline"}), tmp_path, {}, None)


def test_unreachable_wandb_server_is_refused_before_the_model_is_built(monkeypatch):
    """Online with an API key, the W&B server must take a connection within seconds, checked with the config: not
    in fit() after the model and data are built, where wandb.init waits 90 s. Offline, disabled, keyless (which logs
    offline) and non-zero ranks never probe."""
    import socket

    from conftest import compose_run
    from difflm.config.validate import check_run
    from difflm.errors import DifflmError

    probes = []

    def unreachable(address, timeout):
        probes.append((address, timeout))
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    online = compose_run(["logger=wandb", "logger.mode=online"])
    with pytest.raises(DifflmError) as err:
        check_run(online)
    assert str(err.value) == (
        "logger.mode=online: W&B could not reach its server (no connection to api.wandb.ai:443 in 5 s: OSError: "
        "[Errno 101] Network is unreachable): log offline with logger.mode=offline (or WANDB_MODE=offline) and "
        "`wandb sync` the run dir's wandb/ folder later, or use logger.mode=disabled")
    assert probes == [(("api.wandb.ai", 443), 5.0)]
    monkeypatch.setenv("WANDB_BASE_URL", "http://wandb.local:8080")  # a self-hosted server is the one probed
    with pytest.raises(DifflmError, match=r"no connection to wandb\.local:8080"):
        check_run(online)
    probes.clear()
    for overrides in (["logger.mode=offline"], ["logger.mode=disabled"]):
        check_run(compose_run(["logger=wandb", *overrides]))
    monkeypatch.setenv("RANK", "1")  # only rank 0 logs
    check_run(online)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setattr("difflm.training.sinks._netrc_has_wandb", lambda: False)
    check_run(online)  # no key: the sink logs offline
    assert probes == []

    class Connection:
        def close(self):
            probes.append("closed")

    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setattr(socket, "create_connection", lambda address, timeout: Connection())
    check_run(online)
    assert probes == ["closed"]


def _strict_loads(text: str):
    """json.loads that refuses NaN / Infinity, as RFC 8259 parsers (pandas, wandb, jq, JSON.parse) do."""
    import json

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_metrics_jsonl_stays_json_when_a_step_is_not_finite(tmp_path):
    """A non-finite step wrote ``"grad_norm": NaN``, which strict parsers refuse: it is null, and listed under
    ``nonfinite`` so a reader can tell it from a value that was not logged."""
    from difflm.training.sinks import JsonlSink

    sink = JsonlSink(tmp_path, objective="mdlm")
    sink.log({"step": 1, "loss": 2.5, "grad_norm": 1.25})
    sink.log({"step": 2, "loss": float("inf"), "grad_norm": float("nan"), "lr": 3e-4})
    sink.close()
    rows = [_strict_loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 1, "loss": 2.5, "grad_norm": 1.25, "objective": "mdlm"}
    assert rows[1] == {"step": 2, "loss": None, "grad_norm": None, "lr": 3e-4, "objective": "mdlm",
                       "nonfinite": ["loss", "grad_norm"]}
    from difflm.plot import read_metrics

    assert [r.get("grad_norm") for r in read_metrics(tmp_path)] == [1.25, None]


def test_a_resumed_run_logs_after_a_line_cut_short_on_a_line_of_its_own(tmp_path, capsys):
    """A process stopped mid-write (disk full, kill) leaves a line without its newline: the resumed run's first
    record starts a line of its own, and difflm-plot skips the cut line with a note."""
    from difflm.plot import read_metrics
    from difflm.training.sinks import JsonlSink

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "lo')
    sink = JsonlSink(tmp_path, objective="mdlm")
    sink.log({"step": 2, "loss": 2.5})
    sink.close()
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == [
        '{"step": 1, "loss": 3.0}', '{"step": 2, "lo', '{"step": 2, "loss": 2.5, "objective": "mdlm"}']
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 3.0), (2, 2.5)]
    assert capsys.readouterr().err.startswith(f"difflm-plot: note: {tmp_path / 'metrics.jsonl'}:2 is not a metrics "
                                              "record (JSONDecodeError: ")
    JsonlSink(tmp_path).close()  # a file that ends in its newline gets no empty line
    assert (tmp_path / "metrics.jsonl").read_text().endswith('"objective": "mdlm"}\n')


def test_every_json_difflm_writes_is_strict(tmp_path):
    """The writers of checkpoint manifests, shard manifests, exports and difflm-eval results go through
    :func:`difflm.strict_json.dumps`: nested NaN and inf become null, numpy floats too."""
    import numpy as np

    from difflm import strict_json
    from difflm.checkpoint.manifest import write_manifest
    from difflm.evaluate import json_safe

    text = strict_json.dumps({"a": [1.0, float("nan"), {"b": float("-inf")}], "c": np.float64("nan"), "d": (2, 3)},
                             flag=True)
    assert _strict_loads(text) == {"a": [1.0, None, {"b": None}], "c": None, "d": [2, 3], "nonfinite": ["c"]}
    assert json_safe({"nelbo_stderr": float("nan"), "nelbo": 3.0}) == {"nelbo_stderr": None, "nelbo": 3.0}
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "w.bin").write_bytes(b"1234")
    write_manifest(tmp_path / "ckpt")
    _strict_loads((tmp_path / "ckpt" / "manifest.json").read_text())


class _RecordingWandbSink:
    """Stands in for :class:`difflm.training.sinks.WandbSink` in a run: records how the trainer closes it."""

    closed: list = []

    def __init__(self, *args, **kwargs):
        pass

    def log(self, metrics):
        pass

    def log_samples(self, step, samples):
        pass

    def close(self, failed=False):
        self.closed.append(failed)


def test_a_run_that_ends_in_an_error_finishes_its_wandb_run_as_failed(fast_cfg, monkeypatch, tmp_path):
    """wandb.finish() records exit code 0 (finished) unless told otherwise: a run stopped by non-finite steps (or
    any error) closes its W&B run as failed (exit code 1), a run that trains to the end as finished."""
    import difflm.training.sinks as sinks_module
    from difflm.errors import DifflmError
    from difflm.training.sinks import WandbSink

    monkeypatch.setattr(sinks_module, "WandbSink", _RecordingWandbSink)
    monkeypatch.setattr(_RecordingWandbSink, "closed", [])
    overrides = ("logger=wandb", "logger.mode=offline", "train.max_steps=3", "train.save_every=0",
                 "train.eval_every=0", "train.max_skipped_steps=1")
    Trainer(fast_cfg(*overrides), tmp_path / "ok", torch.device("cpu")).fit()
    trainer = Trainer(fast_cfg(*overrides), tmp_path / "nan", torch.device("cpu"))
    forward = trainer.model.forward
    trainer.model.forward = lambda *a, **k: forward(*a, **k) * float("nan")
    with pytest.raises(DifflmError, match="non-finite"):
        trainer.fit()
    assert _RecordingWandbSink.closed == [False, True]

    finished = []
    sink = WandbSink.__new__(WandbSink)  # the sink's close on a stand-in run
    sink.run = type("Run", (), {"finish": lambda self, exit_code=None: finished.append(exit_code)})()
    sink.close()
    sink.close(failed=True)
    assert finished == [None, 1]


def test_a_damaged_wandb_id_file_is_a_new_wandb_run_or_one_line(tmp_path):
    """wandb_id.txt names the W&B run a resumed run logs into. Empty (the process stopped while writing it), which
    wandb.init refuses with a traceback, the run starts a new W&B run and says so. An id W&B refuses is one line
    naming the file and the two ways out."""
    from difflm.errors import DifflmError
    from difflm.training.sinks import saved_wandb_id

    notes = []
    assert saved_wandb_id(tmp_path, notes.append) is None and notes == []  # no file: a new W&B run
    (tmp_path / "wandb_id.txt").write_text("zsz50erg\n")
    assert saved_wandb_id(tmp_path, notes.append) == "zsz50erg"
    (tmp_path / "wandb_id.txt").write_text(" \n")
    assert saved_wandb_id(tmp_path, notes.append) is None
    assert notes == [f"difflm: {tmp_path / 'wandb_id.txt'} is empty: this run starts a new W&B run"]
    (tmp_path / "wandb_id.txt").write_text("team/project/zsz50erg")
    with pytest.raises(DifflmError) as err:
        saved_wandb_id(tmp_path, notes.append)
    assert str(err.value) == (f"{tmp_path / 'wandb_id.txt'} holds 'team/project/zsz50erg', not a W&B run id (W&B "
                              "refuses /): put back the id of the run's W&B run (the last part of its offline-run-* "
                              "folder or its URL), or delete the file to log into a new W&B run")


def test_mem_gib_is_the_runs_own_peak_not_an_earlier_sweep_jobs(fast_cfg, monkeypatch):
    """The jobs of a -m sweep run one after another in one process: each run's mem_gib starts from its own start,
    not from the process's peak (a larger job before it). On CUDA the allocator's peak is reset the same way."""
    import json as _json

    from difflm.training.trainer import memory_gib, reset_peak_memory

    cpu = torch.device("cpu")
    big = torch.ones(2**28)  # 1 GiB, touched: an earlier, larger job
    del big
    before = memory_gib(cpu)
    cfg = fast_cfg("train.max_steps=1", "train.save_every=0", "train.eval_every=0")
    Trainer(cfg, Path(cfg.run.dir), cpu).fit()
    (row,) = [_json.loads(x) for x in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()]
    assert 0 < row["mem_gib"] < before - 0.5, (row["mem_gib"], before)

    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", calls.append)
    reset_peak_memory(torch.device("cuda"))
    assert calls == [torch.device("cuda")]
