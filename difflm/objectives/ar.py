"""Autoregressive baseline: next-token cross-entropy with causal attention, on the same model."""
from __future__ import annotations

from typing import Sequence

import torch

from difflm.data.batch import split_batch
from difflm.model.masks import DocumentMask
from difflm.objectives.base import NoisedBatch


class ARObjective:
    """Next-token prediction: position j predicts token j+1; the loss is the mean NLL (nats/token).

    The input keeps the full window (the last position has no target and no loss), so the model sees
    the same shapes as under ``mdlm``.
    """

    causal = True

    def __init__(self, cfg, mask_id: int):
        self.cfg, self.mask_id = cfg, mask_id

    def num_tokens(self, tokens) -> torch.Tensor:
        """The L - 1 predicted positions of each row of ``tokens`` [B, L] (tensor or TokenBatch), [B] float32."""
        tokens, _ = split_batch(tokens)
        return torch.full((tokens.shape[0],), float(tokens.shape[1] - 1))

    def noise(self, tokens: torch.Tensor, sample_ids: Sequence[int], key: tuple[int, ...], global_batch_size: int,
              t_sampling: str | None = None) -> NoisedBatch:
        """Next-token batch of ``tokens`` [B, S] (or a TokenBatch: intra-document causal mask from its doc ids)."""
        tokens, extras = split_batch(tokens)
        b, s = tokens.shape
        targets = torch.roll(tokens, shifts=-1, dims=1)
        loss_mask = torch.ones(b, s, dtype=torch.bool)
        loss_mask[:, -1] = False
        return NoisedBatch(
            input_ids=tokens,
            targets=targets,
            loss_mask=loss_mask,
            weights=loss_mask.float(),
            t=torch.zeros(b),
            num_tokens=self.num_tokens(tokens),
            attn_mask=None if extras is None or extras.doc_ids is None else DocumentMask(extras.doc_ids, causal=True),
        )

    def eval_noise(self, tokens: torch.Tensor, sample_ids: Sequence[int], draw: int, num_draws: int,
                   seed: int) -> NoisedBatch:
        """The AR loss is exact: every draw is the same next-token batch."""
        return self.noise(tokens, sample_ids, (seed,), len(sample_ids))
