"""The model forward the log-likelihood estimators score with (their ``logits_fn``), in the layout the init run
trained and samples with (:func:`estimator_logits_fn`):

* ``mdlm`` / ``sft`` runs: one bidirectional forward of the noised rows, padding keys masked out and RoPE positions
  skipping them (:func:`difflm.posttrain.rollout.padded_logits_fn`).
* ``bd3lm`` runs: the vectorised forward the BD3-LM objective trains with (Arriola et al. 2025, "Block Diffusion",
  sec. 3.2; :meth:`difflm.objectives.bd3lm.BD3LMObjective.model_inputs`, the code that builds every training
  batch): the noised rows x_t and the clean rows x_0 as ``[x_t ; x_0]``, under the run's block-causal mask
  (``objective.block_size``, ``objective.clean_attention``) with RoPE positions ``0..L-1`` for both halves, and the
  logits read from the x_t half (:class:`BlockLogitsFn`). Position i of block b is thus predicted from x_t^b and
  x_0^{<b}: the term of block b in BD3-LM's NELBO (their eq. 6/7), the context the block sampler gives it
  (:mod:`difflm.sampling.block_diffusion`).

Blocks sit at absolute positions of each unpadded row, counted from its first real token, as the sampler draws the
rollouts (:func:`difflm.generate.padded_block_generate` samples the rows of each prompt length without their
padding): each row's real tokens are moved to the front, the row is extended to a multiple of the block size, and
the padding is a second document that no real token attends to (the mask's ``doc_ids``).
"""
from __future__ import annotations

from typing import Optional

import torch

from difflm.model.masks import padded_row_spans
from difflm.posttrain.rollout import padded_logits_fn


def block_objective(objective_cfg, mask_id: int):
    """The run's BD3-LM objective (:class:`~difflm.objectives.bd3lm.BD3LMObjective`, an adapted run's base with the
    final ``objective.block_size``) for an ``objective`` config named ``bd3lm``; None for any other objective."""
    if objective_cfg is None or objective_cfg.get("name") != "bd3lm":
        return None
    from difflm.objectives import build_objective

    objective = build_objective(objective_cfg, mask_id)
    return getattr(objective, "base", objective)


class BlockLogitsFn:
    """``fn(noisy, clean) -> logits`` [kB, S, V] float32: BD3-LM's ``[x_t ; x_0]`` forward of ``model`` (module
    docstring) over rows laid out as ``valid`` [B, S] bool (True at real tokens, contiguous in each row; the
    estimators' rows may repeat it k times). Logits at padding positions are those of the row's first position.

    Attributes read by the estimators (:func:`difflm.posttrain.loglik.base.noise_units`): ``takes_clean`` (True),
    ``blocks`` [B, S] int64 the block of each position (-1 at padding), ``num_blocks`` an upper bound of a row's
    blocks, ``ceil(S / block_size)``.
    Raises: DifflmError when a row's real tokens are not contiguous.
    """

    takes_clean = True

    def __init__(self, model, valid: torch.Tensor, objective, autocast=None):
        s = valid.shape[1]
        starts, lengths = padded_row_spans(valid, "objective=bd3lm scores blocks at absolute positions: pad each "
                                           "row on one side only (its real tokens contiguous)")
        size = int(objective.block_size)
        self.model, self.objective, self.autocast = model, objective, autocast
        self.num_blocks = -(-s // size)
        self.width = self.num_blocks * size
        col = torch.arange(self.width, device=valid.device)[None]
        self.source = (starts[:, None] + col).clamp(max=s - 1)  # [B, W]: the column each aligned position reads
        real = col < lengths[:, None]  # [B, W]
        self.doc_ids = None if bool(real.all()) else (~real).long()  # padding: a document of its own
        self.positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)  # [B, S]: the aligned position of a column
        self.blocks = torch.where(valid, self.positions // size, torch.full_like(self.positions, -1))

    def __call__(self, noisy: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
        rows, w = noisy.shape[0], self.width
        k = rows // self.source.shape[0]
        source = self.source.repeat(k, 1)
        doc = None if self.doc_ids is None else self.doc_ids.repeat(k, 1)
        inputs = self.objective.model_inputs(noisy.gather(1, source), clean.gather(1, source), doc)
        noisy_half = (torch.arange(rows, device=noisy.device)[:, None] * 2 * w
                      + torch.arange(w, device=noisy.device)[None]).flatten()  # the x_t half, row-major
        ids = inputs.pop("input_ids")
        if self.autocast is None:
            logits = self.model(ids, logits_mask=noisy_half, **inputs)
        else:
            with self.autocast():
                logits = self.model(ids, logits_mask=noisy_half, **inputs)
        logits = logits.float().view(rows, w, -1)
        index = self.positions.repeat(k, 1)[:, :, None].expand(-1, -1, logits.shape[-1])
        return logits.gather(1, index)


def estimator_logits_fn(model, valid: torch.Tensor, autocast=None, objective: Optional[object] = None):
    """The estimators' logits function of ``model`` (the policy or the reference) over rows laid out as ``valid``
    [B, S] bool: :class:`BlockLogitsFn` with ``objective`` (:func:`block_objective`, a bd3lm run), else
    :func:`~difflm.posttrain.rollout.padded_logits_fn` (mdlm, sft: ``objective`` None)."""
    if objective is None:
        return padded_logits_fn(model, valid, autocast)
    return BlockLogitsFn(model, valid, objective, autocast)


__all__ = ["BlockLogitsFn", "block_objective", "estimator_logits_fn"]
