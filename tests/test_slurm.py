"""SLURM without a cluster: the ``hydra/launcher=slurm`` multirun through submitit's local executor (one run dir
per job), the sbatch script it would submit, and the SLURM -> torch.distributed mapping for 2 nodes x 4 tasks
(8 gloo ranks with a fake SLURM environment)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import difflm.config
from difflm.parallel.distributed import _slurm_env, first_host

from conftest import run_cli

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install '.[slurm]'")
FIXTURES = Path(__file__).resolve().parent / "fixtures"
TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=2",
        "model.ffn_hidden_size=64", "data.seq_len=16", "train.max_steps=2", "train.eval_every=0",
        "train.save_every=0", "logger.num_samples=0", "logger.progress_bar=false"]


@pytest.mark.slow  # two jobs, each a process importing torch: about 40 s on an idle 2-core machine
def test_slurm_launcher_multirun_gives_one_run_dir_per_job(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FIXTURES), os.environ.get("PYTHONPATH", "")]))
    sweep = tmp_path / "sweep"
    out = run_cli("difflm.train", "-m", "hydra/launcher=slurm",
                  "hydra.launcher._target_=hydra_plugins.difflm_slurm_local.SlurmViaLocalExecutor",
                  "hydra.launcher.tasks_per_node=1", "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1",
                  "optim.lr=1e-4,3e-4", *TINY, f"data.cache_dir={tmp_path / 'cache'}", f"run.dir={sweep}",
                  cwd=tmp_path, timeout=900)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    assert "Submitit 'slurm' sweep output dir" in out.stdout + out.stderr  # the SLURM launcher ran
    for job, lr in ((0, 1e-4), (1, 3e-4)):
        job_dir = sweep / str(job)
        rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["step"] == 2 and rows[-1]["lr"] > 0
        assert OmegaConf.load(job_dir / "config.yaml").optim.lr == lr
        assert (job_dir / ".hydra" / "overrides.yaml").exists()
    logs = sorted(p.name for p in (sweep / ".submitit").rglob("*_log.out"))
    assert len(logs) == 2  # each job ran as its own submitit job (its own process and log)


def test_sbatch_script_of_the_slurm_launcher(tmp_path, monkeypatch):
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\nexit 1\n")  # SlurmExecutor looks for srun; never run
    (tmp_path / "bin" / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", os.pathsep.join([str(tmp_path / "bin"), os.environ["PATH"]]))

    with initialize_config_dir(str(difflm.config.CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=slurm", "hydra.launcher.nodes=2",
                                          "hydra.launcher.partition=gpu", f"run.dir={tmp_path}"],
                      return_hydra_config=True)
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    params.pop("_target_")
    # the plugin's own mapping (BaseSubmititLauncher.launch): shared keys as they are, the rest as slurm_<key>
    executor = submitit.AutoExecutor(folder=params.pop("submitit_folder"), cluster="slurm",
                                     slurm_max_num_timeout=params.pop("max_num_timeout"))
    shared = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in shared else f"slurm_{k}": v for k, v in params.items()})
    script = executor._executor._make_submission_file_text("srun python -u -m submitit.core._submit", "uid")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --signal=USR1@120", "#SBATCH --requeue",
                 "#SBATCH --time=1440", "export OMP_NUM_THREADS=1"):
        assert line in script, line


@pytest.mark.parametrize("nodelist,host", [("gpu[07-08]", "gpu07"), ("gpu[07-08,12],cpu3", "gpu07"),
                                           ("cpu3,gpu[1-2]", "cpu3"), ("rack[1-2]-n[01-04]", "rack1-n01"),
                                           ("node5", "node5")])
def test_first_host_of_a_slurm_nodelist(nodelist, host):
    assert first_host(nodelist) == host


def _fake_slurm(rank: int, nodelist: str = "127.0.0.[1-2]") -> dict[str, str]:
    """What srun sets for task ``rank`` of a 2-node x 4-task job (SLURM docs, "srun: OUTPUT ENVIRONMENT")."""
    return {"SLURM_JOB_ID": "4242", "SLURM_PROCID": str(rank), "SLURM_NTASKS": "8", "SLURM_LOCALID": str(rank % 4),
            "SLURM_NODEID": str(rank // 4), "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "4",
            "SLURM_JOB_NODELIST": nodelist}


def test_slurm_env_maps_to_torchrun_variables(monkeypatch, tmp_path):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol: the nodelist is parsed
    for rank in range(8):
        for key, value in _fake_slurm(rank, "gpu[07-08]").items():
            monkeypatch.setenv(key, value)
        assert _slurm_env() == {"RANK": str(rank), "WORLD_SIZE": "8", "LOCAL_RANK": str(rank % 4),
                                "MASTER_ADDR": "gpu07", "MASTER_PORT": str(29500 + 4242 % 1000)}
    (tmp_path / "scontrol").write_text("#!/bin/sh\nprintf 'login-gpu07\\nlogin-gpu08\\n'\n")
    (tmp_path / "scontrol").chmod(0o755)
    assert _slurm_env()["MASTER_ADDR"] == "login-gpu07"  # scontrol show hostnames, when there is one


def test_world_size_without_a_rendezvous_address_is_one_line(monkeypatch):
    """WORLD_SIZE set by hand without MASTER_ADDR / MASTER_PORT (no torchrun, no SLURM task) is refused before any
    process group is made, in one line naming the missing variables and torchrun."""
    import torch

    from difflm.errors import DifflmError
    from difflm.parallel.distributed import init_distributed

    for key in ("MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(DifflmError, match="WORLD_SIZE=2 is set but MASTER_ADDR and MASTER_PORT are not: .*torchrun"):
        init_distributed(torch.device("cpu"))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(DifflmError, match="WORLD_SIZE=2 is set but MASTER_PORT is not"):
        init_distributed(torch.device("cpu"))


WORKER = """
import json, os, sys, torch
from difflm.parallel.distributed import init_distributed, launch_env, destroy_distributed
from difflm.parallel.mesh import ParallelDims, build_mesh, mesh_coordinates
env = launch_env()
init_distributed(torch.device("cpu"), timeout_s=300)
dims = ParallelDims.from_config({"dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 4, "pp": 1}, env["world_size"])
mesh = build_mesh(dims, "cpu")
total = torch.tensor([float(env["rank"])])
torch.distributed.all_reduce(total)
tp_sum = torch.tensor([float(env["rank"])])
torch.distributed.all_reduce(tp_sum, group=mesh["tp"].get_group())
out = dict(env, master=os.environ["MASTER_ADDR"], total=total.item(), tp_sum=tp_sum.item(), **mesh_coordinates(mesh))
open(sys.argv[1], "w").write(json.dumps(out))
destroy_distributed()
"""


@pytest.mark.slow  # 8 processes importing torch: 30 s on an idle 2-core machine
def test_two_nodes_of_four_tasks_make_one_gloo_world(tmp_path):
    """8 processes with a fake SLURM environment and no torchrun variables: one world of 8, TP groups inside a
    node (SLURM_LOCALID = tp coordinate), replicas across nodes (SLURM_NODEID = dp_replicate coordinate)."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    base.update(OMP_NUM_THREADS="1", PATH=os.environ["PATH"])
    base["SLURM_JOB_ID"] = str(os.getpid() % 100000)  # a port of its own: 29500 + job id % 1000
    procs = []
    for rank in range(8):
        env = dict(base, **{k: v for k, v in _fake_slurm(rank).items() if k != "SLURM_JOB_ID"})
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path / f"rank{rank}.json")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for proc in procs:
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, output[-3000:]
    for rank in range(8):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (got["rank"], got["world_size"], got["local_rank"]) == (rank, 8, rank % 4)
        assert got["master"] == "127.0.0.1" and got["total"] == sum(range(8))
        assert (got["tp"], got["dp_replicate"], got["pp"]) == (rank % 4, rank // 4, 0)
        node = rank // 4
        assert got["tp_sum"] == sum(range(4 * node, 4 * node + 4))  # the TP group is the node's 4 tasks
