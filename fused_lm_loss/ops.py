"""The fused loss as PyTorch operators (``torch.library.custom_op``): one opaque node for torch.compile.

    fused_lm_loss::linear_cross_entropy          hidden states -> loss (or per-token losses), lse, and the
                                                 gradients made in forward
    fused_lm_loss::linear_cross_entropy_backward reduction="none": the gradients for a per-token grad_output
    fused_lm_loss::logits_cross_entropy          the same from logits that already exist (transformers'
    fused_lm_loss::logits_cross_entropy_backward loss signature)
    fused_lm_loss::rescale_grads                 compiled backward: grad_output / scaling on the saved gradients

Each takes its tensors and call values, then the options (``ops_common.fused_op``: generated from
``LossOptions``, read by name). Everything data-dependent (the selected-row count, the label check, the host
syncs, the chunk loop) happens inside an operator, so Dynamo sees static shapes: the loss is () (or like the
labels), each gradient is shaped like its input, or (0,) when not needed (``loss_outputs``, which the fake and
the real implementation share). A changing number of ignored labels therefore never recompiles, and the kernels
inside are never traced or re-compiled by Inductor.

Autograd (``register_autograd``): gradients are made in forward and saved; backward multiplies them by
``grad_output / scaling`` (``ops_common.rescaled``: on the device, with no host sync, where the graph is freed;
out of place under retain_graph). In eager mode a factor of exactly 1.0 returns the saved tensors themselves.
Compiled backward runs ``rescale_grads`` instead, which always writes new tensors (an operator may not return its
inputs): one multiply per gradient. A scale of 0 with a non-zero grad_output raises in both. reduction="none"
saves the inputs (version counters guard them) and recomputes in backward. Second-order gradients are not
supported: a backward with ``create_graph=True`` raises.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from .backends import get_backend
from .chunked import GivenLogits, KeptLogits, LossStep, Rows, label_ids, run_chunks, select_rows
from .distributed import Shard
from .inputs import check_gathered_for_backward
from .ops_common import (
    Spec, absent, allocate, conform, fused_op, grad_specs, kept_logits_spec, linear_call, only_needed, per_token,
    gradient_scale, refuse_double_backward, rescaled, save_grads, save_with_options, saved_with_options,
    shaped_like, without_tensors,
)
from .options import LossOptions
from .plan import GradNeeds, loss_terms, make_plan

F32 = torch.float32


def mean_denominator(n_rows: int, num_items: Tensor | None) -> float:
    """What reduction="mean" divides the summed loss by: exactly ``num_items_in_batch`` when given, else
    the number of rows with a loss. When no row carries a loss the sum is 0 and so is the loss (also with
    ``num_items_in_batch=0``); a zero ``num_items_in_batch`` with rows that carry a loss raises."""
    if num_items is None:
        return float(max(n_rows, 1))
    denominator = float(num_items)
    if not math.isfinite(denominator) or denominator < 0 or (denominator == 0 and n_rows > 0):
        raise ValueError(
            f"num_items_in_batch must be a finite number > 0 when tokens carry a loss, got {denominator}"
        )
    return denominator if denominator > 0 else 1.0


# ---- fused_lm_loss::linear_cross_entropy ---------------------------------------------------------------


def loss_outputs(opts: LossOptions, needs: Sequence[bool], hidden: Tensor, weight: Tensor, bias: Tensor | None,
                 low_rank_input: Tensor | None, low_rank_weight: Tensor | None, labels: Tensor) -> list[Spec]:
    """The outputs of ``linear_cross_entropy`` (its fake and real implementations both follow this)."""
    per_token_loss = opts.reduction == "none"
    loss_shape = tuple(labels.shape) if per_token_loss else ()
    none = Spec((0,), F32)
    return [
        Spec(loss_shape, F32),
        Spec((labels.numel(),), F32) if per_token_loss and any(needs) else none,  # lse, for the recompute
        Spec(loss_shape, F32) if opts.return_z_loss else none,
        Spec(loss_shape, F32) if opts.return_token_accuracy else none,
        *grad_specs(opts, needs, not per_token_loss, (hidden, weight, bias, low_rank_input, low_rank_weight), labels),
        kept_logits_spec(opts, per_token_loss and any(needs), hidden, weight, labels),
    ]


@fused_op("fused_lm_loss::linear_cross_entropy")
def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    low_rank_input: Optional[Tensor],
    low_rank_weight: Optional[Tensor],
    labels: Tensor,
    num_items: Optional[Tensor],
    scale: Optional[Tensor],
    scaling: float,
    needs: Sequence[bool],
    *,
    opts: LossOptions,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse, z_loss, token_accuracy, d hidden, d weight, d bias, d u, d B, kept logits) of
    CE(transform(h @ W.T + b + u @ B.T), labels), with the options' smoothing, z-loss and class weights.

    hidden (..., H), weight (V_shard, H), bias (V_shard,), u (..., r), B (V_shard, r), labels (...) of any
    integer dtype and any strides. loss is () for "mean"/"sum", shaped like labels (fp32) for "none"; lse (N,)
    fp32 only for "none" with gradients (saved for the recompute), else (0,); z_loss and token_accuracy reduced
    like the loss when asked for, else (0,). Each gradient is made only where ``needs`` says (order: hidden,
    weight, bias, u, B), contiguous and shaped like its input, scaled by ``scaling`` (or the value of ``scale``) /
    the mean denominator; else (0,). The kept logits (N, V_shard) in the logits dtype (their first rows.count
    rows: the selected rows' raw logits) only for "none" with gradients and ``keep_logits``, for the backward to
    read instead of recomputing; else (0,).
    """
    specs = loss_outputs(opts, needs, hidden, weight, bias, low_rank_input, low_rank_weight, labels)
    device, kept_logits = hidden.device, allocate(specs[-1:], hidden.device)[0]
    scaling = gradient_scale(scale, scaling)
    grad_needs = GradNeeds(*needs)
    head, rows, backend, shard = linear_call(opts, hidden, weight, bias, low_rank_input, low_rank_weight, labels,
                                             KeptLogits.of(kept_logits, "store"), needs, num_items)
    terms = loss_terms(opts, shard, device)

    if opts.reduction == "none":  # per-token grad_output is unknown until backward: save lse, recompute then
        plan = make_plan(opts, backend, shard, rows, head, terms=terms)
        step = run_chunks(plan, head, rows, LossStep(plan, device)).step
        lse = rows.scatter(step.lse) if grad_needs.any() else None
        extras = _extras(opts, step, rows, labels, 1.0)
        return conform(specs, (per_token(step.loss, rows, labels), lse, *extras, *(None,) * 5, kept_logits), device)

    grad_terms = None
    if terms.class_weight is not None:  # the mean divides by the targets' summed weights, as F.cross_entropy
        weight_sum = float(terms.class_weight[rows.target].sum()) if rows.count else 0.0
        # kept targets whose weights sum to 0: 0 / 0, NaN as F.cross_entropy; no kept rows: 0, as unweighted
        denominator = (weight_sum or math.nan) if opts.reduction == "mean" and rows.count else 1.0
        # ... and the (unweighted) z-loss by the token count, as Liger: its gradient coefficient follows
        z_denominator = float(max(rows.count, 1)) if opts.reduction == "mean" else 1.0
        grad_terms = terms.with_z_loss(opts.z_loss * denominator / z_denominator if denominator else 0.0)
    else:
        denominator = mean_denominator(rows.count, num_items) if opts.reduction == "mean" else 1.0
        z_denominator = denominator
    plan = make_plan(opts, backend, shard, rows, head, needs=grad_needs, grad_scale=scaling / denominator,
                     terms=terms, grad_terms=grad_terms)
    out = run_chunks(plan, head, rows, LossStep(plan, device))
    step = out.step
    z_terms = opts.z_loss * step.lse * step.lse if opts.z_loss > 0 else None
    if z_terms is not None and z_denominator != denominator:  # the z-loss's own denominator
        loss = (step.loss - z_terms).sum() / denominator + z_terms.sum() / z_denominator
    else:
        loss = step.loss.sum() / denominator
    inputs = (hidden, weight, bias, low_rank_input, low_rank_weight)
    grads = (shaped_like(g, x) for g, x in zip(out.grads[0], inputs))
    return conform(specs, (loss, None, *_extras(opts, step, rows, labels, z_denominator), *grads, kept_logits), device)


def _extras(opts: LossOptions, step: LossStep, rows: Rows, labels: Tensor, z_denominator: float) -> tuple:
    """(z_loss, token_accuracy) reduced like the loss (detached: for logging), None when not asked for. The
    accuracy is the fraction of tokens with a loss whose label is the argmax (per token: 0 or 1)."""
    z_value = accuracy = None
    if opts.return_z_loss:
        z_terms = opts.z_loss * step.lse * step.lse
        if opts.reduction == "none":
            z_value = per_token(z_terms, rows, labels)
        else:
            z_value = z_terms.sum() / (z_denominator if opts.reduction == "mean" else 1.0)
    if opts.return_token_accuracy:
        correct = (step.argmax == rows.target).float()
        if opts.reduction == "none":
            accuracy = per_token(correct, rows, labels)
        else:
            accuracy = correct.sum() / (max(rows.count, 1) if opts.reduction == "mean" else 1.0)
    return z_value, accuracy


@linear_cross_entropy.register_fake
def _(hidden, weight, bias, low_rank_input, low_rank_weight, labels, num_items, scale, scaling, needs, *, opts):
    specs = loss_outputs(opts, needs, hidden, weight, bias, low_rank_input, low_rank_weight, labels)
    return allocate(specs, hidden.device)


def _backward_outputs(needs: Sequence[bool], inputs: Sequence[Tensor | None]) -> list[Spec]:
    """Gradients in the inputs' dtypes, (0,) where not needed."""
    return [Spec(tuple(x.shape), x.dtype) if need else absent(inputs[0]) for need, x in zip(needs, inputs)]


@fused_op("fused_lm_loss::linear_cross_entropy_backward")
def linear_cross_entropy_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    low_rank_input: Optional[Tensor],
    low_rank_weight: Optional[Tensor],
    labels: Tensor,
    lse: Tensor,
    kept_logits: Tensor,
    grad_per_token: Tensor,
    needs: Sequence[bool],
    *,
    opts: LossOptions,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of sum_i grad_per_token[i] * loss_i (reduction="none"; grad_per_token shaped like labels),
    from the forward's lse and its kept logits, or (``kept_logits`` (0,)) recomputing the logits chunk by chunk
    from the saved inputs; (0,) where not needed."""
    inputs = (hidden, weight, bias, low_rank_input, low_rank_weight)
    head, rows, backend, shard = linear_call(opts, *inputs, labels, KeptLogits.of(kept_logits, "reuse"), needs)
    plan = make_plan(opts, backend, shard, rows, head, needs=GradNeeds(*needs),
                     terms=loss_terms(opts, shard, hidden.device), vocab_tiles=True)
    row_scale = rows.take(grad_per_token.reshape(-1).float())
    out = run_chunks(plan, head, rows, LossStep(plan, hidden.device, lse=rows.take(lse), row_scale=row_scale))
    grads = [shaped_like(g, x, x.dtype if x is not None else None) for g, x in zip(out.grads[0], inputs)]
    return conform(_backward_outputs(needs, inputs), grads, hidden.device)


@linear_cross_entropy_backward.register_fake
def _(hidden, weight, bias, low_rank_input, low_rank_weight, labels, lse, kept_logits, grad_per_token, needs, *,
      opts):
    return allocate(_backward_outputs(needs, (hidden, weight, bias, low_rank_input, low_rank_weight)), hidden.device)


def _setup_linear(ctx, inputs, opts, output) -> None:
    hidden, weight, bias, low_rank_input, low_rank_weight, labels, _, scale, scaling, needs = inputs
    loss, lse, z_value, accuracy, *grads, kept_logits = output
    ctx.needs = tuple(needs)
    ctx.dtypes = tuple(None if x is None else x.dtype for x in (hidden, weight, bias, low_rank_input, low_rank_weight))
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse, z_value, accuracy, *grads, kept_logits)
    if opts.reduction == "none":
        save_with_options(ctx, opts, hidden, weight, bias, low_rank_input, low_rank_weight, labels, lse, kept_logits)
    else:
        ctx.opts, ctx.scaling = without_tensors(opts), scaling
        save_grads(ctx, grads, scale)


def _backward_linear(ctx, grad_loss, *unused):
    refuse_double_backward(grad_loss)
    call_values = (None,) * 5  # labels, num_items, scale, scaling, needs
    if grad_loss is None or not any(ctx.needs):
        return (None,) * 5 + call_values
    if ctx.opts.reduction == "none":
        saved, opts = saved_with_options(ctx)
        check_gathered_for_backward(saved[1])  # (the weight)
        grads = linear_cross_entropy_backward(*saved, grad_loss, list(ctx.needs), opts=opts)
    else:
        scale, *saved = ctx.saved_tensors
        made = [g for g, need in zip(saved, ctx.needs) if need]
        dtypes = [dtype for dtype, need in zip(ctx.dtypes, ctx.needs) if need]
        rescaled_grads = iter(rescaled(made, dtypes, grad_loss, scale, ctx.scaling))
        grads = [next(rescaled_grads) if need else None for need in ctx.needs]
    return (*only_needed(grads, ctx.needs), *call_values)


linear_cross_entropy.register_autograd(_backward_linear, setup_context=_setup_linear)


# ---- fused_lm_loss::logits_cross_entropy ---------------------------------------------------------------


def _logits_outputs(opts: LossOptions, need_grad: bool, logits: Tensor, labels: Tensor) -> list[Spec]:
    per_token_loss = opts.reduction == "none"
    return [
        Spec(tuple(labels.shape) if per_token_loss else (), F32),
        Spec((labels.numel(),), F32) if per_token_loss and need_grad else Spec((0,), F32),
        Spec(tuple(logits.shape), logits.dtype) if need_grad and not per_token_loss else absent(logits),
    ]


def _logits_call(opts: LossOptions, logits: Tensor, labels: Tensor):
    """(head, rows, backend, shard) of a call on given logits."""
    labels = label_ids(labels)
    vocab = logits.shape[-1]
    backend = get_backend(logits.device)
    shard = Shard.whole(vocab)
    rows = select_rows(labels, opts.ignore_index, shard, backend)
    return GivenLogits(logits.reshape(labels.numel(), vocab)), rows, backend, shard


@fused_op("fused_lm_loss::logits_cross_entropy")
def logits_cross_entropy(
    logits: Tensor, labels: Tensor, num_items: Optional[Tensor], scale: Optional[Tensor], scaling: float,
    need_grad: bool, *, opts: LossOptions
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, lse, d logits) of CE(logits / temperature, labels) for logits (..., V) that already carry the
    model's softcap / scale; the same outputs and rules as ``linear_cross_entropy`` (d logits in the logits'
    dtype, made times ``scaling`` or the value of ``scale``, as a GradScaler's gradients: fp16 keeps them)."""
    specs = _logits_outputs(opts, need_grad, logits, labels)
    scaling = gradient_scale(scale, scaling)
    head, rows, backend, shard = _logits_call(opts, logits, labels)
    terms = loss_terms(opts, shard, logits.device)
    if opts.reduction == "none":
        plan = make_plan(opts, backend, shard, rows, head, terms=terms)
        step = run_chunks(plan, head, rows, LossStep(plan, logits.device)).step
        lse = rows.scatter(step.lse) if need_grad else None
        return conform(specs, (per_token(step.loss, rows, labels), lse, None), logits.device)
    denominator = mean_denominator(rows.count, num_items) if opts.reduction == "mean" else 1.0
    plan = make_plan(opts, backend, shard, rows, head, needs=GradNeeds(hidden=need_grad),
                     grad_scale=scaling / denominator, terms=terms)
    out = run_chunks(plan, head, rows, LossStep(plan, logits.device))
    grad = shaped_like(out.grads[0][0], logits)
    return conform(specs, (out.step.loss.sum() / denominator, None, grad), logits.device)


@logits_cross_entropy.register_fake
def _(logits, labels, num_items, scale, scaling, need_grad, *, opts):
    return allocate(_logits_outputs(opts, need_grad, logits, labels), logits.device)


@fused_op("fused_lm_loss::logits_cross_entropy_backward")
def logits_cross_entropy_backward(
    logits: Tensor, labels: Tensor, lse: Tensor, grad_per_token: Tensor, *, opts: LossOptions
) -> Tensor:
    """d(sum_i grad_per_token[i] * loss_i) / d logits (reduction="none")."""
    head, rows, backend, shard = _logits_call(opts, logits, labels)
    plan = make_plan(opts, backend, shard, rows, head, needs=GradNeeds(hidden=True),
                     terms=loss_terms(opts, shard, logits.device))
    row_scale = rows.take(grad_per_token.reshape(-1).float())
    out = run_chunks(plan, head, rows, LossStep(plan, logits.device, lse=rows.take(lse), row_scale=row_scale))
    return out.grads[0][0].view(logits.shape)


@logits_cross_entropy_backward.register_fake
def _(logits, labels, lse, grad_per_token, *, opts):
    return logits.new_empty(logits.shape)


def _setup_logits(ctx, inputs, opts, output) -> None:
    logits, labels, _, scale, scaling, need_grad = inputs
    loss, lse, grad = output
    ctx.need_grad = need_grad
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse, grad)
    if opts.reduction == "none":
        save_with_options(ctx, opts, logits, labels, lse)
    else:
        ctx.opts, ctx.scaling = without_tensors(opts), scaling
        save_grads(ctx, [grad], scale)


def _backward_logits(ctx, grad_loss, *unused):
    refuse_double_backward(grad_loss)
    call_values = (None,) * 5  # labels, num_items, scale, scaling, need_grad
    if grad_loss is None or not ctx.need_grad:
        return (None, *call_values)
    if ctx.opts.reduction == "none":
        saved, opts = saved_with_options(ctx)
        return (logits_cross_entropy_backward(*saved, grad_loss, opts=opts), *call_values)
    scale, grad = ctx.saved_tensors
    return (rescaled([grad], [grad.dtype], grad_loss, scale, ctx.scaling)[0], *call_values)


logits_cross_entropy.register_autograd(_backward_logits, setup_context=_setup_logits)
