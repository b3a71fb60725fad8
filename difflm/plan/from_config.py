"""What the planner reads from a composed train config: the vocabulary and the layout."""
from __future__ import annotations

from difflm.errors import DifflmError
from difflm.plan.memory import Layout


def vocab_size(cfg) -> int:
    """``model.vocab_size`` when given, else the run's tokenizer's padded vocabulary (as ``difflm-train`` sets it).
    Raises DifflmError naming ``model.vocab_size=`` when the tokenizer cannot be loaded (a hub name offline)."""
    if cfg.model.vocab_size:
        return int(cfg.model.vocab_size)
    from difflm.data.tokenizer import build_tokenizer

    try:
        return build_tokenizer(cfg.data.tokenizer, int(cfg.model.vocab_multiple)).padded_vocab_size
    except Exception as e:  # noqa: BLE001 - any loader failure ends in the same advice
        raise DifflmError(f"data.tokenizer={cfg.data.tokenizer} could not be loaded ({str(e).splitlines()[0][:120]}); "
                          "pass model.vocab_size=N (e.g. 50304 for GPT-2/NeoX, 128256 for Llama 3)") from None


def layout_of(cfg, gpus: int) -> Layout:
    """The layout ``cfg.parallel`` gives on ``gpus`` ranks (``-1`` filled), with the run's micro-batch."""
    from difflm.parallel.mesh import ParallelDims

    dims = ParallelDims.from_config(cfg.parallel, gpus)
    p = cfg.parallel
    return Layout(tp=dims.tp, pp=dims.pp, cp=dims.cp, ep=dims.ep, dp_replicate=dims.dp_replicate,
                  dp_shard=dims.dp_shard, micro_batch=int(cfg.train.micro_batch_size),
                  activation_checkpointing=str(p.activation_checkpointing),
                  sequence_parallel=bool(p.sequence_parallel), pp_schedule=str(p.pp_schedule),
                  pp_virtual_stages=int(p.pp_virtual_stages))
