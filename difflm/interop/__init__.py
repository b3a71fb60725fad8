"""Hugging Face interop: ``difflm-export`` (:mod:`difflm.interop.export`: run -> HF directory with a
self-contained modeling file) and ``difflm-import`` (:mod:`difflm.interop.hf_import`: Llama / Qwen2 / Qwen3
causal LMs or difflm exports -> a difflm run dir). See docs/hf_interop.md."""
