"""The model inside its wrappers: peft (PeftModel, tuners such as LoraModel) and torch's DistributedDataParallel /
DataParallel. patch() and the loss_function assignment hook both reach the transformers model through it."""
from __future__ import annotations

from torch import nn


def inner_model(module: nn.Module) -> nn.Module:
    """The model inside its wrappers: a peft PeftModel (``get_base_model()``) or tuner such as LoraModel
    (``.model``), torch's DistributedDataParallel / DataParallel (``.module``); the module itself otherwise."""
    while True:
        if type(module).__module__.startswith("peft."):
            inner = module.get_base_model() if hasattr(module, "get_base_model") else getattr(module, "model", None)
        elif isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            inner = module.module
        else:
            return module
        if not isinstance(inner, nn.Module) or inner is module:
            return module
        module = inner
