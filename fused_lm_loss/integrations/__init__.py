"""Framework integrations: Hugging Face transformers (``patch`` / ``unpatch``) and peft.

Importing this package also registers a global ``nn.Module`` registration hook so that
``model.loss_function = FusedLMLoss(...)`` on a transformers model is never silently ignored:
transformers' ``loss_function`` property would keep returning its default loss while
``nn.Module.__setattr__`` files the loss away as a child module. The hook patches the model with
that loss instead (or reconfigures an already patched one).
"""
from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

from ..loss import FusedLMLoss
from .transformers import assign_loss_function, patch, unpatch


def _is_transformers_or_peft_model(module: nn.Module) -> bool:
    cls = type(module)
    if cls.__module__.startswith("peft.") and hasattr(module, "get_base_model"):
        return True
    # transformers' PreTrainedModel defines loss_function as a property (without importing transformers here)
    return any(isinstance(vars(base).get("loss_function"), property) for base in cls.__mro__)


def _on_submodule_registered(module: nn.Module, name: str, submodule: Any) -> None:
    if name == "loss_function" and isinstance(submodule, FusedLMLoss) and _is_transformers_or_peft_model(module):
        assign_loss_function(module, submodule)


register_module_module_registration_hook(_on_submodule_registered)

__all__ = ["patch", "unpatch"]
