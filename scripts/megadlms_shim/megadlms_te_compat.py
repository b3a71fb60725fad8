"""Transformer Engine 2.20 under the TE 1.x names that MegaDLMs' Megatron-LM imports (our shim, not their code).

MegaDLMs (github JinjieNi/MegaDLMs, ``megatron/core/extensions/transformer_engine.py``) does

    from transformer_engine.pytorch.attention import _SplitAlongDim      # fast QKV split
    from transformer_engine.pytorch.attention import FusedRoPEFunc       # apply_rope_fusion
    FusedRoPEFunc.apply(t, freqs, "sbhd")                                # TE 1.x argument order
    FusedRoPEFunc.apply(t, freqs, "thd", cu_seqlens, cp_size, cp_rank)

In TE 2.20 ``SplitAlongDim`` lives in ``transformer_engine.pytorch.utils`` and ``FusedRoPEFunc`` in
``transformer_engine.pytorch.attention.rope``, whose ``forward(t, freqs, start_positions=None,
tensor_format="sbhd", interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0)`` gained
``start_positions`` (3rd) and ``interleaved`` (5th). Without the aliases MegaDLMs silently falls back to
``torch.split`` and refuses ``apply_rope_fusion``; :func:`install` adds them right after
``transformer_engine.pytorch.attention`` is first imported (an import hook, so nothing is imported early).
"""
from __future__ import annotations

import importlib
import importlib.abc
import sys

TARGET = "transformer_engine.pytorch.attention"


class LegacyFusedRoPEFunc:
    """``FusedRoPEFunc`` with TE 1.x's positional order: ``apply(t, freqs, tensor_format="sbhd",
    cu_seqlens=None, cp_size=1, cp_rank=0)`` -> TE 2.x ``apply(t, freqs, None, tensor_format, False,
    cu_seqlens, cp_size, cp_rank)`` (no start positions: training; not interleaved: Megatron's
    ``rotary_interleaved`` is False in the 1.x call). Tensors: ``t`` [S, B, H, D] ("sbhd") or [T, H, D]
    ("thd"), ``freqs`` [S, 1, 1, D] float32; returns the rotated ``t`` (same shape and dtype)."""

    impl = None  # the TE 2.x autograd Function, set by patch()

    @classmethod
    def apply(cls, t, freqs, tensor_format="sbhd", cu_seqlens=None, cp_size=1, cp_rank=0):
        return cls.impl.apply(t, freqs, None, tensor_format, False, cu_seqlens, cp_size, cp_rank)


def patch(attention_module) -> list[str]:
    """Add the missing 1.x names to ``transformer_engine.pytorch.attention``; returns the names added."""
    added = []
    if not hasattr(attention_module, "_SplitAlongDim"):
        utils = importlib.import_module("transformer_engine.pytorch.utils")
        if hasattr(utils, "SplitAlongDim"):
            attention_module._SplitAlongDim = utils.SplitAlongDim
            added.append("_SplitAlongDim")
    if not hasattr(attention_module, "FusedRoPEFunc"):
        rope = importlib.import_module(TARGET + ".rope")
        if hasattr(rope, "FusedRoPEFunc"):
            LegacyFusedRoPEFunc.impl = rope.FusedRoPEFunc
            attention_module.FusedRoPEFunc = LegacyFusedRoPEFunc
            added.append("FusedRoPEFunc")
    return added


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch_fn):
        self.loader, self.patch_fn = loader, patch_fn

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch_fn(module)

    def __getattr__(self, name):  # get_filename, is_package, get_source, ... of the real loader
        return getattr(self.loader, name)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds module ``target`` with the other finders and runs ``patch_fn(module)`` right after it executes."""

    def __init__(self, target: str = TARGET, patch_fn=patch):
        self.target, self.patch_fn = target, patch_fn

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, self.patch_fn)
                return spec
        return None


def install_hook(target: str, patch_fn) -> None:
    """Run ``patch_fn(module)`` on module ``target`` now if it is already imported, else when it is (idempotent)."""
    if target in sys.modules:
        patch_fn(sys.modules[target])
    elif not any(isinstance(f, _PatchingFinder) and f.target == target for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchingFinder(target, patch_fn))


def install() -> None:
    """Patch TE now if it is already imported, else when it is (idempotent)."""
    install_hook(TARGET, patch)
