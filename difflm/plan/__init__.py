"""Plan a run before renting the GPUs (``difflm-plan``): per-GPU memory by part, predicted step time by part, and a
search over layouts, from the same composed config as ``difflm-train`` and a calibration of the GPU's rates.

* :mod:`difflm.plan.shapes`: the model's parameters (names, shapes) and how each layout places them;
* :mod:`difflm.plan.memory`: bytes per GPU by part (parameters, gradients, optimizer, activations, logits, buffers);
* :mod:`difflm.plan.activations`: the bytes a block saves for its backward under the run's kernel set (torch, TE);
* :mod:`difflm.plan.rates`: the GPU's rates (GEMM, attention, HBM, collectives) from a calibration file;
* :mod:`difflm.plan.step_time`: compute and exposed communication of one optimizer step;
* :mod:`difflm.plan.trace`: the peak memory of a real step traced under fake tensors, the memory model's reference;
* :mod:`difflm.plan.from_config`: the vocabulary and layout of a composed train config;
* :mod:`difflm.plan.search`: the layouts, micro-batch sizes and checkpointing choices that fit, ranked.
"""
