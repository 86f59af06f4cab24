"""The tensors of a call, checked on the host before any kernel runs: a clear ``TypeError`` / ``ValueError`` for
anything the fused computations cannot take (a wrong shape, dtype or device, a DTensor shard, a non-integer label),
autocast applied as ``nn.Linear`` applies it, and the per-call values (``num_items_in_batch``, the gradient scale)
in the form the operators take. Shared by ``loss.py`` and ``per_token.py``.

Example::

    tensors, needs = linear_inputs(hidden, weight, labels, bias, low_rank=None)   # (h, W, b, u, B), grads asked
"""
from __future__ import annotations

from typing import Any

import torch

from .options import MATMUL_DTYPES, LossOptions, is_finite


def linear_inputs(
    hidden: Any, weight: Any, labels: Any, bias: Any, low_rank: Any
) -> tuple[tuple[torch.Tensor | None, ...], list[bool]]:
    """((hidden, weight, bias, u, B) after autocast, which of them need a gradient) of a call on hidden states."""
    check_tensors(hidden, weight, labels, bias)
    if low_rank is not None:
        check_low_rank(low_rank, hidden, weight)
    tensors = matmul_inputs(hidden, weight, bias, *(low_rank or (None, None)))
    return tensors, grad_needs(tensors)


def grad_needs(tensors: tuple[torch.Tensor | None, ...]) -> list[bool]:
    """Which of ``tensors`` need a gradient. Under ``torch.func.vmap`` a batched tensor reports requires_grad False
    whatever the tensor it batches does, so the per-sample calls of PyTorch's fallback would make it no gradient:
    that is refused (vmap without gradients, e.g. for evaluation, works). So is forward-mode AD (a tensor that
    carries a tangent: ``torch.func.jvp``, ``jacfwd``, ``torch.autograd.forward_ad``): the operators have no forward
    derivative, and PyTorch would give their outputs a zero tangent without a word."""
    if not torch.compiler.is_compiling() and any(t is not None and _carries_tangent(t) for t in tensors):
        raise RuntimeError(
            "fused_lm_loss does not support forward-mode AD (torch.func.jvp / jacfwd / hessian, "
            "torch.autograd.forward_ad): its operators have no forward derivative, so the tangent would be 0 "
            "silently. Use reverse mode (backward, torch.autograd.grad, torch.func.grad / jacrev), or F.cross_entropy "
            "on the logits"
        )
    if not torch.is_grad_enabled():
        return [False for _ in tensors]
    if not torch.compiler.is_compiling():
        for t in tensors:
            if t is not None and _batched_requires_grad(t):
                raise RuntimeError(
                    "fused_lm_loss under torch.func.vmap cannot make the gradient of a batched input (vmap hides its "
                    "requires_grad from the operator): pass the batch as leading dimensions of hidden / labels (any "
                    "number is taken), or loop over it"
                )
    return [t is not None and t.requires_grad for t in tensors]


def _carries_tangent(t: torch.Tensor) -> bool:
    """Whether ``t`` is a dual tensor of the current forward-AD level (torch.func.jvp's inputs are, at their level)."""
    return torch.autograd.forward_ad.unpack_dual(t).tangent is not None


def _batched_requires_grad(t: torch.Tensor) -> bool:
    functorch, batched = torch._C._functorch, False
    while functorch.is_batchedtensor(t):
        t, batched = functorch.get_unwrapped(t), True
    return batched and t.requires_grad


def check_tensors(hidden: Any, weight: Any, labels: Any, bias: Any) -> None:
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels), ("bias", bias)):
        check_dense(name, t)
    if hidden.dtype not in MATMUL_DTYPES or weight.dtype not in MATMUL_DTYPES:
        raise ValueError(
            f"hidden and weight must be float32, bfloat16 or float16; got {hidden.dtype} and {weight.dtype}"
        )
    if hidden.dim() < 1 or weight.dim() != 2:
        raise ValueError(f"expected hidden (..., H) and weight (V, H); got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"hidden size mismatch: hidden (..., {hidden.shape[-1]}) vs weight {tuple(weight.shape)}")
    if weight.shape[0] < 1:
        raise ValueError("weight has no vocabulary rows")
    check_labels(labels, hidden.shape[:-1], hidden.device)
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {getattr(bias, 'shape', bias)}")
    devices = {t.device for t in (hidden, weight, bias) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"hidden, weight and bias must be on one device, got {sorted(map(str, devices))}")


def check_logits(logits: Any, labels: Any) -> None:
    """Logits that already exist, (..., V) float, and their labels."""
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError("logits and labels must be tensors")
    check_dense("logits", logits)
    if logits.dtype not in MATMUL_DTYPES or logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be float32, bfloat16 or float16 of shape (..., V >= 1); got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    check_labels(labels, logits.shape[:-1], logits.device)


def check_labels(labels: torch.Tensor, shape: torch.Size, device: torch.device) -> None:
    """Labels: integer class ids (any integer dtype, any strides), one per token, on the tensors' device."""
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor of class ids, got {labels.dtype}")
    if labels.shape != shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal the tokens' shape {tuple(shape)}")
    if labels.device != device:
        raise ValueError(f"labels are on {labels.device} but the other tensors on {device}; move them first")


def check_dense(name: str, t: Any) -> None:
    """A plain strided tensor holding all of its values: a sparse (or other layout) tensor gets a clear error instead
    of one from deep inside; a shard computed with as if whole would silently use part of the weight, so a DTensor
    (FSDP2 / tensor parallel) and a DeepSpeed ZeRO-3 partition that is not gathered are refused."""
    if isinstance(t, torch.Tensor) and t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}: call .to_dense() first")
    if t is None or not torch.distributed.is_available():
        return
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5 kept it private
        from torch.distributed._tensor import DTensor

    if isinstance(t, DTensor):
        raise ValueError(
            f"{name} is a DTensor (placements {tuple(t.placements)}): the fused loss needs plain tensors. For an "
            "FSDP2-sharded lm_head, compute the loss inside the lm_head module's forward, where FSDP has "
            "all-gathered the weight; for vocab parallelism pass the local shard (.to_local()) and process_group"
        )
    if is_zero3_partition(t):
        raise ValueError(f"{name} is a DeepSpeed ZeRO-3 partition, not gathered (full shape "
                         f"{tuple(t.ds_shape)}). {_ZERO3_HINT}")


_ZERO3_HINT = ("Patch the model (fused_lm_loss.patch(model)): it gathers a partitioned lm_head for the loss and "
               "again for backward. Calling the loss yourself, gather the head around the whole step "
               "(deepspeed.zero.GatheredParameters) or register it with the module whose forward computes the "
               "loss (deepspeed.zero.register_external_parameter).")


def is_zero3_partition(t: Any) -> bool:
    """A DeepSpeed ZeRO-3 parameter whose data is now its partition (an empty placeholder), not the whole tensor."""
    return hasattr(t, "ds_id") and hasattr(t, "ds_shape") and tuple(t.shape) != tuple(t.ds_shape)


def check_gathered_for_backward(weight: torch.Tensor) -> None:
    """Backward that recomputes the logits reads the weight saved in forward: a ZeRO-3 parameter re-partitioned
    meanwhile (DeepSpeed swaps ``param.data``, which no version counter sees) or an FSDP2 weight resharded after
    forward (its storage freed) gives a clear error."""
    if is_zero3_partition(weight):
        raise RuntimeError("fused_lm_loss: backward recomputes the logits with the lm_head weight, which is a "
                           "DeepSpeed ZeRO-3 partition again (not gathered for backward). " + _ZERO3_HINT)
    if weight.numel() and weight.untyped_storage().size() == 0:
        raise RuntimeError(
            "fused_lm_loss: backward recomputes the logits (reduction='none' or per-token weights) with the lm_head "
            "weight saved in forward, whose storage has been freed since: FSDP2 resharded lm_head after forward "
            "(its own FSDP unit, reshard_after_forward=True), and no gradient flows through lm_head's output to "
            "unshard it again. Keep lm_head in its parent's unit, or fully_shard(lm_head, reshard_after_forward=False)"
        )


def check_low_rank(low_rank: Any, hidden: torch.Tensor, weight: torch.Tensor) -> None:
    if not isinstance(low_rank, (tuple, list)) or len(low_rank) != 2:
        raise ValueError("low_rank must be a pair (u, B): u (..., r) per token, B (V, r)")
    u, b = low_rank
    if not isinstance(u, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise ValueError(f"low_rank must be a pair of tensors (u, B), got ({type(u).__name__}, {type(b).__name__})")
    check_dense("low_rank u", u)
    check_dense("low_rank B", b)
    if u.shape[:-1] != hidden.shape[:-1] or b.dim() != 2 or b.shape != (weight.shape[0], u.shape[-1]):
        raise ValueError(
            f"low_rank shapes must be u {tuple(hidden.shape[:-1])} + (r,) and B ({weight.shape[0]}, r); "
            f"got {tuple(u.shape)} and {tuple(b.shape)}"
        )
    if u.device != hidden.device or b.device != hidden.device:
        raise ValueError("low_rank tensors must be on the device of hidden")


def matmul_inputs(hidden, weight, bias, low_rank_input=None, low_rank_weight=None, *, side: str = ""
                  ) -> tuple[torch.Tensor | None, ...]:
    """Under autocast, cast to its dtype as nn.Linear would; otherwise all matmul operands must agree. ``side``
    names them in the error (distillation: "student" / "teacher")."""
    tensors = (hidden, weight, bias, low_rank_input, low_rank_weight)
    device_type = hidden.device.type
    if device_type != "meta" and torch.is_autocast_enabled(device_type):  # (meta has no autocast: torch raises)
        dtype = torch.get_autocast_dtype(device_type)
        return tuple(None if t is None else t.to(dtype) for t in tensors)
    if len({t.dtype for t in tensors if t is not None}) > 1:
        names = ("hidden", "weight", "bias", "low_rank u", "low_rank B")
        given = ", ".join(f"{name} {t.dtype}" for name, t in zip(names, tensors) if t is not None)
        whose = f"the {side}'s " if side else ""
        raise ValueError(f"{whose}matmul operands must share one dtype, got {given}; cast them, or run under "
                         "torch.autocast")
    return tensors


def resolve_scaling(opts: LossOptions, scaling: float | torch.Tensor | None) -> tuple[torch.Tensor | None, float]:
    """(scale tensor or None, scaling): ``scaling`` if given, else the GradScaler's current scale (its tensor,
    read inside the operator, so that no host sync happens here), else 1."""
    if isinstance(scaling, torch.Tensor):
        if scaling.numel() != 1:
            raise ValueError(f"scaling must hold one number, got a tensor of shape {tuple(scaling.shape)}")
        return scaling, 1.0
    if scaling is not None:
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not is_finite(scaling) or scaling < 0:
            raise ValueError(f"scaling must be a finite number >= 0, got {scaling!r}")
        return None, float(scaling)
    scaler = opts.grad_scaler
    if scaler is None:
        return None, 1.0
    if isinstance(scaler, torch.amp.GradScaler):  # read as attributes: torch.compile traces no call into torch.amp
        if not scaler._enabled:  # scale(loss) returns the loss itself (and a disabled scaler has no _scale)
            return None, 1.0
        if isinstance(scaler._scale, torch.Tensor):
            return scaler._scale, 1.0
        # before its first scale(): that call will scale by init_scale, as get_scale() says
        return None, float(scaler._init_scale)
    return None, float(scaler.get_scale())


def num_items_tensor(num_items_in_batch: Any, opts: LossOptions) -> torch.Tensor | None:
    """``num_items_in_batch`` (a number or a tensor, as transformers passes it) as a tensor, or None."""
    if num_items_in_batch is None:
        return None
    if opts.reduction != "mean":
        raise ValueError(f"num_items_in_batch divides the loss and needs reduction='mean', not {opts.reduction!r}")
    if opts.class_weight is not None:
        raise ValueError("num_items_in_batch with class_weight: the mean divides by the summed weights of the targets "
                         "(as F.cross_entropy); pass reduction='sum' and divide yourself to use another denominator")
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1:
            raise ValueError(f"num_items_in_batch must hold one number, got shape {tuple(num_items_in_batch.shape)}")
        return num_items_in_batch
    if isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, (int, float)):
        raise ValueError(f"num_items_in_batch must be a number or a tensor, got {num_items_in_batch!r}")
    return torch.tensor(float(num_items_in_batch), dtype=torch.float64)
