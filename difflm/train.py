"""``difflm-train`` (also ``python -m difflm.train``): compose the run with Hydra, validate it, train.

    difflm-train model=tiny train.max_steps=300                 # the embedded corpus on CPU
    difflm-train model=1.7b precision=bf16 data.path=corpus/    # your data on a GPU
    difflm-train --cfg job model=1.7b                           # print the composed run
    difflm-train -m optim.lr=1e-4,3e-4                          # a sweep, one run dir per job
    torchrun --nproc-per-node 8 -m difflm.train model=1.7b parallel=tp4pp2   # a layout (docs/parallel.md)
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig

from difflm.cli import hydra_app, quote_free_text, rank_argv
from difflm.config.validate import check_config, check_run
from difflm.errors import DifflmError
from difflm.parallel.distributed import agree_run_dir, destroy_distributed, init_distributed, launch_env, \
    world_size_from_env
from difflm.training.preemption import EXIT_REQUEUE, exit_status, request_slurm_requeue


def run_dir_of_job(cfg) -> str:
    """``run.dir``, or its per-job subdirectory under a Hydra multirun (Hydra's job output dir)."""
    try:
        return HydraConfig.get().runtime.output_dir
    except ValueError:  # called outside a Hydra job (tests)
        return cfg.run.dir


def check_job_config(cfg, world_size: int, here: bool) -> None:
    """What a run checks on its config at its start (:func:`check_run`), for each job of a ``-m`` sweep before the
    first starts (:func:`difflm.cli.check_sweep`); for jobs that run elsewhere (``here`` false: another launcher) the
    part the config alone decides for ``world_size`` processes (:func:`difflm.config.validate.check_config`).
    ``cfg`` is changed as :func:`check_run` changes it (``auto`` values chosen): pass a copy to keep it."""
    if here:
        check_run(cfg, world_size)
    else:
        check_config(cfg, world_size)


@hydra_app("train", sweeps=True, job_check=check_job_config)
def _main(cfg) -> None:
    world_size = world_size_from_env()
    try:
        device = check_run(cfg, world_size)  # every check before any process group exists
        from difflm.training.run_config import check_start_checkpoint

        # an adaptation recipe without its imported model is refused; LoRA on random base weights is said
        start_warning = check_start_checkpoint(cfg, Path(run_dir_of_job(cfg)))
    except DifflmError:
        if launch_env()["rank"] != 0:  # every rank failed the same check on the same config: rank 0 says it once
            sys.exit(2)
        raise
    if start_warning is not None and launch_env()["rank"] == 0:
        print(start_warning, file=sys.stderr, flush=True)
    if cfg.model.get("auto_reason") and launch_env()["rank"] == 0:
        print(f"difflm: {cfg.model.auto_reason}", flush=True)  # what model.*=auto chose, before anything is built
    if cfg.train.get("auto_batch_reason") and launch_env()["rank"] == 0:
        print(f"difflm: {cfg.train.auto_batch_reason}", flush=True)  # train.micro_batch_size=auto's plan
    # The trainer (model, data, optimizer, DTensor) is imported once the run has passed its checks: a --help or a
    # refused config exits without paying for it.
    from difflm.training.trainer import Trainer

    if world_size > 1:
        device = init_distributed(device, timeout_s=cfg.train.collective_timeout)
    try:
        cfg.run.dir = agree_run_dir(run_dir_of_job(cfg))  # rank 0's dir (its ${now:} may differ from ours)
        trainer = Trainer(cfg, cfg.run.dir, device)
        if trainer.resumed_from is not None and trainer.is_rank0:
            print(f"resuming {cfg.run.dir} from step {trainer.resumed_from}")
        trainer.fit()
        if trainer.stop_reason is not None:
            status = exit_status(trainer.stop_reason)
            if trainer.is_rank0:
                print(f"stopped at step {trainer.step} ({trainer.stop_reason}); checkpoint saved, "
                      f"rerun the same command to resume (exit status {status})", flush=True)
                if status == EXIT_REQUEUE and request_slurm_requeue():
                    print(f"requeued SLURM job {os.environ['SLURM_JOB_ID']}", flush=True)
            destroy_distributed()
            sys.exit(status)
        if trainer.is_rank0:
            print(f"done: {cfg.run.dir}")
    finally:
        destroy_distributed()


def main() -> None:
    """Entry point. Under torchrun/SLURM, ranks other than 0 run in place (:func:`difflm.cli.rank_argv`: only
    rank 0 creates the Hydra run directory and its files); every rank then takes rank 0's ``run.dir``.
    ``logger.sample_prompt=`` takes any text (:func:`difflm.cli.quote_free_text`)."""
    sys.argv[1:] = quote_free_text(sys.argv[1:], ("logger.sample_prompt",))
    sys.argv[1:] = rank_argv(sys.argv[1:])
    _main()
    if shown_config(sys.argv[1:]) == "job":
        print_kernel_choice(sys.argv[1:])


def shown_config(argv: list[str]):
    """The part Hydra's ``--cfg``/``-c`` prints (``job``, ``hydra``, ``all``), or None without the flag."""
    for i, arg in enumerate(argv):
        if arg in ("--cfg", "-c") and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--cfg="):
            return arg.partition("=")[2]
    return None


def print_kernel_choice(argv: list[str]) -> None:
    """After ``--cfg job``: what ``model.*=auto`` resolves to on this machine, as YAML comments (the printed config
    stays loadable). A config that does not compose or check prints nothing more: the run would say why."""
    from difflm.cli import _hydra_args
    from difflm.config.compose import compose_train_config
    from difflm.config.schema import override_value
    from difflm.config.validate import resolve_device
    from difflm.model.auto_kernels import choose_kernels

    args = _hydra_args(argv)  # Hydra's reading: the overrides, and the folder of your own presets (--config-dir)
    if args is None:
        return
    try:
        cfg = compose_train_config(args.overrides, config_dir=args.config_dir)
        choice = choose_kernels(cfg, resolve_device(cfg.device), world_size_from_env())
    except DifflmError:
        return
    if choice.line:
        print(f"# {choice.line}")
        for key in ("backend", "attention_backend", "fused_mlp", "fused_mlp_autotune"):
            value = choice.values[key]
            print(f"#   model.{key}: {override_value(value)}")


if __name__ == "__main__":
    main()
