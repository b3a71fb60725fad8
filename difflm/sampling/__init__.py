"""Sampling: LLaDA masked-diffusion generation and left-to-right decoding for ``ar`` models."""

from difflm.sampling.autoregressive import autoregressive_generate
from difflm.sampling.diffusion import (
    GenerationConfigError,
    LogitsFn,
    diffusion_generate,
    gumbel_argmax,
    num_transfer_tokens,
)

__all__ = [
    "GenerationConfigError",
    "LogitsFn",
    "autoregressive_generate",
    "diffusion_generate",
    "gumbel_argmax",
    "num_transfer_tokens",
]
