"""What every objective hands the training loop: a noised batch and a weighted cross-entropy."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from difflm.objectives.cross_entropy import token_cross_entropy
from difflm.objectives.keyed_rng import STREAM_LENGTH, keyed_uniforms


@dataclass
class NoisedBatch:
    """Model input and loss terms of one micro-batch.

    Attributes:
        input_ids: [B, S] int64, what the model sees (masked tokens replaced by the mask id for mdlm).
        targets:   [B, S] int64, the clean token to predict at each position.
        loss_mask: [B, S] bool, positions that carry loss (masked tokens for mdlm, all but the last for ar).
        weights:   [B, S] float32, per-position loss weight (1/p for mdlm, 1 for ar); 0 off ``loss_mask``.
        t:         [B] float32 diffusion time per sequence (zeros for ar).
        num_tokens: [B] float32, the normaliser of each sequence (its length, or L-1 predictions for ar).
        attn_mask: optional attention mask for the model: a structured mask of :mod:`difflm.model.masks`
            (BD3-LM's :class:`~difflm.model.masks.BlockDiffusionMask`, packed windows'
            :class:`~difflm.model.masks.DocumentMask`) that each attention kernel takes in its own form, or a
            dense bool [B | 1, 1, S, S] tensor.
        position_ids: optional RoPE positions [S] or [B, S] int64 (BD3-LM: ``0..L-1`` twice).
        loss_index: [N] int64 positions of ``loss_mask`` in the flattened ``B * S`` tokens (row-major), filled by
            :meth:`to` where the mask was drawn (the CPU): selecting the loss rows by index on the GPU needs no
            device-to-host sync, selecting them with a boolean mask does (the count N is unknown to the host).
        aux: optional second batch of the same samples whose weighted CE adds to this one's, from a second forward
            (the hybrid adaptation loss: next-token CE on the clean copy, :mod:`difflm.objectives.hybrid`).
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    weights: torch.Tensor
    t: torch.Tensor
    num_tokens: torch.Tensor
    attn_mask: Optional[Any] = None
    position_ids: Optional[torch.Tensor] = None
    loss_index: Optional[torch.Tensor] = None
    aux: Optional["NoisedBatch"] = None

    def to(self, device: torch.device) -> "NoisedBatch":
        """The batch on ``device`` (``loss_index`` computed first on the source device). CPU tensors bound for a
        GPU go through pinned memory, so the copies are asynchronous and the host runs ahead of the device."""
        device = torch.device(device)
        from difflm.model.masks import to_device

        fields = self.pinned(pin=False).__dict__  # to_device pins what it copies to a GPU
        return NoisedBatch(**{k: None if v is None else to_device(v, device) if isinstance(v, torch.Tensor)
                              else v.to(device) for k, v in fields.items()})

    def pinned(self, pin: bool = True) -> "NoisedBatch":
        """The batch with ``loss_index`` computed and, with ``pin`` (a batch bound for a GPU), its CPU tensors in
        pinned memory, so that :meth:`to` the GPU is only asynchronous copies. Host work: the trainer runs it on its
        data thread."""
        fields = dict(self.__dict__)
        if fields["loss_index"] is None:
            fields["loss_index"] = torch.nonzero(self.loss_mask.flatten()).flatten()
        if fields["aux"] is not None:
            fields["aux"] = fields["aux"].pinned(pin)
        if pin:
            fields = {k: v.pin_memory() if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v
                      for k, v in fields.items()}
        return NoisedBatch(**fields)

    def logits_selector(self) -> torch.Tensor:
        """What the model's ``logits_mask`` takes: ``loss_index`` when known (no host sync), else ``loss_mask``."""
        return self.loss_mask if self.loss_index is None else self.loss_index

    def model_kwargs(self) -> dict:
        """The optional model inputs that are set (``attn_mask``, ``position_ids``), as keyword arguments.

        Empty for plain batches, so models without these arguments (e.g. the TE backend) keep working.
        """
        return {k: v for k, v in (("attn_mask", self.attn_mask), ("position_ids", self.position_ids)) if v is not None}

    def step_model_kwargs(self) -> dict:
        """:meth:`model_kwargs` that every sample of the batch shares (no batch dimension): what a pipeline stage can
        take for all micro-batches of a step (BD3-LM's mask and positions).

        Raises: DifflmError when an input differs per sample (packed-document masks, per-row positions), which
        pipeline schedules cannot split for stages after the first.
        """
        from difflm.errors import DifflmError
        from difflm.model.masks import BlockDiffusionMask

        kwargs = self.model_kwargs()
        mask, positions = kwargs.get("attn_mask"), kwargs.get("position_ids")
        per_sample = (mask is not None and not (isinstance(mask, BlockDiffusionMask) and mask.doc_ids is None)) or \
            (positions is not None and positions.dim() != 1)
        if per_sample:
            raise DifflmError("parallel.pp>1 cannot carry per-sample attention masks or positions (packed documents, "
                              "data.intra_document_attention=true): set it to false or parallel.pp=1")
        return kwargs


def loss_normaliser(norm: str, num_tokens: torch.Tensor) -> torch.Tensor:
    """The share of ``num_tokens`` [B] (a batch's ``NoisedBatch.num_tokens``) in the normaliser of a step.

    ``token``: the number of loss tokens, ``num_tokens.sum()``; ``sequence``: the number of sequences, B.
    Both are sums over samples, so the shares of every micro-batch, data-parallel rank and pipeline
    micro-batch add up to the normaliser of the whole global batch, whatever the split. Returns a float64
    scalar on ``num_tokens``' device.
    """
    if norm == "sequence":
        return torch.tensor(float(num_tokens.numel()), dtype=torch.float64, device=num_tokens.device)
    return num_tokens.double().sum()


def weighted_ce_sum(logits: torch.Tensor, batch: NoisedBatch, norm: str, normaliser, vocab_group=None,
                    fused: bool = True, consume_logits: bool = False) -> torch.Tensor:
    """Weighted cross-entropy of one micro-batch, already divided by the global normaliser.

    Args:
        logits: [N, V] logits at the ``batch.loss_mask`` positions (row-major order: the model's output for
            ``logits_mask=batch.logits_selector()``); with ``vocab_group`` this rank's vocabulary slice [N, V/tp] of
            a vocab-parallel head (:func:`difflm.parallel.vocab_parallel.vocab_parallel_cross_entropy`, collective
            over the group).
        norm: ``token`` sums the weighted CE of every loss position and divides by ``normaliser``, the
            number of loss tokens of the whole global batch (the mean over its tokens); ``sequence``
            divides each sequence's sum by its own ``num_tokens`` and the total by ``normaliser``, the
            number of sequences of the global batch (LLaDA's SFT ``answer_lengths``).
        normaliser: float or scalar tensor, :func:`loss_normaliser` summed over EVERY sample of the step
            (all micro-batches, data-parallel ranks and pipeline micro-batches), so the step's loss does
            not depend on how the global batch is split.
        fused: ``model.fused_cross_entropy``: TE's fused cross-entropy kernel on CUDA
            (:func:`difflm.objectives.cross_entropy.token_cross_entropy`).
        consume_logits: the caller never reads ``logits`` after the backward (a training step), so the fused kernel
            writes their gradient into them instead of keeping a copy
            (:func:`difflm.objectives.cross_entropy.token_cross_entropy`).
    Returns: a float32 scalar whose sum over the micro-batches of a step is the step's loss.
    """
    if batch.loss_index is None:
        targets = batch.targets[batch.loss_mask]
        ce = token_cross_entropy(logits, targets, vocab_group, fused, consume_logits)
        per_position = torch.zeros_like(batch.weights)
        per_position[batch.loss_mask] = ce * batch.weights[batch.loss_mask]
        per_sequence = per_position.sum(dim=1)
        if norm == "sequence":
            per_sequence = per_sequence / batch.num_tokens
        return (per_sequence.sum() / normaliser).float()
    # the same sum over the loss positions, selected by index: no device-to-host sync
    idx = batch.loss_index
    targets = batch.targets.flatten().index_select(0, idx)
    ce = token_cross_entropy(logits, targets, vocab_group, fused, consume_logits)
    terms = ce * batch.weights.flatten().index_select(0, idx)
    if norm == "sequence":
        terms = terms / batch.num_tokens.index_select(0, idx // batch.targets.shape[1])
    return (terms.sum() / normaliser).float()


def shortest_step_length(cfg) -> int:
    """The shortest window a random-length step may draw under the ``objective`` config ``cfg``: 2 when the loss has
    next-token terms (``objective=ar``, or ``objective.ar_loss_weight > 0``), whose one-token window would predict
    nothing (a normaliser of 0 and a NaN loss), else 1."""
    return 2 if cfg.name == "ar" or float(cfg.get("ar_loss_weight", 0.0) or 0.0) > 0 else 1


def step_length(seq_len: int, step: int, seed: int, prob: float, multiple: int, shortest: int = 1) -> int:
    """Sequence length used at ``step``: ``seq_len``, or with probability ``prob`` a random length.

    LLaDA (Nie et al. 2025, sec. 2.2) trains 1% of batches on a length drawn from U[1, 4096] so the model
    also sees short inputs; here U{``shortest``, ..., ``seq_len``} (:func:`shortest_step_length`). The draw is keyed
    by (seed, step), so every rank and every resume agrees; the length is rounded down to a multiple of ``multiple``
    (at least ``multiple``) so that sequence/context parallel ranks can split it.
    """
    coin, draw = keyed_uniforms(STREAM_LENGTH, seed, step, n=2)
    if prob <= 0 or coin >= prob:
        return seq_len
    length = shortest + int(draw * (seq_len - shortest + 1))  # U{shortest, ..., seq_len}
    return max(multiple, length // multiple * multiple)
