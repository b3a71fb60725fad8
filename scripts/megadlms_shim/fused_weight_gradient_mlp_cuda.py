"""Stand-in for apex's ``fused_weight_gradient_mlp_cuda`` CUDA extension (absent on the GPU image; our code).

Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication`` (MegaDLMs' output layer) refuses
``gradient_accumulation_fusion`` without it and calls, in the backward pass,

    wgrad_gemm_accum_fp32(input, grad_output, main_grad)   # main_grad float32
    wgrad_gemm_accum_fp16(input, grad_output, main_grad)   # main_grad float16 / bfloat16

with ``input`` [N, in] and ``grad_output`` [N, out] (bf16/fp16; leading dims are flattened here) and
``main_grad`` [out, in]: ``main_grad += grad_output^T @ input``. Apex writes the GEMM's FP32 accumulator
straight into ``main_grad``; here ``torch.matmul`` rounds it to the input dtype before the add (one extra
elementwise pass over the weight's gradient). TE's own layers do not use this module (they accumulate into
``main_grad`` themselves), so only the LM head goes through it.
"""
import torch


def _accumulate(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    x = input.reshape(-1, input.shape[-1])
    g = grad_output.reshape(-1, grad_output.shape[-1])
    main_grad.add_(torch.matmul(g.t(), x))


def wgrad_gemm_accum_fp32(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad`` (float32, [out, in]) += ``grad_output``^T @ ``input``."""
    _accumulate(input, grad_output, main_grad)


def wgrad_gemm_accum_fp16(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad`` (float16/bfloat16, [out, in]) += ``grad_output``^T @ ``input``."""
    _accumulate(input, grad_output, main_grad)
