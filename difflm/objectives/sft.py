"""Supervised fine-tuning of a masked-diffusion model on prompt/response pairs (LLaDA, Nie et al. 2025,
sec. 2.3 and eq. 5; the SFT recipe of the LLaDA repository's GUIDELINES.md).

The prompt p_0 is never masked and carries no loss; the response r_0 (with EOS padding up to the window,
which the model must learn to emit: that is how it learns where to stop) is masked as in pre-training:

    L = - E_{t, r_t} [ (1 / t) sum_{i in response, masked} log p_theta(r_0^i | p_0, r_t) ] / N

with N the response length of each sample (``objective.loss_norm=sequence``, LLaDA's ``answer_lengths``)
or the number of response tokens of the global batch (``token``).
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

    def num_tokens(self, tokens) -> torch.Tensor:
        """Response length of each row (prompt excluded; at least 1), [B] float32: LLaDA's ``answer_lengths``."""
        return self._is_response(tokens).sum(dim=1).clamp(min=1).float()

    def _restrict(self, batch: NoisedBatch, tokens) -> NoisedBatch:
        is_response = self._is_response(tokens)  # [B, S]
        batch.loss_mask = batch.loss_mask & is_response
        batch.weights = torch.where(batch.loss_mask, batch.weights, torch.zeros(()))
        batch.input_ids = torch.where(is_response, batch.input_ids, tokens.tokens)  # prompt stays clean
        batch.num_tokens = self.num_tokens(tokens)
        return batch

    def noise(self, tokens, sample_ids: Sequence[int], key: tuple[int, ...], global_batch_size: int,
              t_sampling: str | None = None) -> NoisedBatch:
        return self._restrict(super().noise(tokens, sample_ids, key, global_batch_size, t_sampling), tokens)

    def eval_noise(self, tokens, sample_ids: Sequence[int], draw: int, num_draws: int, seed: int) -> NoisedBatch:
        return self._restrict(super().eval_noise(tokens, sample_ids, draw, num_draws, seed), tokens)
