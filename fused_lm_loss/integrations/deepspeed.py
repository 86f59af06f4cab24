"""DeepSpeed ZeRO-3: a partitioned lm_head under the patched forward.

Under ZeRO-3 a parameter exists whole only while its owning module's forward runs, and again just before that
module's backward (DeepSpeed hooks the module's outputs). The patched forward computes the loss inside lm_head's
call, so forward sees the whole weight; but lm_head returns a probe, and the loss's graph does not pass through
lm_head's output: DeepSpeed would not gather the head again for backward, where the gradients made in forward
reach a partitioned parameter (the autograd engine raises "The size of tensor a (0) must match ...").

``register_partitioned_head`` registers the head's partitioned parameters as external parameters of the causal LM
(``deepspeed.zero.register_external_parameter``): DeepSpeed then gathers them for the model's forward and again
before the model's backward, which the loss's graph does pass through (``outputs.loss``), so their gradients reach
DeepSpeed's partitioned reduction once, like any parameter's. The cost: the head stays gathered for the whole
model forward and backward (V x H in the weight's dtype), not only during lm_head's call. Only parameters that
get a gradient are registered: a frozen head (LoRA) is read in forward only (its rows' gradients are made there),
so DeepSpeed gathers it just for lm_head's call, as without the patch, and not again for backward.
"""
from __future__ import annotations

from torch import nn

_REGISTERED_ATTR = "_fused_lm_loss_zero3_params"


def register_partitioned_head(model: nn.Module, head: nn.Module) -> None:
    """Register ``head``'s trainable ZeRO-3 partitioned parameters (those DeepSpeed gave a ``ds_id``) with
    ``model``, once each (called at every training forward: a parameter unfrozen later is registered then);
    nothing when there are none (DeepSpeed is then not imported)."""
    partitioned = [p for p in head.parameters() if hasattr(p, "ds_id") and p.requires_grad]
    if not partitioned:
        return
    registered = model.__dict__.setdefault(_REGISTERED_ATTR, set())
    missing = [p for p in partitioned if id(p) not in registered]
    if not missing:
        return
    import deepspeed

    for parameter in missing:
        deepspeed.zero.register_external_parameter(model, parameter)
        registered.add(id(parameter))
