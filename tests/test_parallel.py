"""Parallel layouts (difflm.parallel) on CPU with gloo: every layout trains the same loss curve as one process.

Each layout is one ``torchrun`` launch of ``python -m difflm.train ... device=cpu`` (2 or 4 ranks, a 4-block
model of width 64, 32-token windows, 3 steps) compared with a single-process reference run computed once (in the
test's process). The 2-rank runs that only compare numbers (BF16 reduction, samples under tp2, BD3-LM and SFT
under pp2/ddp) share one spawn of 2 ranks that runs them one after the other.
Losses agree to 1e-5 (relative); gradient norms to 1e-4, because the reference's own FP32 norm of the
50k x 64 LM-head gradient (``clip_grad_norm_``) carries ~2e-5 of summation error, which a sharded norm does
not reproduce bit for bit. Resharded resumes: a tp2pp2 checkpoint resumes under fsdp on 4 ranks and in one
process; a single-process checkpoint resumes under dp2 x tp2. Every launch builds its model on the meta device and
materialises each rank's shards (tests/test_materialize.py); under TP the LM head and cross-entropy are vocab-parallel
(tests/test_vocab_parallel.py). The data-parallel levers that only move communication (no resharding after forward,
explicit prefetch, gradient sync every micro-batch) keep the curve to 1e-5; BF16 gradient reduction stays within
1e-3. Context parallelism needs CUDA: its layout test skips on CPU, its sharding arithmetic is tested here.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import compose_run, spawn_ranks
from difflm.errors import DifflmError

COMMON = [
    "model.hidden_size=64", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
    "model.ffn_hidden_size=128", "data.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
    "train.eval_every=0", "logger.num_samples=0", "logger.progress_bar=false", "logger.log_every=1",
    "schedule.warmup_steps=2", "device=cpu", "objective.random_length_prob=0",
]
LOSS_RTOL, NORM_RTOL = 1e-5, 1e-4


def launch(nproc: int, run_dir: Path, cache: Path, *overrides: str, cwd: Path | None = None,
           common: list[str] = COMMON) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node nproc -m difflm.train`` (plain ``python -m`` for one process),
    with the ``common`` overrides first."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="1", OMP_NUM_THREADS="1")
    prefix = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] \
        if nproc > 1 else [sys.executable]
    cmd = [*prefix, "-m", "difflm.train", *common, f"data.cache_dir={cache}", f"run.dir={run_dir}", *overrides]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=cwd)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "Slicing a flattened dim" not in out.stderr  # torch's notice, once per rank and slice, is silenced
    return out


def train_here(run_dir: Path, cache: Path, *overrides: str, common: list[str] = COMMON) -> None:
    """The one-process run of ``difflm-train`` with the ``common`` overrides first, in this process: the checks
    (``check_run``) and the Trainer the command runs, without a process start. The single-process references are
    not about the process."""
    from difflm.config.validate import check_run
    from difflm.training.trainer import Trainer

    cfg = compose_run([*common, f"data.cache_dir={cache}", f"run.dir={run_dir}", *overrides], auto=True)
    Trainer(cfg, run_dir, check_run(cfg)).fit()


def rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r.get("loss") is not None}


def assert_same_curve(run_dir: Path, reference: dict[int, dict], steps, loss_rtol: float = LOSS_RTOL,
                      norm_rtol: float = NORM_RTOL) -> None:
    got = rows(run_dir)
    assert sorted(got) == list(steps), sorted(got)
    for s in steps:
        assert got[s]["loss"] == pytest.approx(reference[s]["loss"], rel=loss_rtol), (s, got[s], reference[s])
        assert got[s]["grad_norm"] == pytest.approx(reference[s]["grad_norm"], rel=norm_rtol), (s, got[s], reference[s])


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("parallel")


@pytest.fixture(scope="module")
def reference(work) -> dict[int, dict]:
    """One process, 4 steps, checkpoints at steps 2 and 4 (also the data cache every launch shares)."""
    train_here(work / "single", work / "cache", "train.max_steps=4", "train.save_every=2")
    got = rows(work / "single")
    assert sorted(got) == [1, 2, 3, 4]
    return got


def _two_rank_worker(rank: int, world: int, port: int, out: str) -> None:
    """A rank of a spawn that runs several layouts' runs (:func:`two_rank_runs`): the runs of ``out/spec.json``
    ([run.dir, overrides] each) one after the other, each as difflm-train runs it under torchrun (its checks with the
    launch's world size, then the Trainer), in one process group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from difflm.config.validate import check_run
    from difflm.parallel.distributed import destroy_distributed, init_distributed
    from difflm.training.trainer import Trainer

    for run_dir, overrides in json.loads(Path(out, "spec.json").read_text()):
        cfg = compose_run([*overrides, f"run.dir={run_dir}"], auto=True)
        device = init_distributed(check_run(cfg, world), timeout_s=cfg.train.collective_timeout)
        Trainer(cfg, run_dir, device).fit()
    torch.save(None, Path(out, f"rank{rank}.pt"))
    destroy_distributed()


SFT = ["objective=sft", "objective.loss_norm=token", "data.prompt_field=prompt", "data.response_field=response",
       "data.valid_fraction=0", "train.max_steps=2", "train.save_every=0"]
AR_SAMPLES = ["objective=ar", "train.max_steps=1", "train.save_every=0", "logger.num_samples=2", "gen.length=5"]
BD3LM = ["objective=bd3lm", "objective.block_size=8", "train.max_steps=2", "train.save_every=0"]


@pytest.fixture(scope="module")
def two_rank_runs(work) -> Path:
    """The 2-rank runs of the tests below that compare a run's numbers or samples with one process (nothing about
    the command line or Hydra's files, which the layout tests check on torchrun launches): one spawn of 2 ranks
    (``spawn_ranks``) runs them one after the other, so the ranks' start (torch, difflm), most of a 3-step run's
    time, is paid once. Returns their folder: ``bf16_reduce`` (ddp), ``ar_tp2``, ``bd3lm_pp2``, ``sft_ddp``,
    ``sft_pp2``."""
    root = work / "two_ranks"
    root.mkdir()
    pairs = sft_pairs(work / "pairs.jsonl")
    runs = [
        ("bf16_reduce", "cache", ["train.max_steps=3", "train.save_every=0", "parallel=ddp",
                                  "parallel.reduce_dtype=bf16"]),
        ("ar_tp2", "cache", [*AR_SAMPLES, "parallel=tp2"]),
        ("bd3lm_pp2", "cache", [*BD3LM, "parallel=pp2"]),
        ("sft_ddp", "sft_cache", [*SFT, f"data.path={pairs}", "parallel=ddp"]),
        ("sft_pp2", "sft_cache", [*SFT, f"data.path={pairs}", "parallel=pp2"]),
    ]
    (root / "spec.json").write_text(json.dumps([[str(root / name), [*COMMON, f"data.cache_dir={work / cache}",
                                                                     *overrides]] for name, cache, overrides in runs]))
    spawn_ranks(_two_rank_worker, 2, root)
    return root


LAYOUTS = {
    "ddp": (2, ["parallel=ddp"]),
    "fsdp": (2, ["parallel=fsdp"]),
    "tp2_sp": (2, ["parallel=tp2"]),
    "pp2_1f1b": (2, ["parallel=pp2", "logger.num_samples=1"]),  # no sampler under PP: a notice, not silence
    "pp2_interleaved": (2, ["parallel=pp2", "parallel.pp_schedule=Interleaved1F1B", "parallel.pp_virtual_stages=2"]),
    # data-parallel levers that change when and how often FSDP2 communicates, not what it computes
    "fsdp_levers": (2, ["parallel=fsdp", "parallel.reshard_after_forward=false", "parallel.fsdp_prefetch=2",
                        "parallel.grad_sync=every"]),
}


@pytest.mark.slow  # starts processes: make test-fast leaves it out
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, work, reference, tmp_path):
    nproc, overrides = LAYOUTS[name]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    run_dir = work / name
    out = launch(nproc, run_dir, work / "cache", "train.max_steps=3", "train.save_every=0", *overrides, cwd=cwd)
    assert_same_curve(run_dir, reference, [1, 2, 3])
    if "logger.num_samples=1" in overrides:
        assert out.stdout.count("difflm: logger.num_samples=1: no samples during training here (parallel.pp=2 splits "
                                "the model into stages); sample a checkpoint with difflm-generate") == 1
        assert not (run_dir / "samples.txt").exists()
    # rank 0 alone writes: one metrics file, one config, Hydra's files in run.dir, nothing in the other ranks' cwd
    assert (run_dir / "config.yaml").exists() and (run_dir / ".hydra").is_dir()
    assert list(cwd.iterdir()) == []


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_end_of_training_samples_under_sequence_parallelism(work, two_rank_runs, tmp_path):
    """A fault report: objective=ar under parallel=tp2 (sequence parallel) trained, saved, then crashed in gloo at
    the end-of-training samples, since left-to-right decoding calls the model at every length and the sequence
    shards must be equal. The trainer pads each sampler call to a multiple of parallel.tp: the samples are the
    one-process run's, token for token."""
    train_here(tmp_path / "single", work / "cache", *AR_SAMPLES)
    single = (tmp_path / "single" / "samples.txt").read_text()
    assert single.count("--- step 1 sample") == 2
    assert (two_rank_runs / "ar_tp2" / "samples.txt").read_text() == single


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_bf16_gradient_reduction_stays_close_to_single_process(reference, two_rank_runs):
    """parallel.reduce_dtype=bf16 rounds the summed gradients to BF16 (8 bits of mantissa): the curve moves, a little."""
    got = rows(two_rank_runs / "bf16_reduce")
    for s in (1, 2, 3):
        assert got[s]["loss"] == pytest.approx(reference[s]["loss"], rel=1e-3)
        assert got[s]["grad_norm"] == pytest.approx(reference[s]["grad_norm"], rel=2e-2)
    assert any(got[s]["grad_norm"] != reference[s]["grad_norm"] for s in (1, 2, 3))  # it did reduce in BF16


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_bd3lm_under_pp2_matches_single_process(work, two_rank_runs, tmp_path):
    """Pipeline stages carry BD3-LM's block-causal mask and repeated positions (shared by all micro-batches)."""
    train_here(tmp_path / "single", work / "cache", *BD3LM)
    assert_same_curve(two_rank_runs / "bd3lm_pp2", rows(tmp_path / "single"), [1, 2])


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_tp2pp2_saves_and_fsdp4_resumes_from_it(work, reference):
    """tp2 x pp2 on 4 ranks (steps 1-3, checkpoint at 2); its step-2 checkpoint resumes under fsdp on 4 ranks."""
    src = work / "tp2pp2"
    launch(4, src, work / "cache", "parallel=tp2pp2", "train.max_steps=3", "train.save_every=2")
    assert_same_curve(src, reference, [1, 2, 3])
    assert sorted(p.name for p in (src / "checkpoints").iterdir()) == ["step_2", "step_3"]
    assert len(list((src / "checkpoints" / "step_2").glob("*.distcp"))) == 4  # one shard file per rank

    dst = work / "tp2pp2_to_fsdp4"
    (dst / "checkpoints").mkdir(parents=True)
    shutil.copytree(src / "checkpoints" / "step_2", dst / "checkpoints" / "step_2")
    out = launch(4, dst, work / "cache", "parallel=fsdp", "train.max_steps=4", "train.save_every=0")
    assert "from step 2" in out.stdout
    assert_same_curve(dst, reference, [3, 4])


@pytest.mark.slow  # its fixture starts processes: make test-fast leaves it out
def test_single_process_resumes_a_tp2pp2_checkpoint(work, reference, fast_cfg):
    """...and back: the sharded tp2pp2 checkpoint loads in one process (in-process Trainer)."""
    from difflm.training.trainer import Trainer

    src = work / "tp2pp2" / "checkpoints" / "step_2"
    if not src.exists():
        pytest.skip("needs test_tp2pp2_saves_and_fsdp4_resumes_from_it")
    dst = work / "tp2pp2_to_single"
    (dst / "checkpoints").mkdir(parents=True)
    shutil.copytree(src, dst / "checkpoints" / "step_2")
    cfg = compose_run([*COMMON, f"data.cache_dir={work / 'cache'}", f"run.dir={dst}", "train.max_steps=4",
                       "train.save_every=0"])
    trainer = Trainer(cfg, dst, torch.device("cpu"))
    assert trainer.resumed_from == 2
    trainer.fit()
    assert_same_curve(dst, reference, [3, 4])


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_single_process_checkpoint_resumes_under_dp2_tp2(work, reference):
    """FSDP2 x TP (sequence parallel) on 4 ranks, from the reference's step-2 checkpoint."""
    dst = work / "single_to_dp2tp2"
    (dst / "checkpoints").mkdir(parents=True)
    shutil.copytree(work / "single" / "checkpoints" / "step_2", dst / "checkpoints" / "step_2")
    out = launch(4, dst, work / "cache", "parallel=tp2", "train.max_steps=4", "train.save_every=4",
                 "train.async_save=true")
    assert "from step 2" in out.stdout
    assert_same_curve(dst, reference, [3, 4])
    assert (dst / "checkpoints" / "step_4").is_dir()  # the asynchronous save was published at the end
    assert not list((dst / "checkpoints").glob(".step_*.tmp"))


def test_async_save_single_process_is_published_and_resumes(fast_cfg):
    from difflm.training.trainer import Trainer

    cfg = fast_cfg("train.max_steps=2", "train.save_every=1", "train.eval_every=0", "train.async_save=true")
    Trainer(cfg, cfg.run.dir, torch.device("cpu")).fit()
    assert sorted(p.name for p in (Path(cfg.run.dir) / "checkpoints").iterdir()) == ["step_1", "step_2"]
    assert Trainer(cfg, cfg.run.dir, torch.device("cpu")).resumed_from == 2


def sft_pairs(path: Path) -> Path:
    """16 prompt/response pairs whose prompts run from 1 to 24 words: response lengths differ between ranks."""
    lines = [json.dumps({"prompt": " ".join(["word"] * (1 + (7 * i) % 24)), "response": f"answer {i} is {i * i}"})
             for i in range(16)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow  # starts processes: make test-fast leaves it out
@pytest.mark.parametrize("overrides", [["parallel=ddp"], ["parallel=pp2"]], ids=["ddp", "pp2"])
def test_sft_token_loss_is_the_same_under_dp_and_pp(work, two_rank_runs, overrides):
    """A fault report: the ``loss_norm=token`` normaliser is the response-token count of the GLOBAL batch on every
    data-parallel rank and pipeline micro-batch, so dp2 and pp2 train the one-process curve of objective=sft."""
    if not (work / "sft_single" / "metrics.jsonl").exists():
        train_here(work / "sft_single", work / "sft_cache", *SFT, f"data.path={work / 'pairs.jsonl'}",
                   "train.micro_batch_size=8")
    assert_same_curve(two_rank_runs / f"sft_{overrides[0].split('=')[1]}", rows(work / "sft_single"), [1, 2])


@pytest.mark.slow  # its fixture starts processes: make test-fast leaves it out
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="context parallelism runs on CUDA only (ring attention / TE kernels); CPU has no CP path")
def test_cp2_matches_single_process(work, reference):
    run_dir = work / "cp2"
    launch(2, run_dir, work / "cache", "parallel=cp2", "train.max_steps=3", "train.save_every=0", "device=cuda")
    assert_same_curve(run_dir, reference, [1, 2, 3])


# ------------------------------------------------------------------ pure pieces, no processes
def test_context_parallel_shards_reassemble():
    from difflm.parallel.context_parallel import load_balanced_indices, shard_sequence, unshard_sequence

    x = torch.arange(2 * 24).reshape(2, 24)
    for cp in (1, 2, 3):
        shards = [shard_sequence(x, cp, r) for r in range(cp)]
        assert all(s.shape == (2, 24 // cp) for s in shards)
        assert torch.equal(unshard_sequence(shards), x)
    assert load_balanced_indices(8, 2, 0).tolist() == [0, 1, 6, 7]  # chunks r and 2cp-1-r (TE's dual chunk swap)
    with pytest.raises(ValueError, match="multiple of 2"):
        load_balanced_indices(10, 4, 0)


def test_gate_up_interleave_is_a_row_permutation():
    from difflm.parallel.tensor_parallel import deinterleave_gate_up, interleave_gate_up

    f, tp = 8, 2
    w = torch.arange(2 * f, dtype=torch.float32)[:, None].expand(2 * f, 3)
    inter = interleave_gate_up(w, tp)
    # rank r's contiguous block is [gate rows of r; up rows of r]
    assert inter[: f][:, 0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert torch.equal(deinterleave_gate_up(inter, tp), w)


def test_parallel_dims_fill_and_mesh_order():
    from difflm.parallel.mesh import MESH_DIMS, ParallelDims

    cfg = compose_run(["parallel=tp2pp2"])
    dims = ParallelDims.from_config(cfg.parallel, 8)
    assert (dims.dp_shard, dims.tp, dims.pp, dims.dp) == (2, 2, 2, 2)
    assert MESH_DIMS == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert dims.shape() == (2, 1, 2, 1, 2)


@pytest.mark.parametrize("overrides,world,needle", [
    (["parallel=tp2"], 3, "parallel.dp_shard=-1 cannot fill the world size 3"),
    (["parallel=single"], 2, "parallel.dp_replicate*dp_shard*tp*pp*cp=1 but the world size is 2"),
    # a fault report: the overridden layout was named by its preset ("parallel=single runs on 3 process(es)"), and
    # launching 3 processes only led to the heads error, which now comes first
    (["parallel=single", "parallel.tp=4"], 2, "this layout (dp_replicate=1 dp_shard=1 tp=4 pp=1 cp=1) runs on 4"),
    (["parallel=single", "parallel.tp=3"], 2, "parallel.tp=3 does not divide model.num_heads=4"),
    (["parallel=tp4", "model.num_kv_heads=2"], 4, "parallel.tp=4 does not divide model.num_kv_heads=2"),
    (["parallel=tp2", "model.ffn_hidden_size=129"], 2, "model.ffn_hidden_size=129"),
    (["parallel=tp2", "model.vocab_multiple=1"], 2, "model.vocab_multiple=1"),
    (["parallel=pp4", "model.num_layers=2"], 4, "model.num_layers=2"),
    (["parallel=tp2", "data.seq_len=33"], 2, "data.seq_len=33 is not a multiple of 2 (parallel.tp=2 with "
     "parallel.sequence_parallel=true): change data.seq_len or set parallel.sequence_parallel=false"),
    (["parallel=tp2", "parallel.cp=2", "data.seq_len=36"], 4, "data.seq_len=36 is not a multiple of 8 (2 x "
     "parallel.cp=2 for load-balanced context parallelism x parallel.tp=2 with parallel.sequence_parallel=true): change "
     "data.seq_len or set parallel.sequence_parallel=false"),
    (["parallel=tp2", "parallel.cp=2", "data.seq_len=34"], 4, "data.seq_len=34 is not a multiple of 8 (2 x "
     "parallel.cp=2 for load-balanced context parallelism x parallel.tp=2 with parallel.sequence_parallel=true): change "
     "data.seq_len"),
    (["parallel=pp2", "parallel.pp_schedule=ZBVZeroBubble", "model.num_layers=3"], 2,
     "parallel.pp=2 x parallel.pp_schedule=ZBVZeroBubble's 2 stages per rank = 4 stages > model.num_layers=3: every "
     "pipeline stage needs at least one block; lower parallel.pp or the schedule"),
    (["parallel=fsdp", "train.global_batch_size=6", "train.micro_batch_size=2"], 2, "train.global_batch_size=6"),
    (["parallel=pp2", "train.global_batch_size=4", "train.micro_batch_size=4"], 2, "parallel.pp=2 needs"),
    (["parallel=pp2", "parallel.pp_schedule=1F1B", "parallel.pp_virtual_stages=2"], 2, "parallel.pp_virtual_stages=1"),
    (["parallel=cp2", "device=cpu"], 2, "parallel.cp>1 needs CUDA"),
    (["parallel=tp2", "model.tie_embeddings=true"], 2, "model.tie_embeddings=true"),
    (["parallel=fsdp", "parallel.activation_checkpointing=some"], 2, "parallel.activation_checkpointing='some'"),
    (["parallel=pp2", "data.intra_document_attention=true"], 2, "data.intra_document_attention=true gives every"),
    (["parallel=cp2", "objective=bd3lm", "device=cuda"], 2, "objective=bd3lm with parallel.cp=2"),
    (["parallel=fsdp", "parallel.reduce_dtype=fp16"], 2, "parallel.reduce_dtype='fp16' is not one of: fp32, bf16"),
    (["parallel=fsdp", "parallel.grad_sync=never"], 2, "parallel.grad_sync='never'"),
    (["parallel=fsdp", "parallel.fsdp_prefetch=-1"], 2, "parallel.fsdp_prefetch=-1 must be >= 0"),
    (["parallel=tp2", "parallel.tp_comm_overlap=true"], 2, "parallel.tp_comm_overlap=true needs CUDA"),
])
def test_bad_layouts_are_one_line_errors(overrides, world, needle):
    from difflm.config.validate import check_parallel, resolve_device

    cfg = compose_run(["model.num_heads=4", "model.num_kv_heads=4", "model.hidden_size=64",
                       "model.ffn_hidden_size=128", "data.seq_len=32", "train.global_batch_size=8",
                       "train.micro_batch_size=2", "model.num_layers=4", "device=cpu", *overrides])
    with pytest.raises(DifflmError) as err:
        check_parallel(cfg, world, resolve_device("cpu"))
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("overrides,needle", [
    (["parallel=fsdp"], "this layout has parallel.tp=1"),
    (["parallel=tp2", "parallel.sequence_parallel=false"], "sequence_parallel=False"),
    (["parallel=tp2", "model.backend=torch"], "set parallel.compile=true"),
    (["parallel=tp2", "model.backend=te", "objective.random_length_prob=0.01"], "objective.random_length_prob=0.01"),
])
def test_tp_comm_overlap_refusals_on_a_gpu(overrides, needle):
    """What ``parallel.tp_comm_overlap`` needs besides CUDA (checked as on a GPU machine)."""
    from difflm.config.validate import check_tp_comm_overlap
    from difflm.parallel.mesh import ParallelDims

    cfg = compose_run(["parallel.tp_comm_overlap=true", *overrides])
    with pytest.raises(DifflmError) as err:
        check_tp_comm_overlap(cfg, ParallelDims.from_config(cfg.parallel, 2), torch.device("cuda"))
    assert needle in str(err.value) and "\n" not in str(err.value)
    ok = compose_run(["parallel=tp2", "parallel.tp_comm_overlap=true", "parallel.compile=true"])
    check_tp_comm_overlap(ok, ParallelDims.from_config(ok.parallel, 2), torch.device("cuda"))  # accepted


def test_async_tensor_parallel_switch_keeps_multicast_off(monkeypatch):
    """The torch backend's tp_comm_overlap: Inductor's micro-pipelined TP, symmetric memory without multicast."""
    import torch._inductor.config as inductor_config

    from difflm.parallel.parallelize import enable_async_tensor_parallel

    monkeypatch.setattr(inductor_config, "_micro_pipeline_tp", False)
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "placeholder")
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST")
    enable_async_tensor_parallel()
    assert inductor_config._micro_pipeline_tp is True
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"


def test_random_lengths_round_to_the_layout_multiple():
    from difflm.parallel.mesh import ParallelDims
    from difflm.parallel.parallelize import effective_length_multiple

    cfg = compose_run(["parallel=tp2cp2", "objective.length_multiple=3", "data.seq_len=48"])
    dims = ParallelDims.from_config(cfg.parallel, 4)
    assert effective_length_multiple(cfg, dims) == 24  # lcm(3, 2 cp * tp) = lcm(3, 8)


def documented_launches() -> list[tuple[str, int, list[str]]]:
    """Every ``torchrun ... --nproc-per-node N ... -m difflm.train OVERRIDES`` command line of README.md and docs/:
    (where, N, overrides); lines with ``...`` placeholders or a multirun are left out."""
    import re
    import shlex

    root = Path(__file__).resolve().parent.parent
    found = []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            line = line.split("#")[0].strip().strip("`")
            match = re.match(r"torchrun .*--nproc-per-node[ =](\d+) .*-m difflm\.train(.*)$", line)
            if match is None or "..." in line or " -m " in match.group(2) + " ":
                continue
            found.append((f"{doc.name}:{number}", int(match.group(1)), shlex.split(match.group(2))))
    return found


@pytest.mark.parametrize("where,nproc,overrides", documented_launches(), ids=lambda v: v if isinstance(v, str) else "")
def test_documented_launch_commands_pass_the_layout_checks(where, nproc, overrides):
    """A fault report: the docs' headline torchrun commands (fsdp on 4 ranks, tp2pp2, tp4pp2, ep2 on 8) failed their
    first check as written, with the default batch (global 8, micro 8): too many data-parallel ranks for the micro
    batch, or one micro-batch for two pipeline stages. Every documented launch passes the layout and batch checks
    at its own process count."""
    from difflm.config.validate import check_batch, check_parallel

    cfg = compose_run(overrides)
    device = torch.device("cpu" if cfg.device == "cpu" else "cuda")
    dims = check_parallel(cfg, nproc, device)
    assert dims.world_size == nproc
    assert check_batch(cfg, nproc) >= 1


def test_the_docs_launch_commands_are_found():
    """The scan above finds the commands it is meant to check (a changed layout of the docs would skip them)."""
    found = {(nproc, " ".join(o)) for _, nproc, o in documented_launches()}
    assert any(n == 4 and "parallel=fsdp" in o for n, o in found)
    assert any(n == 8 and "parallel=ep2" in o for n, o in found)
    assert len(found) >= 4


@pytest.mark.slow  # starts torchrun
def test_a_data_refusal_on_rank_0_ends_every_rank_in_one_line(tmp_path):
    """Rank 0 builds the data first: its refusal (here a corpus too small for one window) reaches every rank, which
    each end with that one line and status 2, instead of the others' barrier failing with a gloo traceback."""
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("a corpus of a few tokens\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "difflm.train",
           *COMMON, "parallel=ddp", "model=tiny", f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
           f"run.dir={tmp_path / 'run'}"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.startswith("difflm: error:")]
    assert len(lines) == 2 and all("data.seq_len=32 leaves 0 window(s)" in line for line in lines), out.stderr[-3000:]
    assert "Connection closed" not in out.stderr and "exitcode  : 2" in out.stderr, out.stderr[-3000:]
