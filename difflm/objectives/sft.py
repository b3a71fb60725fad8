"""Supervised fine-tuning of a masked-diffusion model on prompt/response pairs (LLaDA, Nie et al. 2025,
sec. 2.3 and eq. 5; the SFT recipe of the LLaDA repository's GUIDELINES.md).

The prompt p_0 is never masked and carries no loss; the response r_0 (with EOS padding up to the window,
which the model must learn to emit: that is how it learns where to stop) is masked as in pre-training:

    L = - E_{t, r_t} [ (1 / t) sum_{i in response, masked} log p_theta(r_0^i | p_0, r_t) ] / N

with N the response length of each sample (``objective.loss_norm=sequence``, LLaDA's ``answer_lengths``)
or the number of response tokens of the global batch (``token``).

Packed rows (``data.sft_packing``) are a compute saving only: the sample of eq. 5 stays the prompt/response pair,
not the row. Under ``sequence`` each response token is divided by the response length of its own pair (the weight
of every masked position carries 1 / N_pair) and the step's loss by the number of pairs of the global batch, so a
packed batch gives the loss of the same pairs unpacked with the same masks; ``token`` sums are packing-invariant.
"""
from __future__ import annotations

from typing import Sequence

import torch

from difflm.data.batch import TokenBatch
from difflm.errors import DifflmError
from difflm.objectives.base import NoisedBatch
from difflm.objectives.mdlm import MDLMObjective


class SFTObjective(MDLMObjective):
    """Masked diffusion restricted to response tokens. Batches must be :class:`TokenBatch` with prompts (prompt
    lengths, or the prompt mask of rows packing several pairs, ``data.sft_packing``, whose documents keep their
    intra-document attention mask)."""

    causal = False

    @staticmethod
    def _is_response(tokens) -> torch.Tensor:
        """[B, S] bool: the response positions of a TokenBatch with prompts (prompt lengths, or the prompt mask of
        packed pairs; DifflmError without them)."""
        response = tokens.response_mask() if isinstance(tokens, TokenBatch) else None
        if response is None:
            raise DifflmError("objective=sft needs prompt/response data: set data.prompt_field and data.response_field "
                              "(a .jsonl file of pairs)")
        return response

    @staticmethod
    def pair_lengths(tokens) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For packed rows (a TokenBatch with ``pair_ids``): (response length of each pair, [P] float32, at least 1;
        the response length of the pair of every position, [B, S] float32), pairs counted per row (a pair cut by a
        shorter step length counts its part in the row). None for rows of one pair."""
        pair_ids = getattr(tokens, "pair_ids", None)
        if pair_ids is None:
            return None
        b, s = pair_ids.shape
        new = torch.ones(b, s, dtype=torch.long)
        new[:, 1:] = (pair_ids[:, 1:] != pair_ids[:, :-1]).long()
        unit = (torch.arange(b)[:, None] * s + new.cumsum(dim=1) - 1).flatten()  # (row, pair of the row) -> index
        response = SFTObjective._is_response(tokens).flatten().double()
        counts = torch.zeros(b * s, dtype=torch.float64).index_add_(0, unit, response).clamp(min=1)
        present = torch.zeros(b * s, dtype=torch.bool)
        present[unit] = True
        return counts[present].float(), counts[unit].view(b, s).float()

    def num_tokens(self, tokens) -> torch.Tensor:
        """Response length of each sample (prompt excluded; at least 1), float32: LLaDA's ``answer_lengths``, one
        per row, [B], or one per pair of packed rows, [P] (:meth:`pair_lengths`), so that
        :func:`difflm.objectives.base.loss_normaliser` counts pairs under ``sequence``."""
        packed = self.pair_lengths(tokens)
        if packed is not None:
            return packed[0]
        return self._is_response(tokens).sum(dim=1).clamp(min=1).float()

    def _restrict(self, batch: NoisedBatch, tokens, per_pair: bool = False) -> NoisedBatch:
        """Keep the loss on response tokens, the prompt clean; with ``per_pair`` (training under
        ``objective.loss_norm=sequence``) packed rows carry 1 / N_pair in their weights (module docstring)."""
        is_response = self._is_response(tokens)  # [B, S]
        batch.loss_mask = batch.loss_mask & is_response
        batch.weights = torch.where(batch.loss_mask, batch.weights, torch.zeros(()))
        batch.input_ids = torch.where(is_response, batch.input_ids, tokens.tokens)  # prompt stays clean
        batch.num_tokens = is_response.sum(dim=1).clamp(min=1).float()
        return self.per_pair(batch, tokens) if per_pair else batch

    def per_pair(self, batch: NoisedBatch, tokens) -> NoisedBatch:
        """``batch`` with each weight of a packed row (``data.sft_packing``) divided by the response length of its
        pair and ``num_tokens`` 1 (each pair's 1 / N_pair is in its weights): the training batch under
        ``objective.loss_norm=sequence`` (module docstring). ``batch``'s rows are those of ``tokens``, or several
        copies of them stacked (complementary masks). Rows of one pair each: ``batch`` as it is."""
        packed = self.pair_lengths(tokens)
        if packed is None:
            return batch
        lengths = packed[1].repeat(batch.weights.shape[0] // packed[1].shape[0], 1)
        batch.weights = batch.weights / lengths
        batch.num_tokens = torch.ones_like(batch.num_tokens)
        return batch

    def noise(self, tokens, sample_ids: Sequence[int], key: tuple[int, ...], global_batch_size: int,
              t_sampling: str | None = None) -> NoisedBatch:
        per_pair = getattr(self.cfg, "loss_norm", "token") == "sequence"
        return self._restrict(super().noise(tokens, sample_ids, key, global_batch_size, t_sampling), tokens, per_pair)

    def eval_noise(self, tokens, sample_ids: Sequence[int], draw: int, num_draws: int, seed: int) -> NoisedBatch:
        return self._restrict(super().eval_noise(tokens, sample_ids, draw, num_draws, seed), tokens)
