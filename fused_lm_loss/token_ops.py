"""The per-token outputs as PyTorch operators (``torch.library.custom_op``), beside the loss's (``ops.py``):

    fused_lm_loss::linear_token_stats           hidden states -> logprobs, entropy, lse, argmax, is_top1, (when
                                                asked) mean_logits and log_sum_sq_probs, and the gradient
                                                components made in forward
    fused_lm_loss::linear_token_stats_backward  the gradients for per-token weights that the forward's
                                                components cannot serve (recomputed), and their weighting

Both take their tensors and call values, then the options (``ops_common.fused_op``). Which gradient components
forward makes follows from which inputs need a gradient and ``expected_grads`` (``components``); the outputs'
shapes and dtypes from ``token_outputs``, shared by the fake and the real implementation. Ignored positions are
marked once, by the ``has_label`` output, which backward reads instead of comparing labels again.
See ``per_token.py`` for the API and what each ``expected_grads`` costs.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .chunked import KeptLogits, TokenStep, run_chunks
from .inputs import check_gathered_for_backward
from .ops_common import (
    Spec, absent, allocate, apply_factor, conform, fused_op, grad_specs, kept_logits_spec, linear_call, only_needed,
    per_token, refuse_double_backward, save_with_options, saved_with_options, shaped_like, shapes_only,
)
from .options import LossOptions
from .plan import GradNeeds, make_plan

F32 = torch.float32
ROW_INPUTS, VOCAB_INPUTS = (0, 3), (1, 2, 4)  # (hidden, u) have one row per token; (weight, bias, B) per class
EXPECTED_GRADS = ("logprobs", "logprobs_and_entropy", "uniform")


def components(needs: Sequence[bool], expected_grads: str, matmul_dtype: torch.dtype) -> tuple[str, ...]:
    """The gradient components forward makes: "logprob" (weight ``component_weight`` on every row) where backward
    can weight it per row (only row inputs need a gradient) or is expected to scale it uniformly, and "entropy"
    (weight 1) where an entropy weight is expected and only row inputs need a gradient.

    Not "uniform" in fp16: a trainable head's component is the mean's gradient, G = p / count rounded to fp16 before
    backward brings the loss's scale (a GradScaler's), and at large counts G sinks into fp16's subnormals (1e-2
    relative error at 8192 tokens); there backward recomputes with the weights it receives, as autograd would."""
    if not any(needs):
        return ()
    vocab_side = any(needs[i] for i in VOCAB_INPUTS)
    uniform = expected_grads == "uniform" and matmul_dtype != torch.float16
    made = ("logprob",) if not vocab_side or uniform else ()
    if not vocab_side and expected_grads == "logprobs_and_entropy":
        made += ("entropy",)
    return made


def mean_nll_weight(count: int) -> float:
    """-1 / count rounded to fp32: the per-row weight of the logprob gradients made in forward (the gradient
    of -sum(logprobs) / count, as autograd forms it in fp32)."""
    return float(torch.tensor(-1.0, dtype=F32) / max(count, 1))


def component_weight(count: int, matmul_dtype: torch.dtype) -> float:
    """The logprob component's per-row weight in forward: ``mean_nll_weight`` (backward then returns an SFT loss's
    gradients untouched), but -1 in fp16, where G = p / count would sink into fp16's subnormals at large counts.
    (In fp16 only a frozen head makes the component (``components``): it feeds only dX / du, one row each, no sum
    over rows that -1 could overflow, and backward weights each row anyway.)"""
    return -1.0 if matmul_dtype == torch.float16 else mean_nll_weight(count)


def token_outputs(opts: LossOptions, needs: Sequence[bool], expected_grads: str, need_mean_logits: bool,
                  need_log_sum_sq_probs: bool, hidden: Tensor, weight: Tensor, bias: Tensor | None,
                  low_rank_input: Tensor | None, low_rank_weight: Tensor | None, labels: Tensor) -> list[Spec]:
    """The outputs of ``linear_token_stats`` (its fake and real implementations both follow this)."""
    shape, made = tuple(labels.shape), components(needs, expected_grads, hidden.dtype)
    extra = [Spec(shape, F32) if asked else Spec((0,), F32) for asked in (need_mean_logits, need_log_sum_sq_probs)]
    inputs = (hidden, weight, bias, low_rank_input, low_rank_weight)
    recomputes = any(needs) and "logprob" not in made  # (a trainable head: backward recomputes the logits)
    return [
        Spec(shape, F32), Spec(shape, F32), Spec(shape, F32),  # logprobs, entropy, lse
        Spec(shape, torch.int64), Spec(shape, torch.bool),  # argmax, is_top1
        *extra,  # mean_logits, log_sum_sq_probs
        Spec(shape, torch.bool),  # has_label
        Spec((), F32),  # the logprob component's weight
        *grad_specs(opts, needs, "logprob" in made, inputs, labels),
        *grad_specs(opts, needs, "entropy" in made, inputs, labels),
        kept_logits_spec(opts, recomputes, hidden, weight, labels),
    ]


@fused_op("fused_lm_loss::linear_token_stats")
def linear_token_stats(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    low_rank_input: Optional[Tensor],
    low_rank_weight: Optional[Tensor],
    labels: Tensor,
    needs: Sequence[bool],
    expected_grads: str,
    need_mean_logits: bool,
    need_log_sum_sq_probs: bool,
    *,
    opts: LossOptions,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
           Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(logprobs, entropy, lse, argmax, is_top1, mean_logits, log_sum_sq_probs (both detached; (0,) unless asked
    for), has_label, the logprob component's weight (a () fp32 tensor), then
    for each of the logprob and entropy components the gradients w.r.t. (hidden, weight, bias, u, B) of the sum of
    its output over the selected rows, weighted by ``mean_nll_weight`` (logprob) or 1 (entropy), then the kept
    logits). Per-token outputs are shaped like labels (0, or -1 for argmax and False, at ignored positions); a
    component's gradients are made only where ``components`` says and ``needs`` asks, the logits (N, V) kept for
    backward only with ``keep_logits`` where backward recomputes; else (0,)."""
    inputs = (hidden, weight, bias, low_rank_input, low_rank_weight)
    asked = (need_mean_logits, need_log_sum_sq_probs)
    specs = token_outputs(opts, needs, expected_grads, *asked, *inputs, labels)
    device, kept_logits = hidden.device, allocate(specs[-1:], hidden.device)[0]
    made = components(needs, expected_grads, hidden.dtype)
    head, rows, backend, shard = linear_call(opts, *inputs, labels, KeptLogits.of(kept_logits, "store"), needs)
    plan = make_plan(opts, backend, shard, rows, head, needs=GradNeeds(*needs) if made else GradNeeds(),
                     components=len(made), epilogue_stats=False)
    unit = component_weight(rows.count, hidden.dtype)
    out = run_chunks(plan, head, rows, TokenStep(plan, device, need_argmax=True, need_mean_logit=asked[0],
                                                 need_log_sum_sq=asked[1], components=made, logprob_weight=unit))
    step = out.step
    outputs = [per_token(v, rows, labels) for v in (step.logprob, step.entropy, step.lse)]
    outputs.append(per_token(step.argmax + 1, rows, labels) - 1)  # -1 at ignored positions
    outputs.append(per_token(step.argmax == rows.target, rows, labels))
    outputs += [None if v is None else per_token(v, rows, labels) for v in (step.mean_logit, step.log_sum_sq)]
    outputs.append(rows.mask(device).view(labels.shape))
    # (torch.full, not torch.tensor: a host-to-device copy would wait for the whole forward on CUDA)
    outputs.append(torch.full((), unit, dtype=F32, device=device))
    grads = {name: out.grads[k] for k, name in enumerate(made)}
    for name in ("logprob", "entropy"):
        outputs += [shaped_like(g, x) for g, x in zip(grads[name], inputs)] if name in grads else [None] * 5
    return conform(specs, (*outputs, kept_logits), device)


@linear_token_stats.register_fake
def _(hidden, weight, bias, low_rank_input, low_rank_weight, labels, needs, expected_grads, need_mean_logits,
      need_log_sum_sq_probs, *, opts):
    specs = token_outputs(opts, needs, expected_grads, need_mean_logits, need_log_sum_sq_probs, hidden, weight, bias,
                          low_rank_input, low_rank_weight, labels)
    return allocate(specs, hidden.device)


def _backward_outputs(needs: Sequence[bool], inputs: Sequence[Tensor | None]) -> list[Spec]:
    return [Spec(tuple(x.shape), x.dtype) if need else absent(inputs[0]) for need, x in zip(needs, inputs)]


def _weighted_rows(grad: Tensor, per_token_weight: Tensor, made_with: Tensor | float, has_label: Tensor) -> Tensor:
    """A per-token input's gradient made in forward with the weight ``made_with`` on every row, reweighted to
    ``per_token_weight`` (shaped like the labels): 0 at ignored positions whatever their weight, as autograd gives
    for outputs that are constants there."""
    return grad * torch.where(has_label, per_token_weight.float() / made_with, 0.0).unsqueeze(-1)


@fused_op("fused_lm_loss::linear_token_stats_backward")
def linear_token_stats_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    low_rank_input: Optional[Tensor],
    low_rank_weight: Optional[Tensor],
    labels: Tensor,
    lse: Tensor,
    entropy: Tensor,
    has_label: Tensor,
    logprob_unit: Tensor,
    kept_logits: Tensor,
    grad_logprobs: Optional[Tensor],
    grad_entropy: Optional[Tensor],
    logprob_grads: Sequence[Tensor],
    entropy_grads: Sequence[Tensor],
    needs: Sequence[bool],
    *,
    opts: LossOptions,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """d(sum_i a_i logprob_i + b_i entropy_i) / d(hidden, weight, bias, u, B), in the inputs' dtypes, from the
    components made in forward (``logprob_grads`` / ``entropy_grads``: per input, or (0,)) where they serve,
    recomputing the rest from the logits kept in forward (``kept_logits``), or else from the inputs (see
    ``per_token.py``)."""
    inputs = (hidden, weight, bias, low_rank_input, low_rank_weight)
    head, rows, backend, shard = linear_call(opts, *inputs, labels, KeptLogits.of(kept_logits, "reuse"), needs)
    a = None if grad_logprobs is None else rows.take(grad_logprobs.reshape(-1).float())
    b = None if grad_entropy is None else rows.take(grad_entropy.reshape(-1).float())
    has_lp = any(g.numel() for g in logprob_grads)
    has_h = any(g.numel() for g in entropy_grads)
    if b is not None and not has_h and not bool((b != 0).any()):
        b = None  # a zero entropy weight contributes nothing
    total: list = [None] * 5

    def add(i: int, g: Tensor) -> None:
        total[i] = g if total[i] is None else total[i] + g

    def recompute(wa: Tensor | None, wb: Tensor | None, which: Sequence[int]) -> None:
        sub = GradNeeds(*(needs[i] and i in which for i in range(5)))
        if not sub.any() or (wa is None and wb is None):
            return
        plan = make_plan(opts, backend, shard, rows, head, needs=sub, epilogue_stats=False, vocab_tiles=True)
        step = TokenStep(plan, hidden.device, weights=(wa, wb), lse=rows.take(lse.reshape(-1)),
                         entropy=rows.take(entropy.reshape(-1)))
        for i, g in enumerate(run_chunks(plan, head, rows, step).grads[0]):
            if g is not None:
                add(i, g.view(inputs[i].shape))

    vocab_side = any(needs[i] for i in VOCAB_INPUTS)
    # (checked only where it decides something: a host sync)
    uniform = vocab_side and has_lp and a is not None and b is None and rows.count > 0 and bool(a.min() == a.max())
    vocab_from_forward = vocab_side and uniform
    if vocab_side and not vocab_from_forward:
        recompute(a, b, range(5))  # the vocabulary side needs the logits again: recompute it all
    else:
        unit = float(logprob_unit)  # the logprob component's weight in forward (the entropy one's: 1)
        parts = ((a, grad_logprobs, logprob_grads, has_lp, unit), (b, grad_entropy, entropy_grads, has_h, 1.0))
        for weights, per_token_weight, grads, precomputed, made_with in parts:
            if weights is None:
                continue
            if not precomputed:
                recompute(*((weights, None) if grads is logprob_grads else (None, weights)), ROW_INPUTS)
                continue
            for i in ROW_INPUTS:
                if needs[i]:
                    add(i, _weighted_rows(grads[i], per_token_weight, made_with, has_label))
            if grads is logprob_grads and vocab_from_forward:
                for i in VOCAB_INPUTS:
                    if needs[i]:
                        add(i, grads[i] * (a[0] / unit))
    grads = [None if g is None or not need else g.to(x.dtype) for g, x, need in zip(total, inputs, needs)]
    return conform(_backward_outputs(needs, inputs), grads, hidden.device)


@linear_token_stats_backward.register_fake
def _(hidden, weight, bias, low_rank_input, low_rank_weight, labels, lse, entropy, has_label, logprob_unit,
      kept_logits, grad_logprobs, grad_entropy, logprob_grads, entropy_grads, needs, *, opts):
    return allocate(_backward_outputs(needs, (hidden, weight, bias, low_rank_input, low_rank_weight)), hidden.device)


def _setup(ctx, inputs, opts, output) -> None:
    hidden, weight, bias, u, b, labels, needs = inputs[:7]
    logprobs, entropy, lse, argmax, is_top1, mean_logits, log_sum_sq_probs, has_label, unit, *grads, kept_logits = output
    ctx.needs = tuple(needs)
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse, argmax, is_top1, mean_logits, log_sum_sq_probs, has_label, unit, kept_logits,
                                *grads)
    save_with_options(ctx, opts, hidden, weight, bias, u, b, labels, lse, entropy, has_label, unit, kept_logits, *grads)


def _backward(ctx, grad_logprobs, grad_entropy, *unused):
    refuse_double_backward(grad_logprobs if grad_logprobs is not None else grad_entropy)
    call_values = (None,) * 5  # labels, needs, expected_grads, need_mean_logits, need_log_sum_sq_probs
    if (grad_logprobs is None and grad_entropy is None) or not any(ctx.needs):
        return (None,) * 5 + call_values
    saved, opts = saved_with_options(ctx)
    hidden, weight, bias, u, b, labels, lse, entropy, has_label, unit, kept_logits, *grads = saved
    inputs, logprob_grads, entropy_grads = (hidden, weight, bias, u, b), grads[:5], grads[5:]
    has_lp, has_h = (any(g.numel() for g in component) for component in (logprob_grads, entropy_grads))
    rows_only = not any(ctx.needs[i] for i in VOCAB_INPUTS)
    if rows_only and (grad_logprobs is None or has_lp) and (grad_entropy is None or has_h):
        # frozen head: every needed gradient made in forward, weighted per row; no host sync, no recompute
        parts = [(logprob_grads, grad_logprobs, unit), (entropy_grads, grad_entropy, 1.0)]
        result = []
        for i, (x, need) in enumerate(zip(inputs, ctx.needs)):
            total = None
            for component, per_token_weight, made_with in parts:
                if need and per_token_weight is not None:
                    term = _weighted_rows(component[i], per_token_weight, made_with, has_label)
                    total = term if total is None else total + term
            result.append(None if total is None else total.to(x.dtype))
        return (*result, *call_values)
    if not shapes_only(grad_logprobs) and has_lp:
        factor = _uniform_factor(has_label, unit, grad_logprobs, grad_entropy)
        if factor is not None:  # the logprob gradients made in forward serve, rescaled (eager: as the loss's)
            needed = [(g, x.dtype) for g, x, need in zip(logprob_grads, inputs, ctx.needs) if need]
            rescaled = iter(apply_factor([g for g, _ in needed], [dtype for _, dtype in needed], factor))
            return (*(next(rescaled) if need else None for need in ctx.needs), *call_values)
    check_gathered_for_backward(weight)
    result = linear_token_stats_backward(
        hidden, weight, bias, u, b, labels, lse, entropy, has_label, unit, kept_logits, grad_logprobs, grad_entropy,
        logprob_grads, entropy_grads, list(ctx.needs), opts=opts,
    )
    return (*only_needed(result, ctx.needs), *call_values)


def _uniform_factor(has_label: Tensor, unit: Tensor, grad_logprobs: Tensor | None,
                    grad_entropy: Tensor | None) -> float | None:
    """a / unit (the logprob component's weight in forward) when the logprob weight a is one value over the
    selected rows and the entropy weight is absent or zero there; else None. One host sync."""
    if grad_logprobs is None or has_label.numel() == 0:  # (no token: nothing to rescale, nor to reduce over)
        return None
    a = grad_logprobs.float()
    parts = [unit, torch.where(has_label, a, float("inf")).amin(), torch.where(has_label, a, float("-inf")).amax()]
    if grad_entropy is not None:
        parts.append(torch.where(has_label, grad_entropy.float().abs(), 0.0).amax())
    made_with, lowest, highest, *entropy_weight = torch.stack(parts).tolist()
    if lowest != highest or any(w != 0 for w in entropy_weight):
        return None  # (no selected row: inf != -inf; NaN weights land here too, and propagate through the custom op)
    return lowest / made_with


linear_token_stats.register_autograd(_backward, setup_context=_setup)
