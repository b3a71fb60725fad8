"""scripts/layout_check.py on CPU (gloo): its correctness and reshard parts against real runs, and its pure helpers.

One script launch runs 3 ``difflm.train`` launches (a single-process reference, tp2 on 2 ranks saving at step 2,
that checkpoint resumed under fsdp on 2 ranks), about 45 s on 2 cores; the te backend and cp rows are skipped
on CPU. FP32 layouts agree with one process to ~1e-7 in the loss (tests/test_parallel.py: 1e-5).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_script, script_usage_error

from difflm import script_cli

ROOT = Path(__file__).resolve().parent.parent
SHARED = ["model=tiny", "data.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=8"]


lc = load_script("layout_check")


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_cpu_correctness_and_reshard(tmp_path):
    """... with a relative --out: the run folders are made in the folder the script was started from."""
    out = tmp_path / "lc"
    cmd = [sys.executable, str(ROOT / "scripts" / "layout_check.py"), "--device", "cpu", "--gpus", "2",
           "--parts", "correctness,reshard", "--steps", "4", "--layouts", "tp2,cp2", "--backends", "torch,te",
           "--reshard-from", "tp2", "--timeout", "240", "--out", "lc", "--", *SHARED]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not (ROOT / "lc").exists()
    rows = json.loads((out / "layout_check.json").read_text())["rows"]
    got = {(r["part"], r["backend"], r["layout"]): r for r in rows}
    assert list(got) == [
        ("correctness", "torch", "single"), ("correctness", "torch", "tp2"),
        ("correctness", "torch", "cp2"), ("correctness", "te", "single"),
        ("reshard", "torch", "tp2>fsdp"), ("reshard", "te", "tp2>fsdp"),
    ]
    assert got["correctness", "torch", "single"]["status"] == "reference"
    for key in [("correctness", "torch", "tp2"), ("reshard", "torch", "tp2>fsdp")]:
        row = got[key]
        assert row["status"] == "ok", row
        assert row["loss_diff"] < 1e-4 and row["grad_diff"] < 1e-3, row
        assert row["tokens_per_s_per_gpu"] is None or row["tokens_per_s_per_gpu"] > 0
    assert "vs uninterrupted tp2" in got["reshard", "torch", "tp2>fsdp"]["note"]
    assert got["correctness", "torch", "cp2"]["status"] == "skipped"
    assert "CUDA only" in got["correctness", "torch", "cp2"]["note"]
    assert got["correctness", "te", "single"]["status"] == "skipped"
    assert got["reshard", "te", "tp2>fsdp"]["status"] == "skipped"
    # the resumed run really resumed: only steps 3-4 logged, from the copied step-2 checkpoint
    resumed = lc.read_metrics(out / "reshard" / "torch" / "tp2-to-fsdp")
    assert sorted(resumed) == [3, 4]
    assert (out / "correctness" / "torch" / "tp2" / "checkpoints" / "step_2").is_dir()
    # the table is printed row by row and once more at the end
    assert proc.stdout.count("reshard     torch") == 2


def write_metrics(run_dir: Path, tokens: list[float], mfu: list) -> None:
    run_dir.mkdir(parents=True)
    lines = [json.dumps({"step": i + 1, "loss": 10.0 - i, "grad_norm": 1.0, "tokens_per_s_per_gpu": t, "mfu": m})
             for i, (t, m) in enumerate(zip(tokens, mfu))]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_throughput_summary_median_after_warmup_and_efficiency(tmp_path):
    # steps 1-3 are warmup (slow, compilation); medians over steps 4-8
    write_metrics(tmp_path / "one", [10.0, 50.0, 90.0, 100.0, 104.0, 98.0, 1000.0, 102.0],
                  [0.01, 0.2, 0.3, 0.40, 0.42, 0.38, 4.0, 0.41])
    write_metrics(tmp_path / "two", [5.0, 80.0, 90.0, 95.0, 97.0, 96.0, 99.0, 94.0], [None] * 8)
    one = lc.summarize_throughput(lc.read_metrics(tmp_path / "one"), warmup=3)
    assert one == {"tokens_per_s_per_gpu": 102.0, "mfu": 0.41, "steps": 5}
    two = lc.summarize_throughput(lc.read_metrics(tmp_path / "two"), warmup=3)
    assert two["tokens_per_s_per_gpu"] == 96.0 and two["mfu"] is None  # no peak known (CPU): no MFU
    assert lc.scaling_efficiency(two["tokens_per_s_per_gpu"], one["tokens_per_s_per_gpu"]) == pytest.approx(96 / 102)
    assert lc.scaling_efficiency(None, 102.0) is None and lc.scaling_efficiency(96.0, None) is None
    with pytest.raises(ValueError, match="no logged step"):
        lc.summarize_throughput(lc.read_metrics(tmp_path / "two"), warmup=8)


def test_max_rel_diffs_and_missing_steps():
    ref = {s: {"loss": 10.0, "grad_norm": 2.0} for s in (1, 2, 3)}
    got = {1: {"loss": 10.0, "grad_norm": 2.0}, 2: {"loss": 10.1, "grad_norm": 2.0},
           3: {"loss": 9.95, "grad_norm": 2.2}}
    loss, grad = lc.max_rel_diffs(got, ref, [1, 2, 3])
    assert loss == pytest.approx(0.01) and grad == pytest.approx(0.1)
    with pytest.raises(KeyError, match=r"\[4\]"):
        lc.max_rel_diffs(got, ref, [1, 2, 3, 4])


@pytest.mark.parametrize("global_batch,micro,dp,pp,expected", [
    (16, 4, 2, 1, 4), (16, 4, 8, 1, 2), (16, 4, 1, 2, 4), (8, 8, 1, 2, 4), (8, 2, 2, 2, 2), (6, 4, 4, 1, 4),
])
def test_fit_micro_batch(global_batch, micro, dp, pp, expected):
    assert lc.fit_micro_batch(global_batch, micro, dp, pp) == expected


def test_layout_arithmetic_and_skips():
    assert lc.min_ranks("tp2pp2") == 4 and lc.min_ranks("fsdp") == 1 and lc.min_ranks("tp4pp2") == 8
    assert lc.dp_degree("tp2", 8) == 4 and lc.dp_degree("tp2pp2", 4) == 1 and lc.dp_degree("ddp", 2) == 2
    assert lc.skip_reason("cp2", "torch", "cpu", 2) == "cp: CUDA only"
    assert lc.skip_reason("fsdp", "te", "cpu", 2) == "te backend: CUDA only"
    assert lc.skip_reason("pp2", "te", "cuda", 2) is None  # pipeline stages come from the one model
    assert lc.skip_reason("tp4", "torch", "cuda", 2) == "needs 4 GPUs"
    assert lc.skip_reason("cp2", "te", "cuda", 2) is None


def test_error_excerpt_finds_the_root_cause():
    torchrun = "\n".join([
        "[rank1]: Traceback (most recent call last):", "[rank1]: RuntimeError: peer closed",
        "[rank0]: Traceback (most recent call last):", "[rank0]:   File x", "[rank0]: ValueError: the real one",
        "Traceback (most recent call last):", "torch...ChildFailedError:", "Root Cause (first observed failure):",
        "[0]:", "  time      : now", "  rank      : 0 (local_rank: 0)", "  exitcode  : 1",
    ])
    assert lc.error_excerpt(torchrun).splitlines() == ["[rank0]: Traceback (most recent call last):",
                                                      "[rank0]:   File x", "[rank0]: ValueError: the real one"]
    one_line = "noise\ndifflm: error: precision=fp8 needs an FP8-capable NVIDIA GPU\nmore noise"
    assert lc.error_excerpt(one_line) == "difflm: error: precision=fp8 needs an FP8-capable NVIDIA GPU"
    assert lc.error_excerpt("\n".join(map(str, range(100))), n=3) == "97\n98\n99"


def test_plan_lists_every_launch_of_a_gpu_run(tmp_path, capsys):
    earlier = '{"rows": [{"status": "ok"}]}'  # an earlier run's results in --out: --plan writes nothing over them
    (tmp_path / "layout_check.json").write_text(earlier)
    rows = lc.main(["--plan", "--gpus", "8", "--out", str(tmp_path), "--parts", "correctness,reshard,throughput,big",
                    "--", "model=125m", "precision=bf16", "train.micro_batch_size=4", "train.global_batch_size=16"])
    by = {(r.part, r.backend, r.precision, r.layout, r.gpus): r for r in rows}
    assert by["correctness", "torch", "bf16", "tp4pp2", 8].status == "planned"
    assert by["correctness", "te", "bf16", "tp4pp2", 8].status == "planned"  # TE stages come from the one model
    assert by["reshard", "torch", "bf16", "tp2pp2>fsdp", 8].status == "planned"
    assert by["correctness", "torch", "bf16", "ddp", 8].note == "micro-batch 2"  # 16 / (2 x 8 dp)
    assert [r.gpus for r in rows if r.part == "throughput" and r.backend == "te" and r.precision == "fp8"] == \
        [1, 2, 4, 8, 8, 8]
    assert not any(r.backend == "torch-compile" and r.precision == "fp8" for r in rows)
    assert {(r.backend, r.precision, r.layout) for r in rows if r.part == "big"} == {("te", "bf16", "fsdp"),
                                                                                   ("te", "fp8", "fsdp")}
    printed = capsys.readouterr().out
    assert "--nproc-per-node=8" in printed and "train.global_batch_size=128" in printed  # 4 x 4 x 8 weak scaling
    assert (tmp_path / "layout_check.json").read_text() == earlier and sorted(tmp_path.iterdir()) == [
        tmp_path / "layout_check.json"]
    assert printed.splitlines()[-len(rows) - 2].endswith("; --plan: nothing written")


def test_variants_precisions_and_launch_environment():
    assert lc.parse_variant("tp2:parallel.tp_comm_overlap=true") == ("tp2", ["parallel.tp_comm_overlap=true"],
                                                                     "tp2+overlap")
    assert lc.parse_variant("ddp:parallel.reduce_dtype=bf16:parallel.fsdp_prefetch=2") == \
        ("ddp", ["parallel.reduce_dtype=bf16", "parallel.fsdp_prefetch=2"], "ddp+bf16red+fsdp_prefetch=2")
    assert lc.parse_variant("fsdp") == ("fsdp", [], "fsdp")
    assert lc.for_precision("bf16@tp2", "bf16") == "tp2" and lc.for_precision("bf16@tp2", "fp8") is None
    assert lc.for_precision("tp2:x=1", "fp8") == "tp2:x=1"
    assert lc.launch_env(["model.backend=te", "parallel=tp2"]) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert lc.launch_env(["model.backend=te", "parallel=ddp"]) == {}
    assert lc.launch_env(["model.backend=torch", "parallel=tp2"]) == {}
    assert lc.launch_env(["model.backend=te", "parallel=fsdp", "parallel.tp=2"]) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert lc.SAFE_ENV["UB_SKIPMC"] == "1" and lc.SAFE_ENV["NCCL_NVLS_ENABLE"] == "0"


def test_plan_runs_baselines_side_by_side(tmp_path, capsys):
    """The 2-GPU throughput call of the docstring: both 1-GPU baselines at once on GPUs 0 and 1, then the rows."""
    rows = lc.main(["--plan", "--gpus", "2", "--parts", "throughput,big", "--out", str(tmp_path), "--tput-backends",
                    "te", "--precisions", "bf16,fp8", "--dp-layout", "ddp", "--tp-layouts", "bf16@tp2",
                    "--tput-variants", "ddp:parallel.reduce_dtype=bf16,tp2:parallel.tp_comm_overlap=true",
                    "--big-model", "8b", "--big-micro", "1", "--big-precisions", "bf16"])
    got = [(r.part, r.precision, r.layout, r.gpus) for r in rows]
    assert got == [("throughput", "bf16", "single", 1), ("throughput", "bf16", "ddp", 2),
                   ("throughput", "bf16", "tp2", 2), ("throughput", "bf16", "ddp+bf16red", 2),
                   ("throughput", "bf16", "tp2+overlap", 2), ("throughput", "fp8", "single", 1),
                   ("throughput", "fp8", "ddp", 2), ("throughput", "fp8", "ddp+bf16red", 2),
                   ("throughput", "fp8", "tp2+overlap", 2), ("big", "bf16", "fsdp", 2)]
    printed = capsys.readouterr().out.splitlines()
    launches = [line for line in printed if line.startswith("# ")]
    assert "CUDA_VISIBLE_DEVICES=0" in launches[0] and "te-bf16/1.7b-single" in launches[0]
    assert "CUDA_VISIBLE_DEVICES=1" in launches[1] and "te-fp8/1.7b-single" in launches[1]
    overlap = next(line for line in launches if "tp2+overlap" in line and "te-fp8" in line)
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in overlap and "parallel.tp_comm_overlap=true" in overlap


def test_counts_presets_and_devices_are_refused_in_one_line_before_any_launch(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    presets = "cp2, ddp, ep2, fsdp, hsdp, pp2, pp4, single, tp2, tp2cp2, tp2pp2, tp4, tp4pp2, tp8"
    for argv, says in [
        (["--device", "cpu", "--gpus", "0"], "argument --gpus: invalid choice: 0 (choose from 2, 4, 8)"),
        (["--gpus", "2"], "layout_check.py needs a CUDA GPU (torch.cuda.is_available() is False); --device cpu runs "
                          "a gloo dry run, --plan prints the launches"),
        (["--plan", "--steps", "0"], "argument --steps: 0 is below 1: give an integer >= 1"),
        (["--plan", "--timeout", "-1"], "argument --timeout: -1 is not a finite number > 0: give one above 0"),
        (["--plan", "--layouts", "ddp,nosuch"], f"argument --layouts: 'nosuch': not a known parallel preset; choose "
                                                f"from {presets} (comma-separated)"),
        (["--plan", "--tput-variants", "nosuch:parallel.tp=2"], f"--tput-variants nosuch:parallel.tp=2: 'nosuch' is "
                                                                f"not a parallel preset (choose from {presets})"),
        (["--plan", "--tp-layouts", "fp9@tp2"], "--tp-layouts fp9@tp2: 'fp9' is not a precision preset (choose from "
                                                "bf16, fp16, fp32, fp8)"),
        (["--plan", "--parts", "correctness,speed"], "argument --parts: 'speed': not a known part; choose from "
                                                     "correctness, reshard, throughput, big (comma-separated)"),
    ]:
        assert script_usage_error(lc, capsys, *argv) == f"layout_check.py: error: {says}\n", argv
    assert list(tmp_path.iterdir()) == []  # nothing launched, nothing written
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert script_usage_error(lc, capsys, "--gpus", "2") == (
        "layout_check.py: error: --gpus 2: this host has 1 CUDA GPU; run on a host with 2 or more (--device cpu runs "
        "a gloo dry run)\n")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert script_usage_error(lc, capsys, "--gpus", "8") == ("layout_check.py: error: --gpus 8: this host has 4 CUDA "
                                                             "GPUs; pass --gpus 4\n")


def test_cpu_defaults_and_paths_relative_to_the_caller(tmp_path, monkeypatch):
    """--device cpu: the throughput and big rows default to model=tiny at S=64 in fp32 on the torch backend (not the
    GPU defaults, 1.7b / 8b at S=4096); --out is the caller's relative path made absolute."""
    monkeypatch.chdir(tmp_path)
    cpu = lc.parse_args(["--device", "cpu", "--out", "runs"])
    assert cpu.out == tmp_path / "runs" and lc.parse_args([]).out == tmp_path / "layout_check"
    assert (cpu.tput_model, cpu.tput_seq, cpu.big_model, cpu.precisions, cpu.tput_backends, cpu.big_backends) == \
        ("tiny", 64, "tiny", ["fp32"], ["torch"], ["torch"])
    gpu = lc.parse_args(["--gpus", "4"])
    assert (gpu.tput_model, gpu.tput_seq, gpu.big_model, gpu.precisions, gpu.layouts) == \
        ("1.7b", 4096, "8b", ["bf16", "fp8"], lc.LAYOUTS[4])
    assert lc.parse_args(["--device", "cpu", "--tput-model", "125m"]).tput_model == "125m"


def test_launches_run_in_the_callers_folder_with_this_difflm(tmp_path, monkeypatch):
    """A launch starts in the caller's folder (relative override paths mean what they meant there) with this
    checkout's difflm first on PYTHONPATH, through script_cli.start (it ends with the script)."""
    monkeypatch.chdir(tmp_path)
    seen = {}
    real = script_cli.start

    def start(cmd, **kwargs):
        seen.update(cmd=cmd, **kwargs)
        return real([sys.executable, "-c", "pass"], **kwargs)

    monkeypatch.setattr(script_cli, "start", start)
    runner = lc.Runner(script_cli.caller_path("out"), "cpu", 60, None)
    result = runner.run("correctness/torch/single", 1, ["parallel=single"])
    assert result.ok and result.run_dir == tmp_path / "out" / "correctness" / "torch" / "single"
    assert "cwd" not in seen and seen["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
    assert f"run.dir={result.run_dir}" in seen["cmd"] and f"data.cache_dir={tmp_path / 'out' / 'cache'}" in seen["cmd"]
