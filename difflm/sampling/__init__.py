"""Sampling: LLaDA masked-diffusion generation (with Fast-dLLM decoding), BD3-LM block-wise sampling and
left-to-right decoding for ``ar`` models, all configured by one :class:`GenerationOptions`."""

from difflm.sampling.autoregressive import autoregressive_generate
from difflm.sampling.block_diffusion import block_diffusion_generate
from difflm.sampling.diffusion import (
    LogitsFn,
    diffusion_generate,
    filter_top_k_top_p,
    gumbel_argmax,
    num_transfer_tokens,
)
from difflm.sampling.options import GenerationConfigError, GenerationOptions

__all__ = [
    "GenerationConfigError",
    "GenerationOptions",
    "LogitsFn",
    "autoregressive_generate",
    "block_diffusion_generate",
    "filter_top_k_top_p",
    "diffusion_generate",
    "gumbel_argmax",
    "num_transfer_tokens",
]
