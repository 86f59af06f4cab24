"""The model inside its wrappers: peft (PeftModel, tuners such as LoraModel), torch's DistributedDataParallel /
DataParallel / FullyShardedDataParallel (FSDP1) and DeepSpeed's engine. patch() and the loss_function assignment
hook both reach the transformers model through it."""
from __future__ import annotations

from torch import nn


def inner_model(module: nn.Module) -> nn.Module:
    """The model inside its wrappers: a peft PeftModel (``get_base_model()``) or tuner such as LoraModel
    (``.model``); torch's DistributedDataParallel / DataParallel, FSDP1's FullyShardedDataParallel and DeepSpeed's
    DeepSpeedEngine (``.module``); the module itself otherwise. (Named by their modules, so that neither torch.distributed
    nor deepspeed is imported here.)"""
    while True:
        kind = type(module).__module__
        # (peft's class may be a base: FSDP2's fully_shard makes a subclass of the wrapper in a torch module)
        if any(c.__module__.startswith("peft.") for c in type(module).__mro__):
            inner = module.get_base_model() if hasattr(module, "get_base_model") else getattr(module, "model", None)
        elif isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)) or (
            type(module).__name__ == "FullyShardedDataParallel" and kind.startswith("torch.distributed.fsdp")
        ) or (type(module).__name__ == "DeepSpeedEngine" and kind.startswith("deepspeed.")):
            inner = getattr(module, "module", None)
        else:
            return module
        if not isinstance(inner, nn.Module) or inner is module:
            return module
        module = inner
