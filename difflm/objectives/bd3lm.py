"""Block diffusion (BD3-LM; Arriola et al. 2025, "Block Diffusion: Interpolating Between Autoregressive and
Diffusion Language Models", ICLR 2025).

The sequence x of length L is split into B = L / ``objective.block_size`` blocks. The model is
autoregressive over blocks and a masked-diffusion model within a block:

    -log p(x) <= sum_b  E_{t_b} E_{x_t^b} [ w(t_b) * sum_{i in block b, masked} -log p_theta(x^i | x_t^b, x^{<b}) ]

(their eq. 6/7 with the MDLM NELBO of each block; w = 1/t for the linear schedule). One t per block.
Training runs every block in one forward (their "vectorised training", sec. 3.2): the model sees the
2 L tokens ``[x_t ; x_0]`` with RoPE positions ``0..L-1`` for both halves and the block-causal mask of
:func:`difflm.model.masks.block_causal_mask` (a noisy block attends to itself and the clean blocks before
it; clean blocks attend block-causally). Loss and logits only at masked positions of the noisy half.

``objective.clean_attention=causal`` makes the clean half attend causally instead (Megatron-Bridge's
``sbd_block_diff`` mask, :mod:`difflm.objectives.hybrid`): the noisy half's context is the same clean tokens, encoded
left to right, as a KV-cached sampler with a causal prefill encodes them.

Limits: ``block_size = 1`` is next-token prediction (each token predicted from the clean prefix with only
a mask token at its own position: the AR NLL in expectation, exactly so per masked token);
``block_size = L`` is MDLM (the noisy half sees only itself).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from difflm.data.batch import split_batch
from difflm.errors import DifflmError
from difflm.model.masks import BlockDiffusionMask
from difflm.objectives.base import NoisedBatch
from difflm.objectives.keyed_rng import STREAM_EVAL_MASK, STREAM_EVAL_T, STREAM_MASK, keyed_uniforms
from difflm.objectives.mdlm import MDLMObjective, draw_mask, sample_t


CLEAN_ATTENTION = ("block_causal", "causal")


def clean_causal(cfg) -> bool:
    """Whether the ``objective`` config's clean half attends causally (``objective.clean_attention``, default
    ``block_causal``). Raises: DifflmError for any other value."""
    value = cfg.get("clean_attention", "block_causal")
    if value not in CLEAN_ATTENTION:
        raise DifflmError(f"objective.clean_attention={value!r} is not one of: {', '.join(CLEAN_ATTENTION)}")
    return value == "causal"


class BD3LMObjective(MDLMObjective):
    """Block diffusion with keyed noise (one t per block). ``causal = False``: the mask comes with the batch.

    Args:
        cfg: the ``objective`` config; reads ``block_size``, ``eps``, ``schedule``, ``t_sampling``,
            ``clean_attention``.
        mask_id: id of the [MASK] token.
    Raises: DifflmError for ``block_size < 1`` or an unknown ``clean_attention``.
    """

    causal = False

    def __init__(self, cfg, mask_id: int):
        super().__init__(cfg, mask_id)
        self.block_size = int(cfg.block_size)
        if self.block_size < 1:
            raise DifflmError(f"objective.block_size={self.block_size} must be >= 1")
        self.clean_causal = clean_causal(cfg)

    def _blocks(self, seq_len: int) -> int:
        if seq_len % self.block_size != 0:
            raise DifflmError(f"objective.block_size={self.block_size} does not divide the sequence length "
                              f"{seq_len}: pick a divisor of data.seq_len (and objective.random_length_prob=0)")
        return seq_len // self.block_size

    def build(self, tokens: torch.Tensor, t: torch.Tensor, mask: torch.Tensor, extras=None) -> NoisedBatch:
        """The 2L-token batch from clean ``tokens`` [B, L], per-block ``t`` [B, nb] and a ``mask`` [B, L] bool."""
        b, length = tokens.shape
        _, w = self.schedule(t)
        w_pos = w.repeat_interleave(self.block_size, dim=1)  # [B, L]
        x_t = torch.where(mask, torch.full_like(tokens, self.mask_id), tokens)
        no = torch.zeros_like(mask)
        doc_ids = None if extras is None else extras.doc_ids  # packed documents stay apart in both halves
        inputs = self.model_inputs(x_t, tokens, doc_ids)
        return NoisedBatch(
            input_ids=inputs["input_ids"],
            targets=torch.cat([tokens, tokens], dim=1),
            loss_mask=torch.cat([mask, no], dim=1),
            weights=torch.cat([torch.where(mask, w_pos, torch.zeros(())), torch.zeros_like(w_pos)], dim=1).float(),
            t=t.mean(dim=1).float(),
            num_tokens=torch.full((b,), float(length)),
            attn_mask=inputs["attn_mask"],
            position_ids=inputs["position_ids"],
        )

    def model_inputs(self, x_t: torch.Tensor, tokens: torch.Tensor, doc_ids=None) -> dict:
        """The model inputs of the vectorised BD3-LM forward (module docstring), what :meth:`build` trains on and
        the post-training estimators score with (:mod:`difflm.posttrain.forward`).

        Args: ``x_t`` [B, L] int64 the noised sequence, ``tokens`` [B, L] int64 the clean one, ``doc_ids`` optional
        [B, L] int64 documents (tokens of different documents never attend to each other, in either half).
        Returns: ``input_ids`` [B, 2L] ``[x_t ; x_0]``, ``attn_mask`` the block-causal
        :class:`~difflm.model.masks.BlockDiffusionMask` (``objective.clean_attention``), ``position_ids`` [2L]
        (``0..L-1`` twice); the model's logits of the noisy half are its first L positions.
        """
        length = tokens.shape[1]
        return {"input_ids": torch.cat([x_t, tokens], dim=1),
                "attn_mask": BlockDiffusionMask(length, self.block_size, doc_ids, tokens.device, self.clean_causal),
                "position_ids": torch.arange(length, device=tokens.device).repeat(2)}

    def _mask(self, p_blocks: torch.Tensor, length: int, sample_ids: Sequence[int], key: tuple[int, ...],
              stream: int = STREAM_MASK) -> torch.Tensor:
        """Bernoulli mask [B, L] with the probability of each token's block; same uniforms as mdlm's draw_mask."""
        return draw_mask(p_blocks.repeat_interleave(self.block_size, dim=1), length, sample_ids, key, stream)

    def noise(self, tokens, sample_ids: Sequence[int], key: tuple[int, ...], global_batch_size: int,
              t_sampling: str | None = None) -> NoisedBatch:
        """Noise ``tokens`` [B, L]: t per block (block j of sample i is unit ``i * nb + j`` of ``G * nb`` for the
        low-discrepancy samplers), then a Bernoulli mask with each block's probability."""
        tokens, extras = split_batch(tokens)
        nb = self._blocks(tokens.shape[1])
        units = [int(i) * nb + j for i in sample_ids for j in range(nb)]
        t = sample_t(units, key=key, global_batch_size=global_batch_size * nb,
                     mode=t_sampling or self.cfg.t_sampling).view(len(sample_ids), nb)
        p, _ = self.schedule(t)
        return self.build(tokens, t, self._mask(p, tokens.shape[1], sample_ids, key), extras)

    def eval_noise(self, tokens, sample_ids: Sequence[int], draw: int, num_draws: int, seed: int) -> NoisedBatch:
        """Draw ``draw`` of ``num_draws``: antithetic t per block, t = (u_{i,j} + d / K) mod 1 (see mdlm)."""
        tokens, extras = split_batch(tokens)
        nb = self._blocks(tokens.shape[1])
        units = np.asarray([int(i) * nb + j for i in sample_ids for j in range(nb)], dtype=np.int64)
        u = torch.from_numpy(keyed_uniforms(STREAM_EVAL_T, seed, units)[:, 0]).view(len(sample_ids), nb)
        t = ((u + draw / num_draws) % 1.0).float()
        p, _ = self.schedule(t)
        return self.build(tokens, t, self._mask(p, tokens.shape[1], sample_ids, (seed, draw), STREAM_EVAL_MASK), extras)
