"""Operating long runs: kill -9 and resume, damaged checkpoints, SIGTERM, time limits, non-finite steps,
loss spikes, retention, hang dumps and profiling (docs/operations.md, "Operating long runs")."""
from __future__ import annotations

import json
import re
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from difflm.checkpoint.manifest import manifest_problem
from difflm.checkpoint.store import latest_checkpoint, list_checkpoints
from difflm.errors import DifflmError
from difflm.training.preemption import EXIT_INTERRUPTED, EXIT_REQUEUE
from difflm.training.optimizer import skips_on_device
from difflm.training.trainer import Trainer

from conftest import FAST

CPU = torch.device("cpu")


def last_losses(run_dir: Path) -> dict[int, float]:
    """step -> loss, the last record of each step (a resumed run logs steps again)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("loss") is not None:
            out[row["step"]] = row["loss"]
    return out


def die_with_parent() -> None:
    """``preexec_fn`` of long-running children: killed with the test process (Linux ``PR_SET_PDEATHSIG``), so an
    interrupted test run leaves no training process behind writing checkpoints."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def train_cmd(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "difflm.train", *FAST, "train.max_steps=10", "train.save_every=2",
            "train.eval_every=0", "logger.log_every=1", "objective.random_length_prob=0.2",
            f"data.cache_dir={cache}", f"run.dir={run_dir}", *extra]


def saving_step(run_dir: Path) -> int | None:
    """The step of a checkpoint being written now (its ``.step_<N>.tmp`` folder exists), if any."""
    try:
        names = os.listdir(run_dir / "checkpoints")
    except OSError:
        return None
    steps = [int(n[len(".step_"):-len(".tmp")]) for n in names if n.startswith(".step_") and n.endswith(".tmp")]
    return max(steps, default=None)


def wait_for_a_save(proc: subprocess.Popen, run_dir: Path, after: int, timeout: float = 600) -> int | None:
    """Poll (every 2 ms) until ``proc`` writes a checkpoint of a step above ``after``; returns that step, or None
    when ``proc`` ended or ``timeout`` passed first. A save of the test model takes a few hundred milliseconds."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        step = saving_step(run_dir)
        if step is not None and step > after:
            return step
        time.sleep(0.002)
    return None


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_sigkill_mid_save_and_mid_step_then_resume_matches(tmp_path):
    """kill -9 twice in one run.dir: first while a checkpoint is being written (a complete one before it), then at a
    random moment of the resumed launch (mid-step or mid-save); every step each launch logged has the uninterrupted
    run's loss bit for bit, and a last launch resumes from the newest complete checkpoint and ends on the same losses.
    One chain of launches, not a fresh run.dir per kill: each launch after the first is itself a resume."""
    cache = tmp_path / "cache"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(train_cmd(tmp_path / "ref", cache), check=True, capture_output=True, env=env, timeout=600)
    reference = last_losses(tmp_path / "ref")
    assert sorted(reference) == list(range(1, 11))
    run_dir, rng = tmp_path / "run", random.Random(0)
    metrics = run_dir / "metrics.jsonl"
    logged = lambda: metrics.read_text().count("\n") if metrics.exists() else 0  # noqa: E731
    kills = []
    for trial in range(2):
        proc = subprocess.Popen(train_cmd(run_dir, cache), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=env, preexec_fn=die_with_parent)
        try:
            if trial == 0:  # mid-write of step 4's or a later checkpoint: step 2's is complete to fall back to
                saving = wait_for_a_save(proc, run_dir, after=2)
                assert saving is not None and proc.poll() is None, "the run ended before a save could be caught"
            else:  # one or two steps after the resume, then somewhere in the next step or the save after it
                target, deadline = logged() + rng.randint(1, 2), time.monotonic() + 600
                while logged() < target and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(rng.uniform(0.0, 0.2))
                assert proc.poll() is None, "the run ended before the kill"
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        kills.append((max(last_losses(run_dir), default=0), saving_step(run_dir)))
        if trial == 0:  # the save was cut short: its temporary folder is left, never renamed to a checkpoint
            assert saving_step(run_dir) == saving, kills
        got = last_losses(run_dir)
        assert got == {s: reference[s] for s in got}, (trial, kills)  # this launch resumed where it should
    newest = max(s for s, path in list_checkpoints(run_dir) if manifest_problem(path) is None)
    done = subprocess.run(train_cmd(run_dir, cache), capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"from step {newest}" in done.stdout, (kills, done.stdout[-3000:])  # resumed, not restarted
    assert last_losses(run_dir) == reference  # every step's loss, including those after the kills, bit for bit
    print("SIGKILLed (last logged step, save in progress):", kills, "checkpoints:",
          [s for s, _ in list_checkpoints(run_dir)])


def test_damaged_latest_checkpoint_falls_back(fast_cfg, capsys):
    cfg = fast_cfg("train.max_steps=4", "train.save_every=2", "train.eval_every=0")
    Trainer(cfg, cfg.run.dir, CPU).fit()
    shard = Path(cfg.run.dir) / "checkpoints" / "step_4" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated after the save finished
    assert latest_checkpoint(cfg.run.dir, report=lambda _: None)[0] == 2
    resumed = Trainer(fast_cfg("train.max_steps=4", "train.save_every=2", "train.eval_every=0"), cfg.run.dir, CPU)
    assert resumed.resumed_from == 2
    assert "step_4 is incomplete or corrupt" in capsys.readouterr().out


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_second_run_on_a_held_run_dir_is_refused_and_kill_9_leaves_no_stale_lock(tmp_path):
    """A fault report: two runs with one run.dir interleaved their metrics and one crashed. The second now stops at
    start with one line (exit 2) and changes nothing; after kill -9 of the first, a resume is not blocked."""
    run_dir, env = tmp_path / "run", dict(os.environ, OMP_NUM_THREADS="1")
    first = subprocess.Popen(train_cmd(run_dir, tmp_path / "cache", "train.max_steps=100000", "train.keep_last=2"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, preexec_fn=die_with_parent)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "checkpoints" / "step_2").is_dir() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (run_dir / "checkpoints" / "step_2").is_dir()
        # paused, the first run still holds run.dir (its process lives) but leaves the cores to the second
        first.send_signal(signal.SIGSTOP)
        overrides = (run_dir / ".hydra" / "overrides.yaml").read_text()
        second = subprocess.run(train_cmd(run_dir, tmp_path / "cache"), capture_output=True, text=True, env=env,
                                timeout=300)
        assert second.returncode == 2, second.stderr[-2000:]
        assert second.stderr.splitlines() == [
            f"difflm: error: run.dir='{run_dir}' is in use by another run (pid {first.pid} on {os.uname().nodename}): "
            "wait for it to end, or choose another run.dir"]
        assert (run_dir / ".hydra" / "overrides.yaml").read_text() == overrides  # Hydra's record is the first run's
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    step, _ = latest_checkpoint(run_dir)
    resumed = subprocess.run(train_cmd(run_dir, tmp_path / "cache", f"train.max_steps={step + 1}"),
                             capture_output=True, text=True, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"from step {step}" in resumed.stdout and (run_dir / ".difflm.lock").exists()


def test_a_run_dir_on_a_full_disk_is_one_line(tmp_path):
    """The lock file's holder line is the first thing a run writes: a disk with no room for it (here a file-size
    limit, RLIMIT_FSIZE, which fails the write as a full disk does) is refused in one line naming run.dir."""
    import resource

    from difflm.training.run_dir import claim_run_dir

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
    try:
        with pytest.raises(DifflmError) as err:
            claim_run_dir(tmp_path / "run")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(err.value) == (f"run.dir='{tmp_path / 'run'}' cannot be written (File too large): make room there or "
                              "choose another run.dir")


@pytest.mark.slow  # starts processes: make test-fast leaves it out
@pytest.mark.parametrize("kind", ["existing file", "file as parent", "checkpoints is a file", "read-only"])
def test_run_dir_problems_are_one_line(tmp_path, kind):
    """A fault report: run.dir problems ended in tracebacks. Each is one line naming run.dir, exit 2, nothing
    written or removed."""
    from difflm.training.run_dir import claim_run_dir

    target, needle = tmp_path / "run", "cannot be created or written"
    if kind == "existing file":
        target.write_text("my notes\n")
        needle = "is an existing file, not a directory"
    elif kind == "file as parent":
        (tmp_path / "afile").write_text("x")
        target = tmp_path / "afile" / "run"
    elif kind == "checkpoints is a file":
        target.mkdir()
        (target / "checkpoints").write_text("x")
        needle = "holds a file named checkpoints"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only directories")
        (tmp_path / "ro").mkdir(mode=0o500)
        target = tmp_path / "ro" / "run"
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(DifflmError) as err:
        claim_run_dir(target)
    assert str(err.value).startswith(f"run.dir='{target}'") and needle in str(err.value) and "\n" not in str(err.value)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    if kind == "existing file":  # and the CLI: one line, exit 2, before Hydra writes anything
        out = subprocess.run(train_cmd(target, tmp_path / "cache"), capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and out.stderr.splitlines() == [f"difflm: error: {err.value}"]
        assert target.read_text() == "my notes\n"


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_default_run_dirs_of_jobs_started_together_differ(tmp_path):
    """A fault report: the default run.dir resolved ${now:} to the second, so two jobs started in the same second
    shared it. Now it carries a per-process random id."""
    procs = [subprocess.Popen([sys.executable, "-m", "difflm.train", "--cfg", "job", "--resolve"], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    dirs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        dirs.append(next(line.split("dir: ")[1] for line in out.splitlines() if line.startswith("  dir: outputs/")))
    assert dirs[0] != dirs[1] and all(len(d.rsplit("-", 1)[1]) == 6 for d in dirs)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_checkpoints_missing_their_data_stop_the_run_without_touching_them(fast_cfg, tmp_path):
    """A fault report: when no checkpoint is complete (a step dir without manifest.json, one whose .distcp is
    gone), the run started afresh and later replaced them. Now: one line naming run.dir, exit 2, files untouched."""
    cfg = fast_cfg("train.max_steps=4", "train.save_every=2", "train.eval_every=0")
    Trainer(cfg, cfg.run.dir, CPU).fit()
    ckpts = Path(cfg.run.dir) / "checkpoints"
    (ckpts / "step_2" / "manifest.json").unlink()
    (ckpts / "step_4" / "__0_0.distcp").unlink()  # its manifest lists it
    before = _tree(Path(cfg.run.dir))
    with pytest.raises(DifflmError) as err:
        Trainer(fast_cfg("train.max_steps=6", "train.save_every=2", "train.eval_every=0"), cfg.run.dir, CPU)
    msg = str(err.value)
    assert msg.startswith(f"run.dir='{cfg.run.dir}': no checkpoint is complete (step_4: __0_0.distcp is missing; "
                          "step_2: no manifest.json (the save did not finish))") and "\n" not in msg
    assert _tree(Path(cfg.run.dir)) == before
    out = subprocess.run([sys.executable, "-m", "difflm.train", *FAST, "train.max_steps=6", "train.eval_every=0",
                          f"run.dir={cfg.run.dir}", f"data.cache_dir={cfg.data.cache_dir}"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.splitlines() == [f"difflm: error: {msg}"], out.stderr[-2000:]
    hydra_files = (".hydra", ".difflm", "train.log")  # Hydra's record of the invocation and its (appended) log
    assert {k: v for k, v in _tree(Path(cfg.run.dir)).items() if not k.startswith(hydra_files)} == before


def test_damaged_newer_checkpoint_is_moved_aside_not_overwritten(fast_cfg, capsys):
    cfg = fast_cfg("train.max_steps=4", "train.save_every=2", "train.eval_every=0")
    Trainer(cfg, cfg.run.dir, CPU).fit()
    ckpts = Path(cfg.run.dir) / "checkpoints"
    (ckpts / "step_4" / "__0_0.distcp").unlink()
    kept = _tree(ckpts / "step_4")
    trainer = Trainer(fast_cfg("train.max_steps=4", "train.save_every=2", "train.eval_every=0"), cfg.run.dir, CPU)
    assert trainer.resumed_from == 2
    out = capsys.readouterr().out
    assert "step_4 is incomplete or corrupt (__0_0.distcp is missing): moved to step_4.damaged" in out
    trainer.fit()  # saves a new step_4
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_2", "step_4", "step_4.damaged"]
    assert _tree(ckpts / "step_4.damaged") == kept


def test_unreadable_trainer_state_is_one_line(fast_cfg):
    cfg = fast_cfg("train.max_steps=2", "train.save_every=2", "train.eval_every=0")
    Trainer(cfg, cfg.run.dir, CPU).fit()
    state = Path(cfg.run.dir) / "checkpoints" / "step_2" / "trainer_state.pt"
    state.write_bytes(b"\0" * state.stat().st_size)  # same size: the manifest (no checksums) cannot tell
    with pytest.raises(DifflmError, match=r"checkpoints/step_2: trainer_state.pt cannot be read .*move step_2 away"):
        Trainer(cfg, cfg.run.dir, CPU)


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata"])
def test_a_checkpoint_whose_tensor_files_cannot_be_decoded_is_called_damaged_not_another_model(fast_cfg, name):
    """Bytes overwritten in place (same size: the manifest without checksums cannot tell) are not a checkpoint of
    another model, with model settings to pass: the resumed run and the weights' readers (difflm-eval, -generate,
    -export) say it is damaged."""
    from difflm.checkpoint.store import load_trained_weights
    from difflm.model import build_model

    cfg = fast_cfg("train.max_steps=2", "train.save_every=2", "train.eval_every=0")
    Trainer(cfg, cfg.run.dir, CPU).fit()
    step = Path(cfg.run.dir) / "checkpoints" / "step_2"
    with open(step / name, "r+b") as f:
        f.write(b"x" * 64)
    message = (rf"^checkpoint .*checkpoints/step_2 is damaged: its files cannot be read \(UnpicklingError: invalid "
               r"load key, 'x'.\); restore it from a copy, or move step_2 away to use an earlier checkpoint "
               r"\(train.checkpoint_checksums=true finds such damage at resume and moves the checkpoint aside by "
               r"itself\)$")
    with pytest.raises(DifflmError, match=message):
        Trainer(fast_cfg("train.max_steps=3", "train.save_every=2", "train.eval_every=0"), cfg.run.dir, CPU)
    if name == ".metadata":  # every reader needs it (the distcp bytes overwritten here are the optimizer's)
        with pytest.raises(DifflmError, match=message):
            load_trained_weights(Path(cfg.run.dir), step, build_model(cfg.model, causal=False, device=CPU, seed=0),
                                 cfg)


def _started_run(run_dir: Path, cache: Path) -> subprocess.Popen:
    """A long difflm-train process, returned once it has logged two steps."""
    proc = subprocess.Popen(train_cmd(run_dir, cache, "train.max_steps=100000", "train.save_every=0"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), preexec_fn=die_with_parent)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        time.sleep(0.2)
    return proc


@pytest.mark.slow  # starts processes: make test-fast leaves it out
@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, EXIT_REQUEUE), (signal.SIGINT, EXIT_INTERRUPTED)])
def test_sigterm_and_ctrl_c_save_and_exit(tmp_path, sig, status):
    run_dir = tmp_path / "run"
    proc = _started_run(run_dir, tmp_path / "cache")
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == status, stderr[-2000:]
    step, _ = latest_checkpoint(run_dir)
    assert step >= 2 and f"stopped at step {step} ({sig.name}); checkpoint saved" in stdout
    assert "Traceback" not in stderr


def test_second_ctrl_c_stops_at_once_in_one_line(capsys):
    """The first Ctrl-C asks for a save; the second raises KeyboardInterrupt at once, which every entry point
    reports as one line with the shell's status 130."""
    from difflm.cli import exits_cleanly
    from difflm.training.preemption import StopRequest, exit_status

    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when pytest was started in the background
    stop = StopRequest()
    try:
        # To the main thread itself: os.kill may land on another thread (pytest-xdist's I/O thread), and the handler
        # then runs only after a long sleep has ended, possibly outside pytest.raises. Python runs handlers between
        # bytecodes, so short sleeps in a loop give it those points.
        main = threading.main_thread().ident
        signal.pthread_kill(main, signal.SIGINT)
        for _ in range(500):
            if stop.reason:
                break
            time.sleep(0.01)
        assert stop.should_stop() and exit_status(stop.reason) == EXIT_INTERRUPTED and stop.reason == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            signal.pthread_kill(main, signal.SIGINT)
            for _ in range(500):
                time.sleep(0.01)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) == before

    def train():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_:
        exits_cleanly(train)()
    assert exit_.value.code == EXIT_INTERRUPTED
    assert capsys.readouterr().err.strip() == "difflm: Ctrl-C: saving at the end of this step and exiting (Ctrl-C " \
        "again stops at once, without saving)\n\ndifflm: interrupted"


def test_time_limit_saves_and_stops(fast_cfg):
    cfg = fast_cfg("train.max_steps=50", "train.save_every=0", "train.eval_every=0", "train.time_limit=1e-3")
    trainer = Trainer(cfg, cfg.run.dir, CPU)
    trainer.fit()
    assert trainer.stop_reason == "train.time_limit" and trainer.step == 1
    assert latest_checkpoint(cfg.run.dir)[0] == 1


def poison(trainer: Trainer, steps: set[int], value: float):
    """Make the model's logits ``value`` times larger (inf/nan: non-finite) on the given data steps."""
    forward = trainer.model.forward

    def patched(*args, **kwargs):
        out = forward(*args, **kwargs)
        return out * value if trainer.data_step in steps else out

    trainer.model.forward = patched


@pytest.mark.parametrize("fused, lag", [(False, 0), (True, 0), (True, 1)], ids=["host-check", "device-skip",
                                                                              "device-skip-settled-late"])
def test_non_finite_step_is_skipped(fast_cfg, fused, lag):
    """The foreach AdamW skips after the host reads the finite check; the fused one (the GPU default, also on the
    CPU) skips on the device, and with ``settle_lag`` 1 (the GPU's) the host reads the outcome a step later."""
    cfg = fast_cfg("train.max_steps=4", "train.save_every=0", "train.eval_every=0", "logger.log_every=1",
                   f"optim.fused={str(fused).lower()}")
    trainer = Trainer(cfg, cfg.run.dir, CPU)
    assert skips_on_device(trainer.optimizer) == fused
    trainer.settle_lag = lag
    poison(trainer, {2}, float("nan"))
    before = {}
    real_step = trainer._finish_step

    def spy(*args, **kwargs):
        if trainer.step == 2:
            before.update({k: v.clone() for k, v in trainer.model.state_dict().items()})
        out = real_step(*args, **kwargs)
        if trainer.step == 3:  # the poisoned step changed no weight
            assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
        return out

    trainer._finish_step = spy
    trainer.fit()
    assert trainer.step == 4 and trainer.skipped_steps == 1
    rows = [json.loads(x) for x in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()]
    # metrics.jsonl is strict JSON: the NaN loss is null, named under "nonfinite"
    assert rows[2]["loss"] is None and "loss" in rows[2]["nonfinite"]
    assert rows[-1]["skipped_steps"] == 1 and math.isfinite(rows[-1]["loss"])


@pytest.mark.parametrize("lag", [0, 1])
def test_too_many_non_finite_steps_stop_the_run(fast_cfg, lag):
    """Steps 3-5 train on poisoned data; settled a step late (the GPU's way), the run has launched step 6 (also
    poisoned) when it sees the third, and counts it before saving. metrics.jsonl (and W&B) end with the row of the
    step the run stopped at, with its skipped steps, whatever logger.log_every: the record of why the run ended."""
    cfg = fast_cfg("train.max_steps=10", "train.save_every=0", "train.eval_every=0", "train.max_skipped_steps=3",
                   "optim.fused=true", "logger.log_every=4")
    trainer = Trainer(cfg, cfg.run.dir, CPU)
    trainer.settle_lag = lag
    poison(trainer, set(range(2, 10)), float("inf"))
    with pytest.raises(DifflmError, match="train.max_skipped_steps=3"):
        trainer.fit()
    assert trainer.step == 5 + lag and latest_checkpoint(cfg.run.dir)[0] == 5 + lag
    assert trainer.skipped_steps == 3 + lag
    rows = [json.loads(x) for x in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped_steps"]) for r in rows] == [(4, 2), (5 + lag, 3 + lag)]
    assert rows[-1]["loss"] is None and "loss" in rows[-1]["nonfinite"]


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_settling_a_step_late_logs_the_same_rows(fast_cfg, tmp_path):
    """The GPU's way of reading each step's outcome after launching the next (``settle_lag`` 1) writes the same
    metrics rows as reading it at once: same steps, losses, gradient norms, skips, evaluations and checkpoints."""
    rows, checkpoints = {}, {}
    for lag in (0, 1):
        cfg = fast_cfg("train.max_steps=7", "train.save_every=3", "train.eval_every=3", "logger.log_every=2",
                       "optim.fused=true", "logger.num_samples=0", f"run.dir={tmp_path / f'lag{lag}'}")
        trainer = Trainer(cfg, cfg.run.dir, CPU)
        trainer.settle_lag = lag
        poison(trainer, {3}, float("nan"))
        order, launch, settle = [], trainer.train_step, trainer._settle
        trainer.train_step = lambda: (out := launch(), order.append(("launch", trainer.step)))[0]
        trainer._settle = lambda record: (order.append(("settle", record.step)), settle(record))[1]
        trainer.fit()
        if lag:  # step 1 is read after step 2 is launched; step 3 (evaluated, saved) before step 4 is
            assert order[:6] == [("launch", 1), ("launch", 2), ("settle", 1), ("launch", 3), ("settle", 2),
                                 ("settle", 3)] and order[6] == ("launch", 4)
        else:
            assert order[:4] == [("launch", 1), ("settle", 1), ("launch", 2), ("settle", 2)]
        keep = ("step", "loss", "grad_norm", "lr", "skipped_steps", "val_nelbo", "data_epochs", "nonfinite")
        rows[lag] = [{k: r.get(k) for k in keep} for r in map(json.loads, (Path(cfg.run.dir) / "metrics.jsonl")
                                                              .read_text().splitlines())]
        checkpoints[lag] = [step for step, _ in list_checkpoints(cfg.run.dir)]
    assert [r["step"] for r in rows[1]] == [0, 2, 3, 4, 6, 7]  # every 2nd step, evaluations at 3 and 6, the last
    assert rows[1][3]["step"] == 4 and rows[1][3]["skipped_steps"] == 1 and rows[1][3]["loss"] is None
    assert "loss" in rows[1][3]["nonfinite"]  # strict JSON: the NaN is null, named under "nonfinite"
    assert str(rows[0]) == str(rows[1])  # equality of every value
    assert checkpoints[0] == checkpoints[1] == [3, 6, 7]


@pytest.mark.parametrize("lag", [0, 1])
def test_a_stop_on_a_logging_step_keeps_its_row(fast_cfg, monkeypatch, lag):
    """A stop request (signal or train.time_limit) at a logging step: that step's row is written before the
    checkpoint, also when its outcome was still unread (settled a step late, the GPU's way)."""
    import difflm.training.trainer as trainer_module

    class StopAtStep4(trainer_module.StopRequest):
        def should_stop(self):
            if trainer.step >= 4:
                self.reason = "SIGTERM"
            return self.reason is not None

    monkeypatch.setattr(trainer_module, "StopRequest", StopAtStep4)
    cfg = fast_cfg("train.max_steps=10", "logger.log_every=2", "train.save_every=0", "train.eval_every=0",
                   "optim.fused=true")
    trainer = Trainer(cfg, cfg.run.dir, CPU)
    trainer.settle_lag = lag
    trainer.fit()
    rows = [json.loads(x) for x in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()]
    assert trainer.stop_reason == "SIGTERM" and [r["step"] for r in rows] == [2, 4]
    assert latest_checkpoint(cfg.run.dir)[0] == 4


class RecordingWatchdog:
    """Stands in for StepWatchdog: the test records whether it is armed when the trainer evaluates or saves."""

    def __init__(self):
        self.armed, self.seen = False, []

    def arm(self):
        self.armed = True

    def disarm_step(self):
        self.armed = False

    def close(self):
        self.armed = False


@pytest.mark.parametrize("lag", [0, 1])
def test_the_step_timeout_and_tokens_per_s_leave_evaluation_out(fast_cfg, monkeypatch, lag):
    """train.step_timeout arms around a step and the wait for its outcome, never around evaluation, a checkpoint or
    a roll-back; the first tokens/s window starts after the step-0 evaluation, not before it. The evaluation's
    length is a jump of the trainer's clock (1,000 s), not a sleep: a test that slept 3 s and wanted two steps
    inside 2.5 s failed on a loaded CI machine, where the first two steps alone took longer."""
    from types import SimpleNamespace

    import difflm.training.trainer as trainer_module

    clock = {"offset": 0.0}
    monkeypatch.setattr(trainer_module, "time", SimpleNamespace(perf_counter=lambda: time.perf_counter()
                                                                + clock["offset"]))

    cfg = fast_cfg("train.max_steps=4", "logger.log_every=2", "train.save_every=2", "train.eval_every=4",
                   "train.step_timeout=60", "optim.fused=true")
    trainer = Trainer(cfg, cfg.run.dir, CPU)
    trainer.settle_lag = lag
    watchdogs = []
    monkeypatch.setattr(trainer_module, "StepWatchdog", lambda *a, **k: watchdogs.append(RecordingWatchdog()) or
                        watchdogs[-1])
    evaluate, save = trainer._eval_metrics, trainer.save

    def slow_evaluation(metrics):
        watchdogs[0].seen.append(("eval", metrics["step"], watchdogs[0].armed))
        if metrics["step"] == 0:
            clock["offset"] += 1000.0
        return evaluate(metrics)

    def recorded_save():
        watchdogs[0].seen.append(("save", trainer.step, watchdogs[0].armed))
        return save()

    trainer._eval_metrics, trainer.save = slow_evaluation, recorded_save
    trainer.fit()
    assert watchdogs[0].seen == [("eval", 0, False), ("save", 2, False), ("eval", 4, False), ("save", 4, False)]
    rows = [json.loads(x) for x in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 2, 4]
    tokens = 2 * cfg.train.global_batch_size * cfg.data.seq_len  # two steps in the step-2 window
    assert rows[1]["tokens_per_s"] > tokens / 100.0  # the 1,000 s evaluation is not in it


def test_loss_spike_reloads_and_skips_the_data(fast_cfg, capsys):
    cfg = fast_cfg("train.max_steps=8", "train.save_every=2", "train.eval_every=0", "train.spike_threshold=3")
    trainer = Trainer(cfg, cfg.run.dir, CPU)
    poison(trainer, {5}, 1e4)  # data step 5 gives a huge but finite loss
    trainer.fit()
    assert trainer.step == 8 and trainer.data_offset == 2  # steps 5-6 (data 5..) redone on data 6..
    assert "loss spike at data step 5: reloaded step 4, data continues at step 6" in capsys.readouterr().out


def test_a_spike_right_after_a_roll_back_is_caught_too(fast_cfg, capsys):
    """A fault report: the running mean was dropped at a roll-back, so the first step after it went unchecked and a
    second spike there (data steps 5 and 6 both bad) was trained on and checkpointed. The pre-spike mean is kept:
    both are rolled back. And thresholds that would call ordinary steps spikes (<= 1) or negative long-run settings
    are refused by name."""
    from difflm.config.validate import check_run

    cfg = fast_cfg("train.max_steps=8", "train.save_every=2", "train.eval_every=0", "train.spike_threshold=3")
    trainer = Trainer(cfg, cfg.run.dir, CPU)
    poison(trainer, {5, 6}, 1e4)
    trainer.fit()
    out = capsys.readouterr().out
    assert "loss spike at data step 5: reloaded step 4, data continues at step 6" in out
    assert "loss spike at data step 6: reloaded step 4, data continues at step 7" in out
    assert trainer.step == 8 and trainer.data_offset == 3
    for override, message in (("train.spike_threshold=0.5", "train.spike_threshold=0.5 must be 0 (off) or a factor "
                                                            "above 1"),
                              ("train.keep_last=-3", "train.keep_last=-3 must be >= 0"),
                              ("train.time_limit=-1", "train.time_limit=-1.0 must be >= 0"),
                              ("logger.num_samples=-1", "logger.num_samples=-1 must be >= 0")):
        with pytest.raises(DifflmError, match=re.escape(message)):
            check_run(fast_cfg(override, "device=cpu"))


def test_a_loss_that_stays_above_the_spike_threshold_stops_the_run(fast_cfg, capsys):
    """Each roll-back keeps the pre-spike mean, so a loss that stays above threshold x mean (a mean set by one lucky
    step, a level that moved for good) rolled back to the same checkpoint without end, skipping data and training
    nothing. After train.max_skipped_steps roll-backs in a row the next spike stops the run in one line."""
    cfg = fast_cfg("train.max_steps=12", "train.save_every=2", "train.eval_every=0", "train.spike_threshold=3",
                   "train.max_skipped_steps=2")
    trainer = Trainer(cfg, cfg.run.dir, CPU)
    poison(trainer, set(range(5, 30)), 1e4)
    with pytest.raises(DifflmError) as err:
        trainer.fit()
    out = capsys.readouterr().out
    assert "loss spike at data step 5: reloaded step 4, data continues at step 6" in out
    assert "loss spike at data step 6: reloaded step 4, data continues at step 7" in out
    assert "data step 7:" not in out
    message = str(err.value)
    assert message.startswith("the loss stayed above train.spike_threshold=3 x its running mean")
    assert "after 2 roll-backs in a row to step 4 (train.max_skipped_steps=2)" in message
    assert message.endswith("inspect the data from data step 5 on") and "\n" not in message
    assert [s for s, _ in list_checkpoints(cfg.run.dir)] == [2, 4]


def test_retention_keeps_last_and_every(fast_cfg):
    cfg = fast_cfg("train.max_steps=7", "train.save_every=1", "train.eval_every=0", "train.keep_last=2",
                   "train.keep_every=3")
    Trainer(cfg, cfg.run.dir, CPU).fit()
    assert [s for s, _ in list_checkpoints(cfg.run.dir)] == [3, 6, 7]


def test_step_timeout_dumps_stacks(tmp_path):
    code = ("from difflm.training.watchdog import StepWatchdog\nimport time\n"
            f"w = StepWatchdog({str(tmp_path)!r}, 0.5)\nw.arm()\n"
            "def stuck_in_collective():\n    time.sleep(30)\nstuck_in_collective()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    dump = (tmp_path / "hang_rank0.txt").read_text()
    assert "stuck_in_collective" in dump and "Timeout" in dump


def test_profiler_writes_a_trace(fast_cfg):
    cfg = fast_cfg("train.max_steps=3", "train.save_every=0", "train.eval_every=0", "profile.enabled=true",
                   "profile.wait=0", "profile.warmup=1", "profile.active=1")
    Trainer(cfg, cfg.run.dir, CPU).fit()
    traces = list((Path(cfg.run.dir) / "profile").glob("*.json*"))
    assert traces and "ProfilerStep" in traces[0].read_text()[:2_000_000]


def test_saved_stop_requests_a_slurm_requeue(tmp_path, monkeypatch):
    from difflm.training.preemption import request_slurm_requeue

    log = tmp_path / "scontrol.log"
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {log}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert not request_slurm_requeue() and not log.exists()  # not under SLURM: nothing to do
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert request_slurm_requeue()
    assert log.read_text().split() == ["requeue", "4242"]


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_signal_to_one_rank_stops_every_rank_and_resume_matches(tmp_path):
    """DDP on 2 gloo ranks: SIGUSR1 to rank 1 only; the stop is collective (both ranks save the same step),
    and the resumed run reproduces the uninterrupted one."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    common = [*FAST, "parallel=ddp", "device=cpu", "train.eval_every=0", "logger.log_every=1",
              "objective.random_length_prob=0", f"data.cache_dir={tmp_path / 'cache'}"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                "difflm.train"]
    subprocess.run([*torchrun, *common, "train.max_steps=6", "train.save_every=0", f"run.dir={tmp_path / 'ref'}"],
                   env=env, check=True, capture_output=True, timeout=600)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([*torchrun, *common, "train.max_steps=6", "train.save_every=0", f"run.dir={run_dir}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks = subprocess.run(["pgrep", "-f", f"difflm.train.*run.dir={run_dir}"], capture_output=True, text=True)
    workers = sorted(int(p) for p in ranks.stdout.split() if int(p) != proc.pid)
    os.kill(workers[-1], signal.SIGUSR1)  # the last-started worker: rank 1
    output, _ = proc.communicate(timeout=300)
    step, _ = latest_checkpoint(run_dir)
    assert 1 <= step < 6
    assert f"stopped at step {step} (another rank's stop request)" in output, output[-3000:]
    subprocess.run([*torchrun, *common, "train.max_steps=6", "train.save_every=0", f"run.dir={run_dir}"],
                   env=env, check=True, capture_output=True, timeout=600)
    assert last_losses(run_dir) == pytest.approx(last_losses(tmp_path / "ref"), rel=1e-6)


def test_checksums_catch_a_flipped_byte(fast_cfg):
    cfg = fast_cfg("train.max_steps=4", "train.save_every=2", "train.eval_every=0", "train.checkpoint_checksums=true")
    Trainer(cfg, cfg.run.dir, CPU).fit()
    shard = Path(cfg.run.dir) / "checkpoints" / "step_4" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the SHA-256 can tell
    shard.write_bytes(bytes(data))
    messages = []
    assert latest_checkpoint(cfg.run.dir, report=messages.append)[0] == 2
    assert "does not match its SHA-256" in messages[0]


def worker_pids(launcher: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of the difflm.train workers a torchrun launch started (from /proc: their RANK variable)."""
    from difflm import script_cli

    found = {}
    for pid in script_cli.descendants(launcher.pid):
        try:
            items = Path(f"/proc/{pid}/environ").read_text().split("\0")
            env = dict(item.split("=", 1) for item in items if "=" in item)
            cmdline = Path(f"/proc/{pid}/cmdline").read_text()
        except OSError:
            continue
        if "difflm.train" in cmdline and "RANK" in env and "torch.distributed.run" not in cmdline:
            found[int(env["RANK"])] = pid
    return found


@pytest.mark.slow
def test_sigkill_one_rank_of_tp2pp2_mid_save_and_mid_step_then_resume_matches(tmp_path):
    """tp2 x pp2 on 4 gloo ranks: twice in a row, SIGKILL one rank picked at random, first while the ranks write a
    checkpoint (a complete one before it), then at a random moment of the resumed launch (mid-step or mid-save);
    torchrun stops the others, the same command resumes from the last complete checkpoint, and every step any of the
    launches logged has the uninterrupted run's loss, bit for bit. (A save cut short may still be completed by rank 0,
    if the victim had passed the save's last barrier, or removed by it, if the lost peer fails its collective first:
    either is a consistent state to resume from.)"""
    from difflm import script_cli

    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m",
                "difflm.train", *FAST, "parallel=tp2pp2", "device=cpu", "train.eval_every=0", "logger.log_every=1",
                "objective.random_length_prob=0", "train.max_steps=10", "train.save_every=2",
                f"data.cache_dir={tmp_path / 'cache'}"]
    subprocess.run([*torchrun, f"run.dir={tmp_path / 'ref'}"], env=env, check=True, capture_output=True, timeout=900)
    reference = last_losses(tmp_path / "ref")
    assert sorted(reference) == list(range(1, 11))
    run_dir, rng, kills = tmp_path / "run", random.Random(0), []
    metrics = run_dir / "metrics.jsonl"
    logged = lambda: metrics.read_text().count("\n") if metrics.exists() else 0  # noqa: E731
    complete_steps = lambda: [s for s, path in list_checkpoints(run_dir) if manifest_problem(path) is None]  # noqa: E731
    for trial in range(2):
        with open(tmp_path / f"trial{trial}.log", "w") as log:
            proc = subprocess.Popen([*torchrun, f"run.dir={run_dir}"], env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 600
            ranks = {}
            while len(ranks) < 4 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
                ranks = worker_pids(proc)
            if trial == 0:  # mid-write of step 4's or a later checkpoint: step 2's is complete to fall back to
                saving = wait_for_a_save(proc, run_dir, after=2)
                assert saving is not None, "the run ended before a save could be caught"
            else:  # one or two steps after the resume, then somewhere in the next step or the save after it
                target = logged() + rng.randint(1, 2)
                while logged() < target and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(rng.uniform(0.0, 0.5))
            assert proc.poll() is None and len(ranks) == 4, "the launch ended before the kill"
            victim = rng.randrange(4)
            os.kill(ranks[victim], signal.SIGKILL)
            kills.append((victim, max(last_losses(run_dir), default=0)))
            proc.wait(timeout=300)  # torchrun stops the surviving ranks and fails
        finally:
            if proc.poll() is None:
                script_cli.stop_tree([proc])
        got = last_losses(run_dir)
        assert got == {s: reference[s] for s in got}, (trial, kills)  # this launch resumed where it should
    newest = max(complete_steps())  # a checkpoint is never deleted for a damaged one
    done = subprocess.run([*torchrun, f"run.dir={run_dir}"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:]
    assert f"from step {newest}" in done.stdout, (kills, done.stdout[-3000:])  # resumed, not restarted
    assert last_losses(run_dir) == reference
    print("SIGKILLed (rank, last logged step):", kills, "checkpoints:", [s for s, _ in list_checkpoints(run_dir)])


def test_next_steps_data_is_prepared_on_the_data_thread_and_equals_the_inline_batches(fast_cfg):
    """After a step, the next step's windows and noise are being prepared on the trainer's data thread (not inline
    before the step's one sync); what the thread returns equals preparing the same data step inline. The trainer
    starts the thread for a GPU only (on the CPU the host is the device): the test gives the CPU trainer one."""
    import concurrent.futures

    cfg = fast_cfg("train.max_steps=3", "train.save_every=0", "train.eval_every=0")
    trainer = Trainer(cfg, cfg.run.dir, CPU)
    assert trainer._data_thread is None
    trainer._data_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="difflm-data")
    seen = []
    real = trainer._host_batches

    def spy(data_step):
        seen.append((data_step, threading.current_thread().name))
        return real(data_step)

    trainer._host_batches = spy
    trainer.train_step()
    data_step, future = trainer._prefetched
    assert data_step == 1
    tokens, batches, seq_len = future.result()
    assert seen == [(0, threading.main_thread().name), (1, seen[1][1])] and seen[1][1].startswith("difflm-data")
    tokens_inline, batches_inline, seq_inline = real(1)
    assert seq_len == seq_inline == cfg.data.seq_len
    for a, b in zip(tokens, tokens_inline):
        assert torch.equal(a.tokens if hasattr(a, "tokens") else a, b.tokens if hasattr(b, "tokens") else b)
    for a, b in zip(batches, batches_inline):
        for name in ("input_ids", "targets", "loss_mask", "weights", "loss_index"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert batches[0].loss_index.numel() == int(batches[0].loss_mask.sum()) > 0
    trainer.train_step()  # consumes the prefetched step 1
    assert trainer.step == 2 and trainer._prefetched[0] == 2


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_time_limit_counts_from_the_process_start():
    """A fault report: train.time_limit counted from the start of the training loop, so imports, the model build
    and the data (which a SLURM job's time includes) were not counted and a run set to its job's length overran
    it. The limit now counts from the process's start: a process 1.5 s old with a 1 s limit stops at once, one with
    600 s does not."""
    code = ("import time; time.sleep(1.5)\n"
            "from difflm.training.preemption import StopRequest, process_age_s\n"
            "age = process_age_s(); assert 1.4 < age < 60, age\n"
            "print(StopRequest(1.0, elapsed_s=age).should_stop(), StopRequest(600.0, elapsed_s=age).should_stop())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False"]


def test_reused_run_dir_without_checkpoint_moves_the_earlier_records_aside(fast_cfg, capsys):
    """A run that saved no checkpoint (train.save_every=0) left metrics.jsonl, config.yaml and wandb_id.txt; a new
    run on the same run.dir with another model appended to those metrics and reused the W&B id. Now the new run
    moves them into run.dir/previous/<time>/ (nothing lost), says where, and starts a clean record."""
    first = fast_cfg("train.max_steps=2", "train.save_every=0", "train.eval_every=0", "logger.log_every=1")
    Trainer(first, first.run.dir, CPU).fit()
    run_dir = Path(first.run.dir)
    assert list_checkpoints(run_dir) == []
    (run_dir / "wandb_id.txt").write_text("oldrun42")  # as a logger=wandb run leaves it
    old_metrics, old_config = (run_dir / "metrics.jsonl").read_text(), (run_dir / "config.yaml").read_text()
    assert [json.loads(line)["step"] for line in old_metrics.splitlines()] == [1, 2]
    capsys.readouterr()
    second = fast_cfg("train.max_steps=3", "train.save_every=0", "train.eval_every=0", "logger.log_every=1",
                      "model.num_layers=1")
    Trainer(second, second.run.dir, CPU).fit()
    (kept,) = (run_dir / "previous").iterdir()
    assert f"has no checkpoint to resume from but holds an earlier run's records: moved them to {kept}" \
        in capsys.readouterr().out
    assert (kept / "metrics.jsonl").read_text() == old_metrics and (kept / "config.yaml").read_text() == old_config
    assert (kept / "wandb_id.txt").read_text() == "oldrun42" and not (run_dir / "wandb_id.txt").exists()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # the new run's alone
    assert "num_layers: 1" in (run_dir / "config.yaml").read_text()


class _DeviceClock:
    """A stand-in for a timing CUDA event: the device time it was recorded at, in seconds."""

    def __init__(self, at: float):
        self.at = at

    def elapsed_time(self, end: "_DeviceClock") -> float:  # milliseconds, as torch.cuda.Event.elapsed_time
        return (end.at - self.at) * 1e3


def test_tokens_per_s_windows_are_timed_on_the_device(fast_cfg):
    """On a GPU the host sees a step end only once it has queued the next step, late by as much as it runs ahead, and
    the last step is settled at once: a window timed by the host's reads was short by that lag (a 1.7B run logged
    165 k tokens/s, 210 % MFU, for its last step against 48.5 k before). Windows between two device events take the
    device's time; without events (the CPU) the host's."""
    from difflm.training.trainer import _Progress, _StepRecord

    cfg = fast_cfg("device=cpu", "train.max_steps=1")
    trainer = Trainer(cfg, cfg.run.dir, torch.device("cpu"))
    record = _StepRecord(step=7, data_step=7, lr=1e-3, tokens=4000, log=True, values=torch.zeros(3),
                         event=_DeviceClock(13.0), graph_replays=None, end_time=100.0, loss=1.0, grad_norm=1.0)
    trainer._progress = _Progress(window_start=99.6, window_start_event=_DeviceClock(11.0), window_tokens=4000)
    assert trainer._log_metrics(record, has_moe=False)["tokens_per_s"] == pytest.approx(2000.0)  # 4000 / 2 s
    record.event = None
    trainer._progress = _Progress(window_start=98.0, window_tokens=4000)
    assert trainer._log_metrics(record, has_moe=False)["tokens_per_s"] == pytest.approx(2000.0)  # host: 4000 / 2 s
