"""``difflm-train`` (also ``python -m difflm.train``): compose the run with Hydra, validate it, train.

    difflm-train model=tiny train.max_steps=300                 # the embedded corpus on CPU
    difflm-train model=1.7b precision=bf16 data.path=corpus/    # your data on a GPU
    difflm-train --cfg job model=1.7b                           # print the composed run
    difflm-train -m optim.lr=1e-4,3e-4                          # a sweep, one run dir per job
"""
from __future__ import annotations

from hydra.core.hydra_config import HydraConfig

import hydra
from difflm.cli import exits_cleanly
from difflm.config import CONF_DIR
from difflm.config.validate import check_run
from difflm.training.trainer import Trainer


def run_dir_of_job(cfg) -> str:
    """``run.dir``, or its per-job subdirectory under a Hydra multirun (Hydra's job output dir)."""
    try:
        return HydraConfig.get().runtime.output_dir
    except ValueError:  # called outside a Hydra job (tests)
        return cfg.run.dir


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
@exits_cleanly
def main(cfg) -> None:
    device = check_run(cfg)
    cfg.run.dir = run_dir_of_job(cfg)
    trainer = Trainer(cfg, cfg.run.dir, device)
    if trainer.resumed_from is not None:
        print(f"resuming {cfg.run.dir} from step {trainer.resumed_from}")
    trainer.fit()
    print(f"done: {cfg.run.dir}")


if __name__ == "__main__":
    main()
