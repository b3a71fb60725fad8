"""The frozen reference model of GRPO's KL and DPO's scores, a pluggable choice (``algorithm.reference``):

  * ``frozen_copy``: a second, frozen copy of the initial policy (same kernels and device; eval mode, no gradients);
  * ``adapters_off``: the policy itself with its LoRA adapters switched off, so no second copy is held. It calls
    ``adapters_disabled(model)``, a context manager of the LoRA model converter (``difflm.model.lora``), and is
    refused with one line where that converter is not installed;
  * ``none``: no reference (GRPO with ``algorithm.beta=0``).

A reference is a callable ``ref(x, **model_kwargs) -> logits`` run under ``torch.no_grad``, plus ``state_dict`` /
``load_state_dict`` so checkpoints carry it.
"""
from __future__ import annotations

import copy
import importlib
from typing import Optional

import torch

from difflm.errors import DifflmError

REFERENCES = ("frozen_copy", "adapters_off", "none")


class FrozenCopyReference:
    """A deep copy of ``model`` taken now (the initial policy), frozen: eval mode, ``requires_grad=False``."""

    def __init__(self, model: torch.nn.Module):
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.model(x, **kwargs)

    def state_dict(self) -> dict:
        return self.model.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state)


class AdaptersOffReference:
    """The policy with its adapters off: ``with adapters_disabled(policy): policy(x)``. ``adapters_disabled`` is
    given, or imported from ``difflm.model.lora``. Holds no weights of its own (an empty state dict)."""

    def __init__(self, policy: torch.nn.Module, adapters_disabled=None):
        if adapters_disabled is None:
            try:
                lora = importlib.import_module("difflm.model.lora")
                adapters_disabled = lora.adapters_disabled
            except (ImportError, AttributeError):
                raise DifflmError("algorithm.reference=adapters_off needs the LoRA converter (difflm.model.lora."
                                  "adapters_disabled), which this install lacks: use algorithm.reference=frozen_copy")
            if not any(lora.is_adapter(name) for name, _ in policy.named_parameters()):
                # nothing to switch off: the reference would be the policy itself, a KL of 0 whatever beta
                raise DifflmError("algorithm.reference=adapters_off needs a LoRA run (init.run_dir trained with "
                                  "lora.rank > 0) and this policy has no adapters: add fresh ones (lora=attn_mlp) or "
                                  "use algorithm.reference=frozen_copy")
        self.policy, self.adapters_disabled = policy, adapters_disabled

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        was_training = self.policy.training
        self.policy.eval()
        try:
            with self.adapters_disabled(self.policy):
                return self.policy(x, **kwargs)
        finally:
            self.policy.train(was_training)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def build_reference(name: str, policy: torch.nn.Module, adapters_disabled=None) -> Optional[object]:
    """The reference named ``name`` (:data:`REFERENCES`) for ``policy``; None for ``none``.

    Raises: DifflmError for an unknown name, or ``adapters_off`` without the LoRA converter."""
    if name == "frozen_copy":
        return FrozenCopyReference(policy)
    if name == "adapters_off":
        return AdaptersOffReference(policy, adapters_disabled)
    if name == "none":
        return None
    raise DifflmError(f"algorithm.reference={name!r} is not one of {', '.join(REFERENCES)}")


__all__ = ["AdaptersOffReference", "FrozenCopyReference", "REFERENCES", "build_reference"]
