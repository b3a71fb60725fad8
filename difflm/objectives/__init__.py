"""Training objectives: ``mdlm`` (masked diffusion) and ``ar`` (next token). See :func:`build_objective`."""
from difflm.errors import DifflmError
from difflm.objectives.ar import ARObjective
from difflm.objectives.base import NoisedBatch, step_length, weighted_ce_sum
from difflm.objectives.mdlm import MDLMObjective

OBJECTIVES = {"mdlm": MDLMObjective, "ar": ARObjective}


def build_objective(cfg, mask_id: int):
    """The objective named by ``objective.name``; raises DifflmError for an unknown name."""
    if cfg.name not in OBJECTIVES:
        raise DifflmError(f"objective={cfg.name!r} is unknown: choose one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[cfg.name](cfg, mask_id)


__all__ = ["ARObjective", "MDLMObjective", "NoisedBatch", "build_objective", "step_length", "weighted_ce_sum"]
