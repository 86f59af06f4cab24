"""The fused loss as PyTorch operators (``torch.library.custom_op``): one opaque node for torch.compile.

    fused_lm_loss::linear_cross_entropy          hidden states -> loss (or per-token losses), lse, and the
                                                 gradients made in forward
    fused_lm_loss::linear_cross_entropy_backward reduction="none": the gradients for a per-token grad_output
    fused_lm_loss::logits_cross_entropy          the same from logits that already exist (transformers'
    fused_lm_loss::logits_cross_entropy_backward loss signature)
    fused_lm_loss::rescale_grads                 compiled backward: grad_output / scaling on the saved gradients

Everything data-dependent (the kept-row count, the label check, the host syncs, the chunk loop) happens
inside an operator, so Dynamo sees static shapes: the loss is () (or like the labels), each gradient is
shaped like its input, or (0,) when not needed. The fake implementations give exactly those shapes. A
changing number of ignored labels therefore never recompiles, and the kernels inside are never traced or
re-compiled by Inductor.

Autograd (``register_autograd``): gradients are made in forward and saved; backward multiplies them by
``grad_output / scaling``, out of place (retain_graph works). In eager mode a factor of exactly 1.0 returns
the saved tensors themselves. Compiled backward runs ``rescale_grads`` instead, which always writes new
tensors (an operator may not return its inputs): one multiply per gradient. A scale of 0 with a non-zero
grad_output raises in both. reduction="none" saves the inputs (version counters guard them) and recomputes
in backward. Second-order gradients are not supported: a backward with ``create_graph=True`` raises.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensor

from . import distributed
from .backends import backend_name, get_backend
from .chunked import GivenLogits, LinearHead, LossStep, label_ids, run_chunks, select_rows
from .options import LossOptions
from .plan import GradNeeds, grad_dtypes, make_plan

_NO_GRAD = GradNeeds()


# ---- the options as operator arguments (plain values; a process group by name) --------------------------


def option_args(opts: LossOptions) -> tuple:
    """The options of a call, in the operators' argument order (after the tensors and ``scaling``)."""
    return (
        opts.ignore_index, opts.reduction, float(opts.label_smoothing), float(opts.z_loss),
        None if opts.softcap is None else float(opts.softcap), float(opts.logit_scale), opts.chunk_size,
        opts.accum_dtype, opts.logits_dtype, distributed.group_name(opts.process_group), opts.vocab_start,
        opts.vocab_size, opts.reduce_grad_input, opts.return_z_loss, opts.return_token_accuracy, opts.keep_logits,
    )


def _options(
    ignore_index, reduction, label_smoothing, z_loss, softcap, logit_scale, chunk_size, accum_dtype, logits_dtype,
    group, vocab_start, vocab_size, reduce_grad_input, return_z_loss, return_token_accuracy, keep_logits,
) -> LossOptions:
    """The LossOptions of operator arguments (the class weights travel as a tensor argument of their own)."""
    return LossOptions(
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
        softcap=softcap, logit_scale=logit_scale, chunk_size=chunk_size, accum_dtype=accum_dtype,
        logits_dtype=logits_dtype, process_group=distributed.group_of(group), vocab_start=vocab_start,
        vocab_size=vocab_size, reduce_grad_input=reduce_grad_input, return_z_loss=return_z_loss,
        return_token_accuracy=return_token_accuracy, keep_logits=keep_logits,
    )


_OPTION_COUNT = 16


# ---- shared rules --------------------------------------------------------------------------------------


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


def _scaling(scale: Tensor | None, scaling: float) -> float:
    """The gradient scale of a call: the GradScaler's scale tensor when given, else ``scaling``."""
    value = float(scale) if scale is not None else float(scaling)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"the gradient scaling must be a finite number >= 0, got {value}")
    return value


def grad_factor(grad_output: Tensor, scaling: float) -> float:
    """grad_output / scaling for the gradients made in forward (scaled by ``scaling``); one host sync."""
    go = float(grad_output)
    if scaling == 0.0 and go != 0.0:
        raise RuntimeError(
            "the fused loss was computed with scaling=0 (a GradScaler scale of 0?): its gradients are all zero "
            f"and cannot be rescaled to grad_output={go}. Use a non-zero scale."
        )
    return 0.0 if scaling == 0.0 else go / scaling


def _empty(like: Tensor) -> Tensor:
    return like.new_empty((0,))


def _or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    """An operator output that was not asked for: (0,) like ``like`` (the fake implementations agree)."""
    return _empty(like) if t is None else t


# ---- fused_lm_loss::linear_cross_entropy ---------------------------------------------------------------


@torch.library.custom_op("fused_lm_loss::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    low_rank_input: Optional[Tensor],
    low_rank_weight: Optional[Tensor],
    labels: Tensor,
    num_items: Optional[Tensor],
    class_weight: Optional[Tensor],
    scale: Optional[Tensor],
    scaling: float,
    needs: Sequence[bool],
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    softcap: Optional[float],
    logit_scale: float,
    chunk_size: Optional[int],
    accum_dtype: Optional[torch.dtype],
    logits_dtype: Optional[torch.dtype],
    group: Optional[str],
    vocab_start: Optional[int],
    vocab_size: Optional[int],
    reduce_grad_input: bool,
    return_z_loss: bool,
    return_token_accuracy: bool,
    keep_logits: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse, z_loss, token_accuracy, d hidden, d weight, d bias, d u, d B, kept logits) of
    CE(softcap(s * (h @ W.T + b + u @ B.T)), labels), with class weights when given.

    hidden (..., H), weight (V_shard, H), bias (V_shard,), u (..., r), B (V_shard, r), labels (...) of any
    integer dtype and any strides, class_weight (V_shard,). loss is () for "mean"/"sum", shaped like labels
    (fp32) for "none"; lse (N,) fp32 only for "none" with gradients (kept for the recompute), else (0,);
    z_loss and token_accuracy reduced like the loss when asked for, else (0,). Each gradient is made only
    where ``needs`` says (order: hidden, weight, bias, u, B), contiguous and shaped like its input, scaled by
    ``scaling`` (or the value of ``scale``) / the mean denominator; else (0,). The kept logits (N, V_shard) in
    the logits dtype (their first rows.count rows: the kept rows' raw logits) only for "none" with gradients
    and ``keep_logits``, for the backward to read instead of recomputing; else (0,).
    """
    opts = _options(ignore_index, reduction, label_smoothing, z_loss, softcap, logit_scale, chunk_size,
                    accum_dtype, logits_dtype, group, vocab_start, vocab_size, reduce_grad_input, return_z_loss,
                    return_token_accuracy, keep_logits)
    scaling = _scaling(scale, scaling)
    grad_needs = GradNeeds(*needs)
    kept = _kept_logits_buffer(opts, hidden, weight, labels, reduction == "none" and grad_needs.any())
    head, rows, backend, shard = _linear_call(opts, hidden, weight, bias, low_rank_input, low_rank_weight, labels,
                                              kept)
    class_weight = _class_weight(class_weight, weight)

    if reduction == "none":  # per-token grad_output is unknown until backward: keep lse, recompute then
        plan = make_plan(opts, backend, shard, rows, head, class_weight=class_weight,
                         kept_logits="store" if kept.numel() else None)
        step = run_chunks(plan, head, rows, LossStep(plan, hidden.device)).step
        per_token = _scatter_rows(step.loss, rows, labels.numel()).view(labels.shape)
        lse = _scatter_rows(step.lse, rows, labels.numel()) if grad_needs.any() else _empty(per_token)
        extras = _extras(opts, step, rows, labels, 1.0)
        return (per_token, lse, *extras, *(_empty(hidden) for _ in range(5)), kept)

    if class_weight is not None:  # the mean divides by the targets' summed weights, as F.cross_entropy
        weight_sum = float(class_weight[rows.target].sum()) if rows.count else 0.0
        denominator = weight_sum if reduction == "mean" else 1.0
        # ... and the (unweighted) z-loss by the token count, as Liger: its gradient coefficient follows
        z_denominator = float(max(rows.count, 1)) if reduction == "mean" else 1.0
        grad_z_loss = opts.z_loss * denominator / z_denominator if denominator else 0.0
    else:
        denominator = mean_denominator(rows.count, num_items) if reduction == "mean" else 1.0
        z_denominator, grad_z_loss = denominator, None
    plan = make_plan(opts, backend, shard, rows, head, needs=grad_needs, grad_scale=scaling / denominator,
                     class_weight=class_weight, grad_z_loss=grad_z_loss)
    out = run_chunks(plan, head, rows, LossStep(plan, hidden.device))
    step = out.step
    z_terms = opts.z_loss * step.lse * step.lse if opts.z_loss > 0 else None
    if z_terms is not None and z_denominator != denominator:  # the z-loss's own denominator
        loss = (step.loss - z_terms).sum() / denominator + z_terms.sum() / z_denominator
    else:
        loss = step.loss.sum() / denominator
    inputs = (hidden, weight, bias, low_rank_input, low_rank_weight)
    extras = _extras(opts, step, rows, labels, z_denominator)
    return (loss, _empty(loss), *extras, *(_shaped_like(g, x, hidden) for g, x in zip(out.grads[0], inputs)), kept)


def _kept_logits_buffer(opts: LossOptions, hidden: Tensor, weight: Tensor, labels: Tensor, recomputes: bool) -> Tensor:
    """Where forward keeps the logits for backward (``keep_logits`` where backward would recompute them): one
    row per token (the kept rows first; the shape must not depend on the data), this shard's vocabulary, the
    logits dtype; else (0,). The fake implementations call this too."""
    if not (opts.keep_logits and recomputes):
        return _empty(hidden)
    return hidden.new_empty((labels.numel(), weight.shape[0]), dtype=opts.logits_dtype or hidden.dtype)


def _class_weight(class_weight: Tensor | None, weight: Tensor) -> Tensor | None:
    """The class weights as the kernels read them: (V,) fp32, contiguous, on the weight's device."""
    if class_weight is None:
        return None
    if class_weight.shape != (weight.shape[0],):
        raise ValueError(f"class_weight must have one weight per class: shape ({weight.shape[0]},), got "
                         f"{tuple(class_weight.shape)}")
    return class_weight.to(device=weight.device, dtype=torch.float32).contiguous()


def _extras(opts: LossOptions, step: LossStep, rows, labels: Tensor, z_denominator: float) -> tuple[Tensor, Tensor]:
    """(z_loss, token_accuracy) reduced like the loss (detached: for logging), (0,) when not asked for. The
    accuracy is the fraction of tokens with a loss whose label is the argmax (per token: 0 or 1)."""
    n = labels.numel()
    reduce = opts.reduction
    z_value, accuracy = _empty(step.lse), _empty(step.lse)
    if opts.return_z_loss:
        z_terms = opts.z_loss * step.lse * step.lse
        if reduce == "none":
            z_value = _scatter_rows(z_terms, rows, n).view(labels.shape)
        else:
            z_value = z_terms.sum() / (z_denominator if reduce == "mean" else 1.0)
    if opts.return_token_accuracy:
        correct = (step.argmax == rows.target).float()
        if reduce == "none":
            accuracy = _scatter_rows(correct, rows, n).view(labels.shape)
        else:
            accuracy = correct.sum() / (max(rows.count, 1) if reduce == "mean" else 1.0)
    return z_value, accuracy


def _linear_call(opts, hidden, weight, bias, low_rank_input, low_rank_weight, labels, kept_logits=None):
    """(head, rows, backend, shard) of a call on hidden states: the inputs as (N, .) rows, the kept rows;
    ``kept_logits`` (from ``_kept_logits_buffer``; (0,): none) the head writes or reads as its plan says."""
    labels = label_ids(labels)
    n = labels.numel()  # not -1: hidden may have 0 columns (the logits are then the bias, as in F.linear)
    low_rank = None
    if low_rank_input is not None:
        low_rank = (low_rank_input.reshape(n, low_rank_input.shape[-1]), low_rank_weight)
    backend = get_backend(hidden.device)
    shard = distributed.Shard.of(weight, labels, opts)
    rows = select_rows(labels, opts.ignore_index, shard, backend)
    kept_logits = kept_logits if kept_logits is not None and kept_logits.numel() else None
    return LinearHead(hidden.reshape(n, hidden.shape[-1]), weight, bias, low_rank, kept_logits), rows, backend, shard


def _shaped_like(grad: Tensor | None, like: Tensor | None, empty_like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """A gradient of the chunk loop in its input's shape (contiguous; rounded to ``dtype`` if given), or (0,)
    when not asked for."""
    if grad is None:
        return _empty(empty_like)
    return grad.view(like.shape) if dtype is None else grad.view(like.shape).to(dtype)


@linear_cross_entropy.register_fake
def _(hidden, weight, bias, low_rank_input, low_rank_weight, labels, num_items, class_weight, scale, scaling, needs,
      *options):
    reduction = options[1]
    loss = hidden.new_empty(labels.shape if reduction == "none" else (), dtype=torch.float32)
    lse = hidden.new_empty((labels.numel(),) if reduction == "none" and any(needs) else (0,), dtype=torch.float32)
    extras = [hidden.new_empty(loss.shape if asked else (0,), dtype=torch.float32) for asked in options[-2:]]
    inputs = (hidden, weight, bias, low_rank_input, low_rank_weight)
    opts = _options(*options)
    dtypes = grad_dtypes(opts, hidden.device, hidden, weight, bias, low_rank_weight, labels.numel(),
                         distributed.Shard.chunk_vocab_of(weight, opts), backend_name(hidden.device))
    grads = [
        x.new_empty(x.shape, dtype=dtype) if need and reduction != "none" else hidden.new_empty((0,))
        for need, x, dtype in zip(needs, inputs, dtypes)
    ]
    kept = _kept_logits_buffer(opts, hidden, weight, labels, reduction == "none" and any(needs))
    return (loss, lse, *extras, *grads, kept)


def _scatter_rows(values: Tensor, rows, n: int) -> Tensor:
    """(rows.count,) values of the kept rows -> (n,), zero at ignored positions."""
    if rows.index is None:
        return values
    return values.new_zeros(n).index_copy_(0, rows.index, values)


@torch.library.custom_op("fused_lm_loss::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    low_rank_input: Optional[Tensor],
    low_rank_weight: Optional[Tensor],
    labels: Tensor,
    class_weight: Optional[Tensor],
    lse: Tensor,
    kept_logits: Tensor,
    grad_per_token: Tensor,
    needs: Sequence[bool],
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    softcap: Optional[float],
    logit_scale: float,
    chunk_size: Optional[int],
    accum_dtype: Optional[torch.dtype],
    logits_dtype: Optional[torch.dtype],
    group: Optional[str],
    vocab_start: Optional[int],
    vocab_size: Optional[int],
    reduce_grad_input: bool,
    return_z_loss: bool,
    return_token_accuracy: bool,
    keep_logits: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of sum_i grad_per_token[i] * loss_i (reduction="none"; grad_per_token shaped like labels),
    from the forward's lse and its kept logits, or (``kept_logits`` (0,)) recomputing the logits chunk by chunk
    from the saved inputs; (0,) where not needed."""
    opts = _options(ignore_index, reduction, label_smoothing, z_loss, softcap, logit_scale, chunk_size,
                    accum_dtype, logits_dtype, group, vocab_start, vocab_size, reduce_grad_input, False, False,
                    keep_logits)
    head, rows, backend, shard = _linear_call(opts, hidden, weight, bias, low_rank_input, low_rank_weight, labels,
                                              kept_logits)
    plan = make_plan(opts, backend, shard, rows, head, needs=GradNeeds(*needs),
                     class_weight=_class_weight(class_weight, weight), vocab_tiles=True,
                     kept_logits="reuse" if kept_logits.numel() else None)
    row_scale = _kept(grad_per_token.reshape(-1).float(), rows)
    out = run_chunks(plan, head, rows, LossStep(plan, hidden.device, lse=_kept(lse, rows), row_scale=row_scale))
    inputs = (hidden, weight, bias, low_rank_input, low_rank_weight)
    return tuple(_shaped_like(g, x, hidden, x.dtype if x is not None else None) for g, x in zip(out.grads[0], inputs))


@linear_cross_entropy_backward.register_fake
def _(hidden, weight, bias, low_rank_input, low_rank_weight, labels, class_weight, lse, kept_logits, grad_per_token,
      needs, *options):
    inputs = (hidden, weight, bias, low_rank_input, low_rank_weight)
    return tuple(x.new_empty(x.shape) if need else hidden.new_empty((0,)) for need, x in zip(needs, inputs))


def _kept(per_token: Tensor, rows) -> Tensor:
    """(N,) per-token values -> (rows.count,) contiguous values of the kept rows."""
    return (per_token if rows.index is None else per_token[rows.index]).contiguous()


# ---- fused_lm_loss::logits_cross_entropy ---------------------------------------------------------------


@torch.library.custom_op("fused_lm_loss::logits_cross_entropy", mutates_args=())
def logits_cross_entropy(
    logits: Tensor,
    labels: Tensor,
    num_items: Optional[Tensor],
    need_grad: bool,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    chunk_size: Optional[int],
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, lse, d logits) of CE(logits, labels) for logits (..., V) that already carry the model's softcap
    / scale; the same outputs and rules as ``linear_cross_entropy`` (d logits in the logits' dtype)."""
    opts = LossOptions(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                       z_loss=z_loss, chunk_size=chunk_size)
    head, rows, backend, shard = _logits_call(opts, logits, labels)
    if reduction == "none":
        plan = make_plan(opts, backend, shard, rows, head)
        out = run_chunks(plan, head, rows, LossStep(plan, logits.device)).step
        lse = _scatter_rows(out.lse, rows, labels.numel()) if need_grad else _empty(out.loss)
        return _scatter_rows(out.loss, rows, labels.numel()).view(labels.shape), lse, _empty(logits)
    denominator = mean_denominator(rows.count, num_items) if reduction == "mean" else 1.0
    plan = make_plan(opts, backend, shard, rows, head,
                     needs=GradNeeds(hidden=need_grad), grad_scale=1.0 / denominator)
    out = run_chunks(plan, head, rows, LossStep(plan, logits.device))
    return out.step.loss.sum() / denominator, _empty(logits), _shaped_like(out.grads[0][0], logits, logits)


def _logits_call(opts, logits, labels):
    """(head, rows, backend, shard) of a call on given logits."""
    labels = label_ids(labels)
    vocab = logits.shape[-1]
    backend = get_backend(logits.device)
    shard = distributed.Shard.whole(vocab)
    rows = select_rows(labels, opts.ignore_index, shard, backend)
    return GivenLogits(logits.reshape(labels.numel(), vocab)), rows, backend, shard


@logits_cross_entropy.register_fake
def _(logits, labels, num_items, need_grad, ignore_index, reduction, *options):
    loss = logits.new_empty(labels.shape if reduction == "none" else (), dtype=torch.float32)
    lse = logits.new_empty((labels.numel(),) if reduction == "none" and need_grad else (0,), dtype=torch.float32)
    grad = logits.new_empty(logits.shape) if need_grad and reduction != "none" else logits.new_empty((0,))
    return loss, lse, grad


@torch.library.custom_op("fused_lm_loss::logits_cross_entropy_backward", mutates_args=())
def logits_cross_entropy_backward(
    logits: Tensor,
    labels: Tensor,
    lse: Tensor,
    grad_per_token: Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    chunk_size: Optional[int],
) -> Tensor:
    """d(sum_i grad_per_token[i] * loss_i) / d logits (reduction="none")."""
    opts = LossOptions(ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing,
                       z_loss=z_loss, chunk_size=chunk_size)
    head, rows, backend, shard = _logits_call(opts, logits, labels)
    plan = make_plan(opts, backend, shard, rows, head,
                     needs=GradNeeds(hidden=True))
    row_scale = _kept(grad_per_token.reshape(-1).float(), rows)
    out = run_chunks(plan, head, rows, LossStep(plan, logits.device, lse=_kept(lse, rows), row_scale=row_scale))
    return out.grads[0][0].view(logits.shape)


@logits_cross_entropy_backward.register_fake
def _(logits, labels, lse, grad_per_token, *options):
    return logits.new_empty(logits.shape)


# ---- fused_lm_loss::rescale_grads and the autograd rules -----------------------------------------------


@torch.library.custom_op("fused_lm_loss::rescale_grads", mutates_args=())
def rescale_grads(grads: Sequence[Tensor], grad_output: Tensor, scale: Optional[Tensor], scaling: float) -> List[Tensor]:
    """Each gradient made in forward times grad_output / scaling, as new tensors of its dtype (compiled
    backward; the caller rounds them to the inputs' dtypes)."""
    factor = grad_factor(grad_output, _scaling(scale, scaling))
    return [g * factor for g in grads]


@rescale_grads.register_fake
def _(grads, grad_output, scale, scaling):
    return [torch.empty_like(g) for g in grads]


def _traced(t: Tensor | None) -> bool:
    """Whether this runs while torch.compile traces (AOTAutograd traces backward with fake tensors; torch 2.5
    does not report that through ``torch.compiler.is_compiling``)."""
    return torch.compiler.is_compiling() or (t is not None and (isinstance(t, FunctionalTensor) or is_fake(t)))


def _rescaled(grads: list[Tensor], dtypes: list[torch.dtype], grad_output: Tensor, scale: Tensor | None,
              scaling: float) -> list[Tensor]:
    """grad_output / scaling applied out of place, each result rounded once to its ``dtypes`` entry (the
    input's dtype); in eager mode a factor of exactly 1.0 returns the gradients kept in that dtype as they are."""
    if _traced(grad_output):
        return [g.to(dtype) for g, dtype in zip(rescale_grads(grads, grad_output, scale, scaling), dtypes)]
    return _apply_factor(grads, dtypes, grad_factor(grad_output, _scaling(scale, scaling)))


def _apply_factor(grads: list[Tensor], dtypes: list[torch.dtype], factor: float) -> list[Tensor]:
    """Eager: each gradient times ``factor``, out of place, rounded once to its ``dtypes`` entry; a factor of
    exactly 1.0 returns the gradients already in that dtype as they are."""
    if factor == 1.0:
        return [g if g.dtype == dtype else g.to(dtype) for g, dtype in zip(grads, dtypes)]
    return [torch.mul(g, factor, out=g.new_empty(g.shape, dtype=dtype)) for g, dtype in zip(grads, dtypes)]


def _refuse_double_backward(grad_output: Tensor | None) -> None:
    # backward runs with grad mode on only for create_graph=True; tracing a compiled backward is not that
    if torch.is_grad_enabled() and not _traced(grad_output):
        raise RuntimeError(
            "fused_lm_loss does not support higher-order gradients: its backward only rescales gradients made in "
            "forward, so a gradient of its gradient would be silently wrong. Call autograd.grad / backward without "
            "create_graph=True, or compute this loss with F.cross_entropy on the logits."
        )


def _setup_linear(ctx, inputs, output) -> None:
    hidden, weight, bias, low_rank_input, low_rank_weight, labels, _, class_weight, scale, scaling, needs, *options = (
        inputs
    )
    loss, lse, z_value, accuracy, *grads, kept = output
    ctx.needs, ctx.options = tuple(needs), tuple(options)
    ctx.dtypes = tuple(None if x is None else x.dtype for x in (hidden, weight, bias, low_rank_input, low_rank_weight))
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse, z_value, accuracy, *grads, kept)
    if options[1] == "none":
        ctx.save_for_backward(hidden, weight, bias, low_rank_input, low_rank_weight, labels, class_weight, lse, kept)
    else:
        ctx.scaling = scaling
        _keep_grads(ctx, grads, scale)


def _keep_grads(ctx, grads: list[Tensor], *also_saved: Tensor | None) -> None:
    """Save the gradients made in forward for backward, after ``also_saved`` (which backward reads too).

    Through ``save_for_backward``, so that the engine releases them as soon as backward has run (unless
    retain_graph): ``param.grad`` then adopts the returned tensor instead of copying it. Under retain_graph
    they stay saved, the engine sees a second owner and copies into ``param.grad``, so a second backward never
    accumulates into a saved gradient.
    """
    ctx.save_for_backward(*also_saved, *grads)


def _backward_linear(ctx, grad_loss, *unused):
    _refuse_double_backward(grad_loss)
    nothing = (None,) * (6 + _OPTION_COUNT)  # labels, num_items, class_weight, scale, scaling, needs; the options
    if grad_loss is None or not any(ctx.needs):
        return (None,) * 5 + nothing
    if ctx.options[1] == "none":
        grads = linear_cross_entropy_backward(*ctx.saved_tensors, grad_loss, list(ctx.needs), *ctx.options)
    else:
        saved = ctx.saved_tensors
        scale, grads = saved[0], saved[1:]
        kept = [g for g, need in zip(grads, ctx.needs) if need]
        dtypes = [dtype for dtype, need in zip(ctx.dtypes, ctx.needs) if need]
        rescaled = iter(_rescaled(kept, dtypes, grad_loss, scale, ctx.scaling))
        grads = [next(rescaled) if need else None for need in ctx.needs]
    return (*(g if need else None for g, need in zip(grads, ctx.needs)), *nothing)


linear_cross_entropy.register_autograd(_backward_linear, setup_context=_setup_linear)


def _setup_logits(ctx, inputs, output) -> None:
    logits, labels, _, need_grad, ignore_index, reduction, label_smoothing, z_loss, chunk_size = inputs
    loss, lse, grad = output
    ctx.need_grad, ctx.reduction = need_grad, reduction
    ctx.options = (ignore_index, label_smoothing, z_loss, chunk_size)
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse, grad)
    if reduction == "none":
        ctx.save_for_backward(logits, labels, lse)
    else:
        _keep_grads(ctx, [grad])


def _backward_logits(ctx, grad_loss, *unused):
    _refuse_double_backward(grad_loss)
    nothing = (None,) * 8
    if grad_loss is None or not ctx.need_grad:
        return (None, *nothing)
    if ctx.reduction == "none":
        return (logits_cross_entropy_backward(*ctx.saved_tensors, grad_loss, *ctx.options), *nothing)
    (grad,) = ctx.saved_tensors
    return (_rescaled([grad], [grad.dtype], grad_loss, None, 1.0)[0], *nothing)


logits_cross_entropy.register_autograd(_backward_logits, setup_context=_setup_logits)
