"""Pipeline parallelism with ``torch.distributed.pipelining`` (PipelineStage + a schedule).

The model is cut into ``pp * pp_virtual_stages`` stages of consecutive blocks (torchtitan's
``pipeline_llm``): the first stage holds the embedding, the last the final norm and the LM head. A stage is the
same :class:`difflm.model.Transformer` holding a run of blocks (:meth:`~difflm.model.Transformer.pipeline_stage`),
whatever the kernel set, and keeps the full model's parameter names (``layers`` becomes an ``nn.ModuleDict``
keyed by the original block index), so state dicts and DCP checkpoints are the same as a single process's.

Stages per rank: "loop" style (stage ``r + v * pp`` on rank r) for GPipe, 1F1B, Interleaved1F1B,
LoopedBFS and InterleavedZeroBubble; "v" style (stages r and 2 pp - 1 - r) for ZBVZeroBubble and DualPipeV.

The last stage computes the loss: the schedules call ``loss_fn(output, target)`` per micro-batch, with the
targets, weights, loss mask, per-sequence and global normalisers of the noised batch packed into one float64 tensor
(:func:`pack_targets`), and the weighted cross-entropy of :func:`difflm.objectives.weighted_ce_sum` on the
logits at the masked rows (this rank's vocabulary slice under TP: the vocab-parallel cross-entropy). Gradients are
not rescaled (``scale_grads=False``): each micro-batch loss is already divided by the global normaliser.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from difflm.objectives import NoisedBatch, weighted_ce_sum

PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
V_STYLE_SCHEDULES = ("ZBVZeroBubble",)


def stage_ids(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """Stage indices held by ``pp_rank`` (see the module docstring)."""
    if schedule in V_STYLE_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(virtual)]


def split_layers(num_layers: int, num_stages: int) -> list[list[int]]:
    """Consecutive blocks per stage, as even as possible (earlier stages take the remainder)."""
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def build_stage_models(model: nn.Module, pp_rank: int, pp: int, virtual: int, schedule: str,
                       seq_shards: int = 1) -> tuple[list[nn.Module], list[int], int]:
    """Cut ``model`` into this rank's stage modules. Returns (modules, their stage indices, number of stages).

    A stage references only its own blocks; the others are freed with ``model``, so a rank keeps the
    parameters of its stages only.
    """
    num_stages = pp * (2 if schedule in V_STYLE_SCHEDULES else virtual)
    layers = split_layers(len(model.layers), num_stages)
    ids = stage_ids(pp_rank, pp, num_stages // pp, schedule)
    parts = []
    for sid in ids:
        parts.append(model.pipeline_stage(layers[sid], first=sid == 0, last=sid == num_stages - 1,
                                          seq_shards=seq_shards))
    return parts, ids, num_stages


def pack_targets(batch: NoisedBatch, normaliser) -> torch.Tensor:
    """[B, S, 5] float64: targets, weights, loss mask, per-sequence ``num_tokens`` and the step's global
    ``normaliser`` (float or scalar tensor, see :func:`difflm.objectives.base.weighted_ce_sum`; exact in float64),
    the single ``target`` tensor a pipeline schedule splits into micro-batches with the inputs."""
    b, s = batch.targets.shape
    norm = torch.as_tensor(normaliser, dtype=torch.float64, device=batch.targets.device).expand(b, s)
    return torch.stack([batch.targets.double(), batch.weights.double(), batch.loss_mask.double(),
                        batch.num_tokens.double()[:, None].expand(b, s), norm], dim=-1)


def make_loss_fn(norm: str, vocab_group=None, fused: bool = True) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss_fn(logits [b, S, V], packed [b, S, 5]) -> scalar``: the weighted CE of the micro-batch's masked rows,
    divided by the step's global normaliser packed with the targets (:func:`pack_targets`,
    :func:`weighted_ce_sum`), so pipeline micro-batches add up to the same loss as any other split.
    ``vocab_group``: the TP group of a vocab-parallel head, whose last stage returns [b, S, V/tp] logits
    (:mod:`difflm.parallel.vocab_parallel`). ``fused``: ``model.fused_cross_entropy``."""

    def loss_fn(logits: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        targets = packed[..., 0].long()
        mask = packed[..., 2] > 0.5
        batch = NoisedBatch(input_ids=targets, targets=targets, loss_mask=mask, weights=packed[..., 1].float(),
                            t=torch.zeros(targets.shape[0], device=targets.device),
                            num_tokens=packed[:, 0, 3].float())
        return weighted_ce_sum(logits[mask], batch, norm, packed[0, 0, 4], vocab_group=vocab_group,
                               fused=fused, consume_logits=True)  # logits[mask] is this call's own copy

    return loss_fn


def _stage_class():
    """``PipelineStage`` whose shape-inference forward (run on the first micro-batch of each new sequence length, on
    real or uninitialised tensors) runs in eval mode: it is not a training forward, so MoE layers neither count
    its tokens nor attach aux losses to it (:mod:`difflm.model.moe`)."""
    from torch.distributed.pipelining import PipelineStage

    def in_eval_mode(name: str):
        def run(self, *args, **kwargs):
            modes = [(m, m.training) for m in self.submod.modules()]
            self.submod.train(False)
            try:
                return getattr(super(Stage, self), name)(*args, **kwargs)
            finally:
                for m, mode in modes:
                    m.training = mode

        return run

    class Stage(PipelineStage):  # the inference method's name differs between PyTorch versions
        _forward_metadata_inference = in_eval_mode("_forward_metadata_inference")
        _shape_inference = in_eval_mode("_shape_inference")

    return Stage


class Pipeline:
    """This rank's stages and one schedule per (sequence length, train/eval).

    A ``PipelineStage`` infers its activation shapes on its first step (by running the stage on meta tensors in
    some PyTorch versions), so a new sequence length (random-length steps) gets new stage objects around the same
    modules. Transformer Engine's kernels cannot run on meta tensors: for the TE kernel set the stages are given
    their input/output shapes (:meth:`difflm.model.Transformer.pipeline_io`) with ``activation_dtype``.

    Args:
        parts: this rank's stage modules (after TP / FSDP).
        ids, num_stages: from :func:`build_stage_models`.
        pp_group: ``mesh["pp"].get_group()``.
        schedule: one of :data:`PP_SCHEDULES`; n_microbatches: micro-batches per step (gradient accumulation).
        activation_dtype: dtype of the hidden states and logits between stages (the compute dtype).
    """

    def __init__(self, parts, ids, num_stages: int, pp_group, device: torch.device, schedule: str,
                 n_microbatches: int, loss_fn, eval_loss_fn, activation_dtype: torch.dtype = torch.float32):
        self.activation_dtype = activation_dtype
        self.parts, self.ids, self.num_stages = parts, ids, num_stages
        self.pp_group, self.device, self.schedule_name = pp_group, device, schedule
        self.n_microbatches, self.loss_fn, self.eval_loss_fn = n_microbatches, loss_fn, eval_loss_fn
        self.has_first = 0 in ids
        self.has_last = num_stages - 1 in ids
        self._schedules: dict = {}

    def _stage_shapes(self, part, micro_batch: int, seq_len: int) -> dict:
        """``input_args`` / ``output_args`` (meta tensors) of a TE stage; {} for stages that infer their own."""
        if getattr(part.kernels, "name", "torch") != "te":
            return {}
        inputs, outputs = part.pipeline_io(micro_batch, seq_len, self.activation_dtype)
        return {"input_args": inputs, "output_args": outputs}

    def _schedule(self, batch_size: int, seq_len: int, train: bool, n_microbatches: int):
        key = (batch_size, seq_len, train, n_microbatches)
        if key not in self._schedules:
            from torch.distributed.pipelining.schedules import get_schedule_class

            micro = batch_size // n_microbatches
            stage_cls = _stage_class()
            stages = [stage_cls(part, sid, self.num_stages, self.device, group=self.pp_group,
                                **self._stage_shapes(part, micro, seq_len))
                      for part, sid in zip(self.parts, self.ids)]
            name = self.schedule_name if train else ("GPipe" if len(stages) == 1 else "LoopedBFS")
            cls = get_schedule_class(name)
            single = name in SINGLE_STAGE_SCHEDULES
            self._schedules[key] = cls(stages[0] if single else stages, n_microbatches=n_microbatches,
                                       loss_fn=self.loss_fn if train else self.eval_loss_fn, scale_grads=False)
        return self._schedules[key]

    def step(self, batch: NoisedBatch, normaliser) -> torch.Tensor:
        """Forward + backward of the local batch [B, S] in ``n_microbatches`` micro-batches, each loss divided by
        the step's global ``normaliser``. Returns the sum of the micro-batch losses on the rank holding the last
        stage, 0 elsewhere."""
        batch_size, seq_len = batch.input_ids.shape
        schedule = self._schedule(batch_size, seq_len, True, self.n_microbatches)
        return self._run(schedule.step, batch, normaliser)

    @torch.no_grad()
    def evaluate(self, batch: NoisedBatch, normaliser=1.0) -> torch.Tensor:
        """Forward-only loss (``eval_loss_fn``) of ``batch`` as one micro-batch, divided by ``normaliser`` (1: the
        sum); 0 off the last stage."""
        schedule = self._schedule(*batch.input_ids.shape, False, 1)
        return self._run(schedule.eval, batch, normaliser)

    def _run(self, fn, batch: NoisedBatch, normaliser) -> torch.Tensor:
        shared = batch.step_model_kwargs()
        for part in self.parts:  # a schedule sends only activations between stages: the rest is set on them
            part.step_inputs = shared
        losses: list = []
        args = (batch.input_ids,) if self.has_first else ()
        kwargs = dict(target=pack_targets(batch, normaliser), losses=losses) if self.has_last else {}
        fn(*args, **kwargs)
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([torch.as_tensor(x, device=self.device).float().reshape(()) for x in losses]).sum()


def loss_fns(objective_cfg, vocab_group=None, fused: bool = True) -> tuple[Callable, Callable]:
    """(train, eval) loss functions: ``objective.loss_norm``, and ``token`` sums for the NELBO estimate;
    ``fused``: ``model.fused_cross_entropy``."""
    return make_loss_fn(objective_cfg.loss_norm, vocab_group, fused), make_loss_fn("token", vocab_group, fused)


__all__ = ["PP_SCHEDULES", "Pipeline", "build_stage_models", "loss_fns", "make_loss_fn",
           "pack_targets", "split_layers", "stage_ids"]
