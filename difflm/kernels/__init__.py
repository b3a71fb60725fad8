"""The optional fast kernels, in one place, that the model's kernel sets plug in (as Megatron-LM keeps its fusions in
``megatron/core/fusions/``):

* :mod:`difflm.kernels.qkv_triton` - the QKV head split, QK-norm and RoPE as one Triton kernel each way
  (``model.fused_qkv``), laid out by :mod:`difflm.kernels.qkv_layout`;
* :mod:`difflm.kernels.qkv_flash` - that kernel fused with FlashAttention 4 (``model.attention_backend=flash``);
* :mod:`difflm.kernels.quack_mlp`, :mod:`difflm.kernels.quack_norm_linear` - a block's MLP half and its attention
  half's norm + QKV projection on quack's fused GEMMs (``model.fused_mlp``);
* :mod:`difflm.kernels.embedding` - the embedding whose weight gradient accumulates into an FP32 ``main_grad``;
* :mod:`difflm.kernels.compiled` - small eager functions run as ``torch.compile``d regions on the GPU (the FP8
  experts' quantisation and padding);
* :mod:`difflm.kernels.main_grad` - the FP32 master weights and once-per-step BF16 casts they share with the TE kernel
  set (:mod:`difflm.model.te_kernels`).

Which of them a run uses is chosen by :mod:`difflm.model.auto_kernels`; none is imported until a kernel set asks.
"""
