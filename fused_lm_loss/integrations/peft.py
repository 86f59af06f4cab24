"""peft layers on lm_head: what the fused loss needs from them.

``head_pieces(head, x)`` turns the module a model calls as its lm_head into
``(weight, bias, low_rank)`` for the fused loss, where ``low_rank = (u, B)`` adds ``u @ B.T`` to the
logits:

* plain ``nn.Linear``: its weight and bias.
* peft LoRA ``Linear``: the base layer's weight and bias, and for the active adapters
  ``u = concat_i(scaling_i * lora_A_i(dropout_i(x)))``, ``B = concat_i(lora_B_i.weight)`` (several
  adapters are one low-rank term of the summed rank). Disabled or merged adapters: the base only,
  as peft computes it. Gradients reach lora_A (through u) and lora_B exactly.
* ``ModulesToSaveWrapper``: the active trainable copy (or the original when adapters are off).

Anything else (DoRA and other LoRA variants, ``lora_bias``, other peft tuners, quantized or custom
heads) raises ``NotImplementedError`` naming it, never a silently different loss.
"""
from __future__ import annotations

import importlib
import sys

import torch
from torch import nn

Pieces = tuple[torch.Tensor, "torch.Tensor | None", "tuple[torch.Tensor, torch.Tensor] | None"]


def check_head(head: nn.Module) -> None:
    """Raise now (at patch time) for a lm_head the fused loss cannot compute."""
    _resolve(head, None)


def head_pieces(head: nn.Module, x: torch.Tensor) -> Pieces:
    """(weight, bias, low_rank) of lm_head applied to ``x``."""
    return _resolve(head, x)


def _resolve(head: nn.Module, x: torch.Tensor | None) -> Pieces:
    if "peft" in sys.modules:  # peft layers exist only once peft is imported
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import ModulesToSaveWrapper

        if isinstance(head, ModulesToSaveWrapper):
            return _resolve(_active_copy(head), x)
        if _own_class(head) is LoraLinear:
            if _is_fsdp2_unit(head):
                raise NotImplementedError(
                    "fused_lm_loss: LoRA on an lm_head that FSDP2 shards as a unit of its own (fully_shard(lm_head)) "
                    "is not supported: FSDP2 gathers the adapters again for backward through a hook on lm_head's "
                    "output, which the fused loss never uses. Leave lm_head in its parent's unit"
                )
            return _lora_pieces(head, x)
        if isinstance(head, BaseTunerLayer) or type(head).__module__.startswith("peft."):
            raise NotImplementedError(
                f"fused_lm_loss: lm_head is a peft {type(head).__name__}, which the fused loss does not support "
                "(supported on lm_head: plain LoRA, modules_to_save)"
            )
    if isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward:
        return head.weight, head.bias, None
    raise NotImplementedError(
        f"fused_lm_loss: lm_head is a {type(head).__name__}; the fused loss needs a plain nn.Linear "
        "(optionally wrapped by peft LoRA or modules_to_save)"
    )


def _fsdp2_module_class() -> type | None:
    """FSDP2's ``FSDPModule`` (torch < 2.6: in ``torch.distributed._composable.fsdp``), or None. Looked up once, at
    import: under torch.compile on torch 2.5 a failing import inside the traced forward is a Dynamo error, not
    the ImportError it would be in eager."""
    if not torch.distributed.is_available():
        return None
    for path in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            found = getattr(importlib.import_module(path), "FSDPModule", None)
        except ImportError:
            continue
        if found is not None:
            return found
    return None


FSDP2_MODULE = _fsdp2_module_class()


def _is_fsdp2_unit(module: nn.Module) -> bool:
    return FSDP2_MODULE is not None and isinstance(module, FSDP2_MODULE)


def _own_class(module: nn.Module) -> type:
    """The module's class, through the subclass FSDP2's fully_shard swaps in (FSDPLinear(FSDPModule, cls))."""
    cls = type(module)
    if _is_fsdp2_unit(module):
        return next(base for base in cls.__bases__ if base is not FSDP2_MODULE)
    return cls


def _active_copy(wrapper: nn.Module) -> nn.Module:
    """The module a ModulesToSaveWrapper forwards to."""
    active = list(getattr(wrapper, "active_adapters", None) or [wrapper.active_adapter])
    if wrapper.disable_adapters or not active or any(a not in wrapper.modules_to_save for a in active):
        return wrapper.original_module
    return wrapper.modules_to_save[active[0]]


def _lora_pieces(layer: nn.Module, x: torch.Tensor | None) -> Pieces:
    weight, bias, _ = _resolve(layer.base_layer, None)
    if layer.disable_adapters:
        if layer.merged and x is not None:
            layer.unmerge()  # what peft's own forward does with adapters disabled
        return weight, bias, None
    if layer.merged:  # the adapters' delta is inside the base weight
        return weight, bias, None
    names = [a for a in layer.active_adapters if a in layer.lora_A]
    for name in names:
        if getattr(layer, "use_dora", {}).get(name) or name in getattr(layer, "lora_variant", {}):
            raise NotImplementedError(
                f"fused_lm_loss: adapter {name!r} on lm_head is a LoRA variant (e.g. DoRA), which the fused loss "
                "does not support"
            )
        if layer.lora_B[name].bias is not None:
            raise NotImplementedError(f"fused_lm_loss: adapter {name!r} on lm_head has lora_bias; not supported")
    if x is None or not names:
        return weight, bias, None
    inputs, outputs = [], []
    for name in names:
        lora_a = layer.lora_A[name]
        h = layer.lora_dropout[name](x.to(lora_a.weight.dtype))
        inputs.append(lora_a(h) * layer.scaling[name])
        outputs.append(layer.lora_B[name].weight)
    u, b = torch.cat(inputs, dim=-1), torch.cat(outputs, dim=1)
    # peft keeps adapters in fp32 next to a bf16 base; the fused matmul runs in one dtype (the base's)
    if not torch.is_autocast_enabled(x.device.type):
        u, b = u.to(weight.dtype), b.to(weight.dtype)
    return weight, bias, (u, b)
