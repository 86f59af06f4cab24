"""Public API: ``FusedLMLoss`` (the nn.Module) and ``fused_linear_cross_entropy`` (the function).

Both check their tensors (``inputs.py``: a clear error before any kernel runs), apply autocast as ``nn.Linear``
would, resolve the gradient scale, and call the ``fused_lm_loss::linear_cross_entropy`` operator (ops.py).
``logits_loss`` is the same on logits that already exist.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from . import ops
from .inputs import check_logits, grad_needs, linear_inputs, num_items_tensor, resolve_scaling
from .options import LossOptions, check_supported


def lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    opts: LossOptions,
    *,
    num_items_in_batch: Any = None,
    scaling: float | torch.Tensor | None = None,
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | LossOutput:
    """The loss of ``FusedLMLoss(**opts)(hidden, weight, labels, bias, ...)``: check, autocast, run the op."""
    tensors, needs = linear_inputs(hidden, weight, labels, bias, low_rank)
    num_items = num_items_tensor(num_items_in_batch, opts)
    scale, scaling = resolve_scaling(opts, scaling)
    loss, _, z_loss, token_accuracy, *_ = ops.linear_cross_entropy(
        *tensors, labels, num_items, scale, scaling, needs, opts=opts
    )
    if opts.return_z_loss or opts.return_token_accuracy:
        return LossOutput(loss, z_loss if opts.return_z_loss else None,
                          token_accuracy if opts.return_token_accuracy else None)
    return loss


class LossOutput(NamedTuple):
    """What FusedLMLoss returns with ``return_z_loss`` or ``return_token_accuracy`` (each None when not asked for)."""

    loss: torch.Tensor  # as without the flags
    z_loss: torch.Tensor | None  # the z-loss term inside ``loss``, reduced the same way (detached: for logging)
    token_accuracy: torch.Tensor | None  # fraction of tokens with a loss whose label is the argmax (per token: 0/1)


def logits_loss(
    logits: torch.Tensor, labels: torch.Tensor, opts: LossOptions, *, num_items_in_batch: Any = None
) -> torch.Tensor:
    """Cross-entropy of logits that already exist (already through the model's softcap / scale), with the
    options' ``ignore_index``, temperature, label smoothing, z-loss, reduction and gradient scale (``grad_scaler``),
    in chunks: no fp32 copy of the logits.

    ``logits`` (..., V), ``labels`` shaped like ``logits.shape[:-1]`` (already shifted).
    """
    check_supported(opts, "logits")
    check_logits(logits, labels)
    num_items = num_items_tensor(num_items_in_batch, opts)
    need_grad = grad_needs((logits,))[0]
    scale, scaling = resolve_scaling(opts, None)
    return ops.logits_cross_entropy(logits, labels, num_items, scale, scaling, need_grad, opts=opts)[0]


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    num_items_in_batch: Any = None,
    scaling: float | torch.Tensor | None = None,
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
    **options: Any,
) -> torch.Tensor | LossOutput:
    """Functional form of :class:`FusedLMLoss`; ``options`` are its constructor arguments.

    Example::

        loss = fused_linear_cross_entropy(hidden, lm_head.weight, labels, label_smoothing=0.1)
    """
    return lm_loss(
        hidden,
        weight,
        labels,
        bias,
        LossOptions(**options),
        num_items_in_batch=num_items_in_batch,
        scaling=scaling,
        low_rank=low_rank,
    )


#: Run once, when the first FusedLMLoss is made (integrations/ installs the hook that makes
#: ``model.loss_function = FusedLMLoss(...)`` take effect): importing the package changes nothing global.
_first_instance_hooks: list[Callable[[], None]] = []


def on_first_instance(hook: Callable[[], None]) -> None:
    """Call ``hook()`` when the first FusedLMLoss is constructed or unpickled (now, if one already was)."""
    _first_instance_hooks.append(hook)
    if _made_one:
        hook()


_made_one = False


def _first_instance() -> None:
    global _made_one
    if not _made_one:
        _made_one = True
        for hook in _first_instance_hooks:
            hook()


class FusedLMLoss(nn.Module):
    """Language-model loss = cross-entropy(hidden @ weight.T + bias, labels), never materializing the logits.

    Per token (ignored tokens contribute 0)::

        z    = logit_scale * (h @ W.T + b), then softcap * tanh(z / softcap) if softcap is set, then z / temperature
        loss = (1 - label_smoothing) * (lse(z) - z[y]) + label_smoothing * (lse(z) - mean(z)) + z_loss * lse(z)**2

    Args:
        ignore_index: label value that carries no loss (-100, as in Hugging Face).
        reduction: "mean" (sum / num_items_in_batch, or / non-ignored count), "sum", or "none" (per token, fp32).
        label_smoothing: in [0, 1], as ``torch.nn.functional.cross_entropy`` defines it.
        z_loss: coefficient of lse**2 added per token (PaLM z-loss).
        softcap: final logit softcapping (Gemma 2/3), or None.
        logit_scale: multiplies the logits before softcap (Cohere ``logit_scale``, Granite ``1 / logits_scaling``).
        temperature: divides the (scaled, softcapped) logits before the softmax (> 0), as Liger's and TRL's fused
            losses offer it (e.g. distillation-style training on softened targets).
        chunk_size: at most this many token rows per chunk (chunks are made equal). None: the chunk takes at
            most 240 MiB, plus, with an fp32 dW accumulator for a bf16/fp16 weight, the accumulator's memory
            (one chunk, which needs none) or the returned dW's (several chunks; dW is allocated after them).
        accum_dtype: dtype the gradients are kept in until backward (the dW accumulator, dX, db); None = the
            inputs' dtypes.
        logits_dtype: None (logits in the matmul dtype) or torch.float32 (bf16/fp16 inputs, fp32 logits:
            more exact gradients, one extra buffer).
        grad_scaler: a ``torch.amp.GradScaler`` (or anything with ``get_scale()``); its scale is read once
            per call and applied to the gradients before they are stored in fp16/bf16.
        process_group: vocab parallelism (a tensor-parallel lm_head) over this torch.distributed group:
            ``weight`` (and ``bias``) hold this rank's contiguous vocab shard, hidden and labels (global ids)
            are the same on every rank, and every rank returns the full loss. Example in
            ``fused_lm_loss.distributed``.
        vocab_start, vocab_size: for unequal shards, this rank's first vocab row and the whole vocabulary
            size (default: equal shards, vocab_start = rank * weight.shape[0]).
        reduce_grad_input: with process_group, sum the hidden-state gradient over the group (default), or
            leave each rank's partial for frameworks whose column-parallel linear all-reduces it in backward
            (Megatron-LM's ``ColumnParallelLinear`` input).
        class_weight: a (V,) float tensor, the weight of each class, as ``F.cross_entropy(weight=...)`` defines
            it (with label smoothing and ignore_index as PyTorch combines them; "mean" divides by the summed
            weights of the targets). A z-loss stays unweighted and is averaged over the tokens, as in Liger.
        return_z_loss, return_token_accuracy: also return the z-loss term and the token accuracy (the fraction
            of tokens with a loss whose label is the argmax), both reduced like the loss and detached: the call
            returns a ``LossOutput(loss, z_loss, token_accuracy)``.
        keep_logits: where backward must recompute the logits (reduction="none", and ``token_stats`` with
            per-token gradients and a trainable lm_head, e.g. TRL's RL trainers on a patched model), keep them
            from forward instead: one lm_head matmul fewer per step, for N x V values in the logits dtype held
            from forward to backward (2.1 GB at 8192 tokens of Llama-3's vocabulary in bf16). Elsewhere the
            gradients are made in forward and nothing is kept.

    Call: ``loss_fn(hidden, weight, labels, bias=None, *, num_items_in_batch=None, scaling=None, low_rank=None)``
    with hidden (..., H), weight (V, H), labels shaped like hidden.shape[:-1] (already shifted).
    ``num_items_in_batch`` (a number or a tensor, as transformers passes it) divides the summed loss instead of
    the count of kept tokens: reduction="mean" only, and not with class_weight (use "sum" and divide).
    ``scaling`` overrides the grad_scaler's scale for this call. ``low_rank=(u, B)`` with u (..., r) and
    B (V, r) adds u @ B.T to the logits: a LoRA adapter on lm_head (u = s * dropout(h) @ A.T, B = lora_B).
    Returns the loss, or a ``LossOutput`` with return_z_loss / return_token_accuracy.
    For "mean" / "sum" the gradients are computed during forward and backward only rescales them;
    reduction="none" recomputes the logits in backward (see keep_logits).
    For logits that already exist (transformers' ``loss_function(logits, labels, vocab_size)``), patch the
    model instead (``fused_lm_loss.patch``), or call ``integrations.causal_lm_loss``.

    Example::

        loss_fn = FusedLMLoss(label_smoothing=0.1)
        hidden = model.model(input_ids).last_hidden_state[:, :-1]
        loss = loss_fn(hidden, model.lm_head.weight, input_ids[:, 1:])
        loss.backward()
    """

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        softcap: float | None = None,
        logit_scale: float = 1.0,
        temperature: float = 1.0,
        chunk_size: int | None = None,
        accum_dtype: torch.dtype | None = torch.float32,
        grad_scaler: Any = None,
        logits_dtype: torch.dtype | None = None,
        process_group: Any = None,
        vocab_start: int | None = None,
        vocab_size: int | None = None,
        reduce_grad_input: bool = True,
        class_weight: torch.Tensor | None = None,
        return_z_loss: bool = False,
        return_token_accuracy: bool = False,
        keep_logits: bool = False,
    ) -> None:
        super().__init__()
        self.options = LossOptions(
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            softcap=softcap,
            logit_scale=logit_scale,
            temperature=temperature,
            chunk_size=chunk_size,
            accum_dtype=accum_dtype,
            logits_dtype=logits_dtype,
            grad_scaler=grad_scaler,
            process_group=process_group,
            vocab_start=vocab_start,
            vocab_size=vocab_size,
            reduce_grad_input=reduce_grad_input,
            class_weight=class_weight,
            return_z_loss=return_z_loss,
            return_token_accuracy=return_token_accuracy,
            keep_logits=keep_logits,
        )
        _first_instance()

    def __setstate__(self, state: dict) -> None:
        # an unpickled loss (torch.load, another process) is made without __init__: it too must install the hooks
        super().__setstate__(state)
        _first_instance()

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        num_items_in_batch: Any = None,
        scaling: float | torch.Tensor | None = None,
        low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | LossOutput:
        if not isinstance(labels, torch.Tensor) and isinstance(weight, torch.Tensor) and not weight.is_floating_point():
            raise TypeError(
                "FusedLMLoss is called as loss_fn(hidden, weight, labels); this looks like transformers' "
                "(logits, labels, vocab_size) signature: patch the model (fused_lm_loss.patch), which computes the "
                "loss from the hidden states, or use fused_lm_loss.integrations.causal_lm_loss for given logits"
            )
        return lm_loss(
            hidden,
            weight,
            labels,
            bias,
            self.options,
            num_items_in_batch=num_items_in_batch,
            scaling=scaling,
            low_rank=low_rank,
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{f.name}={getattr(self.options, f.name)!r}" for f in dataclasses.fields(LossOptions)
                         if self.options.is_set(f.name))
