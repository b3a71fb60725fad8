"""Training objectives: ``mdlm`` (masked diffusion), ``ar`` (next token), ``bd3lm`` (block diffusion), ``sft``
(masked diffusion on responses). See :func:`build_objective`."""
from difflm.errors import DifflmError
from difflm.objectives.ar import ARObjective
from difflm.objectives.bd3lm import BD3LMObjective
from difflm.objectives.base import NoisedBatch, loss_normaliser, shortest_step_length, step_length, \
    weighted_ce_sum
from difflm.objectives.mdlm import MDLMObjective
from difflm.objectives.sft import SFTObjective

OBJECTIVES = {"mdlm": MDLMObjective, "ar": ARObjective, "bd3lm": BD3LMObjective, "sft": SFTObjective}


def build_objective(cfg, mask_id: int):
    """The objective named by ``objective.name``, wrapped in :class:`~difflm.objectives.adaptation.AdaptedObjective` when
    an adaptation option is set (docs/adaptation.md); raises DifflmError for an unknown name."""
    if cfg.name not in OBJECTIVES:
        raise DifflmError(f"objective={cfg.name!r} is unknown: choose one of {', '.join(OBJECTIVES)}")
    objective = OBJECTIVES[cfg.name](cfg, mask_id)
    from difflm.objectives.adaptation import AdaptedObjective, adapts

    return AdaptedObjective(objective) if adapts(cfg) else objective


__all__ = ["ARObjective", "BD3LMObjective", "SFTObjective", "MDLMObjective", "NoisedBatch", "build_objective", "loss_normaliser", "shortest_step_length", "step_length", "weighted_ce_sum"]
