"""Data pipeline: tokenizer, Megatron .bin/.idx datasets, corpus preprocessing, packed windows."""
from difflm.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from difflm.data.preprocess import tokenize_corpus
from difflm.data.tokenizer import TokenizerInfo, build_tokenizer
from difflm.data.datasets import build_datasets, build_sampler
from difflm.data.windows import GlobalBatchSampler, PackedStream, PackedWindows, build_windows

__all__ = [
    "TokenizerInfo", "build_tokenizer", "IndexedDataset", "IndexedDatasetBuilder", "tokenize_corpus",
    "PackedStream", "PackedWindows", "build_windows", "GlobalBatchSampler", "build_sampler", "build_datasets",
]
