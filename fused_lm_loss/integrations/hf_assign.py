"""``model.loss_function = FusedLMLoss(...)`` on a transformers model is never silently ignored.

transformers' ``loss_function`` is a read-only property, so ``nn.Module.__setattr__`` would file the loss
away as a child module and the model would keep its default loss. A global ``nn.Module`` registration
hook sees that assignment and patches the model with the loss instead (or reconfigures an already patched
one). The hook is installed when the first ``FusedLMLoss`` is made (``loss.on_first_instance``): importing
fused_lm_loss changes nothing global.
"""
from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

from ..loss import FusedLMLoss, on_first_instance
from .wrappers import inner_model

_installed = False


def install() -> None:
    """Register the hook (once)."""
    global _installed
    if not _installed:
        register_module_module_registration_hook(_on_submodule_registered)
        _installed = True


def _on_submodule_registered(module: nn.Module, name: str, submodule: Any) -> None:
    if name == "loss_function" and isinstance(submodule, FusedLMLoss) and _is_transformers_model(inner_model(module)):
        from .hf_patch import assign_loss_function

        assign_loss_function(module, submodule)


def _is_transformers_model(module: nn.Module) -> bool:
    # transformers' PreTrainedModel defines loss_function as a property (without importing transformers here)
    return any(isinstance(vars(base).get("loss_function"), property) for base in type(module).__mro__)


on_first_instance(install)
