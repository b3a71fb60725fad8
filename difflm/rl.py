"""``difflm-rl`` (also ``python -m difflm.rl``): GRPO or DPO (VRPO) post-training of a trained difflm run.

    difflm-rl init.run_dir=runs/sft data.path=prompts.jsonl data.answer_field=answer             # GRPO, GSM8K reward
    difflm-rl init.run_dir=runs/sft algorithm=dpo estimator=mc_elbo data.path=prefs.jsonl        # DPO with VRPO
    difflm-rl init.run_dir=runs/sft estimator=one_step gen.threshold=0.9 gen.cache=dual            # d1, fast rollouts

Config groups: ``algorithm`` (grpo, dpo), ``estimator`` (one_step, coupled, mc_elbo), ``reward`` (gsm8k, format,
or terms naming any callable by ``_target_``), ``logger``, ``parallel`` (single, ddp, fsdp, hsdp, or tp with
``parallel.sequence_parallel=false``; launched with torchrun); ``gen.*`` are the rollout sampler's settings (every
option of difflm-generate). See docs/post_training.md.
"""
from __future__ import annotations

import torch

from difflm.cli import hydra_app
from difflm.errors import DifflmError


def pick_device(name: str) -> torch.device:
    """``device``: auto (CUDA when available), cpu or cuda; DifflmError for cuda without a GPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise DifflmError("device=cuda but no CUDA GPU is visible: set device=cpu")
    if name not in ("cpu", "cuda"):
        raise DifflmError(f"device={name!r} must be auto, cpu or cuda")
    return torch.device(name)


def run_dir_of_job(cfg) -> str:
    """``run.dir``, or under a Hydra multirun (``-m``) the job's own ``<run.dir>/<job number>`` (Hydra's job output
    dir, ``hydra.sweep`` of conf/rl.yaml), so that the jobs of a sweep never resume one another's run."""
    from hydra.core.hydra_config import HydraConfig

    try:
        return HydraConfig.get().runtime.output_dir
    except ValueError:  # called outside a Hydra job (tests)
        return cfg.run.dir


def check_job_config(cfg, world_size: int, here: bool) -> None:
    """What a run checks on its config at its start, before it reads the trained run (``device``, then
    :func:`difflm.posttrain.runner.check_rl_config`), for each job of a ``-m`` sweep before the first starts
    (:func:`difflm.cli.check_sweep`); the device only where the job runs here (``here``). ``world_size``: unused (the
    layout is checked against the trained run's model, which each job reads at its start)."""
    from difflm.posttrain.runner import check_rl_config

    if here:
        pick_device(cfg.device)
    check_rl_config(cfg)


@hydra_app("rl", sweeps=True, job_check=check_job_config)
def _main(cfg) -> None:
    from difflm.parallel.distributed import destroy_distributed
    from difflm.posttrain.runner import PostTrainer

    try:
        cfg.run.dir = run_dir_of_job(cfg)
        trainer = PostTrainer(cfg, pick_device(cfg.device))
        if trainer.step > 0 and trainer.is_rank0:
            print(f"resuming {trainer.run_dir} from step {trainer.step}")
        trainer.fit()
        if trainer.is_rank0:
            print(f"done: {trainer.run_dir}")
    finally:
        destroy_distributed()


def main() -> None:
    """Entry point: ``data.prompt_template=`` takes any text (``Question: {prompt} Answer:``; see
    :func:`difflm.cli.quote_free_text`)."""
    import sys

    from difflm.cli import quote_free_text, rank_argv

    sys.argv[1:] = rank_argv(quote_free_text(sys.argv[1:], ("data.prompt_template",)))
    _main()


if __name__ == "__main__":
    main()
