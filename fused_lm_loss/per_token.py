"""Per-token outputs of the lm_head softmax without the logits: the label's log-probability, the entropy, the
log-sum-exp, whether the label is the top-1 token, and the argmax, with gradients for any per-token weights.

    z = softcap(logit_scale * (h @ W.T + b + u @ B.T)) / temperature          (per token, fp32)
    logprob = z[y] - lse(z)      entropy = lse(z) - sum_j softmax(z)_j z_j      is_top1 = argmax(z) == y

``logprobs`` and ``entropy`` are differentiable: backward receives per-token weights a (for logprobs) and b
(for entropy) and the gradient is that of ``sum_i a_i logprob_i + b_i entropy_i``. How it is made depends on
what can be done in forward, where the weights are still unknown (``expected_grads`` says what to expect; it
changes the cost, never the result):

- frozen lm_head (only the hidden states or a LoRA input need gradients): each kept row's gradient is
  formed in forward (dX_logprob, and dX_entropy with "logprobs_and_entropy"), and backward weights it per
  row on the device: no recompute, no host sync. An entropy weight that was not expected is recomputed.
- trainable lm_head, "uniform" (SFT: the mean negative log-likelihood): the gradients of that mean are
  made in forward as the loss makes them; backward checks (one host sync) that a is uniform over the kept
  rows and b is absent or zero there, and rescales; otherwise it recomputes.
- trainable lm_head otherwise (RL: per-token advantages): backward recomputes the logits, chunk by chunk or
  over tiles of the vocabulary (plan.vocab_tiling: it knows each row's lse from forward); with
  ``keep_logits`` forward keeps them (N x V in the matmul dtype) and backward reads them: one matmul fewer.

The logprob component made in forward is the gradient of the mean negative log-probability over the kept
rows (per-row weight ``mean_nll_weight(count)`` = -1/count in fp32, returned by the forward operator), the
weight an SFT loss ``-logprobs.sum() / count`` (or ``.mean()`` over the kept tokens) sends back: in eager
mode that backward returns the saved gradients untouched, as the loss does for grad_output = 1; any other
uniform weight is one multiply (the loss's grad_output / scaling). The entropy component has weight 1.

Ignored positions (label == ignore_index) give 0 (logprobs, entropy, lse), False (is_top1) and -1 (argmax).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from . import distributed
from .chunked import TokenStep, label_ids, run_chunks
from .loss import _check_low_rank, _check_tensors, _matmul_inputs
from .ops import (_apply_factor, _empty, _kept, _kept_logits_buffer, _linear_call, _refuse_double_backward,
                  _scatter_rows, _shaped_like, _traced)
from .options import LossOptions, _check_real
from .plan import GradNeeds, grad_dtypes, make_plan
from .backends import backend_name

EXPECTED_GRADS = ("logprobs", "logprobs_and_entropy", "uniform")


class TokenStats(NamedTuple):
    """Per-token outputs, each shaped like the labels."""

    logprobs: Tensor  # fp32, log p(label); differentiable
    entropy: Tensor  # fp32, entropy of the softmax; differentiable
    lse: Tensor  # fp32, log-sum-exp of z
    is_top1: Tensor  # bool, argmax == label (the first maximum on ties, as torch.argmax)
    argmax: Tensor  # int64, the top-1 token (-1 at ignored positions)


def token_stats(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    low_rank: tuple[Tensor, Tensor] | None = None,
    expected_grads: str = "logprobs",
    keep_logits: bool = False,
) -> TokenStats:
    """Per-token log-probabilities, entropy, lse, top-1 and argmax of ``hidden @ weight.T (+ bias)``, chunked.

    Args:
        hidden (..., H), weight (V, H), labels shaped like ``hidden.shape[:-1]`` (already shifted), bias (V,).
        ignore_index: labels with this value give no output (0) and no gradient.
        temperature: divides the (scaled, softcapped) logits, as sampling does.
        logit_scale, softcap: the model's transforms of the lm_head output (see FusedLMLoss).
        chunk_size: at most this many rows per chunk (default: by memory, as FusedLMLoss).
        low_rank: ``(u, B)`` adds ``u @ B.T`` to the logits (LoRA on lm_head; see FusedLMLoss).
        expected_grads: "logprobs" (per-token weights on the log-probabilities, e.g. RL advantages),
            "logprobs_and_entropy" (also an entropy term), or "uniform" (the mean of the log-probabilities over
            the kept tokens, e.g. SFT): what backward will most likely receive; any other gradient is still
            exact, at the cost of a recompute.
        keep_logits: with a trainable lm_head and expected_grads "logprobs" / "logprobs_and_entropy" (where
            backward recomputes the logits), keep them from forward instead: one matmul fewer, for N x V values
            in the matmul dtype held until backward (see FusedLMLoss). Elsewhere nothing is kept.

    Example::

        out = token_stats(hidden, model.lm_head.weight, labels, temperature=0.7)
        loss = -(advantages * out.logprobs).sum() / mask.sum() - 0.01 * out.entropy.mean()
        loss.backward()
    """
    if expected_grads not in EXPECTED_GRADS:
        raise ValueError(f"expected_grads must be one of {EXPECTED_GRADS}, got {expected_grads!r}")
    _check_real("temperature", temperature)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    opts = _options(ignore_index, logit_scale, softcap, chunk_size, keep_logits)
    _check_tensors(hidden, weight, labels, bias)
    if low_rank is not None:
        _check_low_rank(low_rank, hidden, weight)
    tensors = _matmul_inputs(hidden, weight, bias, *(low_rank or (None, None)))
    grad_mode = torch.is_grad_enabled()
    needs = [grad_mode and t is not None and t.requires_grad for t in tensors]
    vocab_side = needs[1] or needs[2] or needs[4]
    precompute_logprob = any(needs) and (not vocab_side or expected_grads == "uniform")
    precompute_entropy = any(needs) and not vocab_side and expected_grads == "logprobs_and_entropy"
    keep = opts.keep_logits and vocab_side and not precompute_logprob  # (where backward recomputes)
    # softcap(s x) / T = (c / T) tanh((s / T) x / (c / T)): a temperature is a scale and a softcap
    scale = float(opts.logit_scale) / temperature
    cap = None if opts.softcap is None else float(opts.softcap) / temperature
    logprobs, entropy, lse, argmax = linear_token_stats(
        *tensors, labels, needs, precompute_logprob, precompute_entropy, keep, opts.ignore_index, scale, cap,
        opts.chunk_size,
    )[:4]
    ids = label_ids(labels).view(labels.shape)  # (as int64: a uint8 label 156 compared with -100 would match it)
    is_top1 = (argmax == ids) & (ids != opts.ignore_index)
    return TokenStats(logprobs, entropy, lse, is_top1, argmax)


def mean_nll_weight(count: int) -> float:
    """-1 / count rounded to fp32: the per-row weight of the logprob gradients made in forward (the gradient
    of -sum(logprobs) / count, as autograd forms it in fp32)."""
    return float(torch.tensor(-1.0, dtype=torch.float32) / max(count, 1))


def _weighted_rows(grad: Tensor, per_token: Tensor, made_with: Tensor | float, kept: Tensor) -> Tensor:
    """A per-token input's gradient made in forward with the weight ``made_with`` on every row, reweighted to
    ``per_token`` (shaped like the labels): 0 at ignored positions (``kept`` False) whatever their weight, as
    autograd gives for outputs that are constants there."""
    return grad * torch.where(kept, per_token.float() / made_with, 0.0).unsqueeze(-1)


def _options(ignore_index: int, logit_scale: float, softcap: float | None, chunk_size: int | None,
             keep_logits: bool = False) -> LossOptions:
    return LossOptions(ignore_index=ignore_index, logit_scale=logit_scale, softcap=softcap, chunk_size=chunk_size,
                       keep_logits=keep_logits)


@torch.library.custom_op("fused_lm_loss::linear_token_stats", mutates_args=())
def linear_token_stats(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    low_rank_input: Optional[Tensor],
    low_rank_weight: Optional[Tensor],
    labels: Tensor,
    needs: Sequence[bool],
    precompute_logprob: bool,
    precompute_entropy: bool,
    keep_logits: bool,
    ignore_index: int,
    logit_scale: float,
    softcap: Optional[float],
    chunk_size: Optional[int],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
           Tensor, Tensor, Tensor]:
    """(logprobs, entropy, lse, argmax, the logprob component's weight (a () fp32 tensor), then for each of the
    logprob and entropy components the gradients w.r.t. (hidden, weight, bias, u, B) of the sum of its output
    over kept tokens, weighted by -1/count (logprob) or 1 (entropy), then the kept logits), per-token outputs
    shaped like labels; a component's gradients are made only when it is precomputed and ``needs`` asks, the
    logits (N, V) kept for backward only with ``keep_logits`` (ops._kept_logits_buffer), else (0,)."""
    opts = _options(ignore_index, logit_scale, softcap, chunk_size, keep_logits)
    kept = _kept_logits_buffer(opts, hidden, weight, labels, recomputes=True)  # (token_stats asks only then)
    head, rows, backend, shard = _linear_call(opts, hidden, weight, bias, low_rank_input, low_rank_weight, labels,
                                              kept)
    components = ("logprob",) * precompute_logprob + ("entropy",) * precompute_entropy
    plan = make_plan(opts, backend, shard, rows, head, needs=GradNeeds(*needs) if components else GradNeeds(),
                     components=len(components), epilogue_stats=False,
                     kept_logits="store" if kept.numel() else None)
    unit = mean_nll_weight(rows.count)
    step = TokenStep(plan, hidden.device, need_argmax=True, components=components, logprob_weight=unit)
    out = run_chunks(plan, head, rows, step)
    step, n, shape = out.step, labels.numel(), labels.shape
    per_token = [_scatter_rows(v, rows, n).view(shape) for v in (step.logprob, step.entropy, step.lse)]
    argmax = _scatter_rows(step.argmax + 1, rows, n).view(shape) - 1  # -1 at ignored positions
    inputs = (hidden, weight, bias, low_rank_input, low_rank_weight)
    grads = {name: out.grads[k] for k, name in enumerate(components)}
    sets = [
        [_shaped_like(g, x, hidden) for g, x in zip(grads[name], inputs)] if name in grads else
        [_empty(hidden) for _ in inputs]
        for name in ("logprob", "entropy")
    ]
    # (torch.full, not torch.tensor: a host-to-device copy would wait for the whole forward on CUDA)
    unit_tensor = torch.full((), unit, dtype=torch.float32, device=hidden.device)
    return (*per_token, argmax, unit_tensor, *sets[0], *sets[1], kept)


@linear_token_stats.register_fake
def _(hidden, weight, bias, low_rank_input, low_rank_weight, labels, needs, precompute_logprob, precompute_entropy,
      keep_logits, ignore_index, logit_scale, softcap, chunk_size):
    shape = labels.shape
    outputs = [hidden.new_empty(shape, dtype=torch.float32) for _ in range(3)]
    outputs.append(hidden.new_empty(shape, dtype=torch.int64))
    outputs.append(hidden.new_empty((), dtype=torch.float32))
    inputs = (hidden, weight, bias, low_rank_input, low_rank_weight)
    opts = _options(ignore_index, logit_scale, softcap, chunk_size, keep_logits)
    dtypes = grad_dtypes(opts, hidden.device, hidden, weight, bias, low_rank_weight, labels.numel(),
                         distributed.Shard.chunk_vocab_of(weight, opts), backend_name(hidden.device))
    for precomputed in (precompute_logprob, precompute_entropy):
        outputs += [
            x.new_empty(x.shape, dtype=dtype) if precomputed and need else hidden.new_empty((0,))
            for need, x, dtype in zip(needs, inputs, dtypes)
        ]
    outputs.append(_kept_logits_buffer(opts, hidden, weight, labels, recomputes=True))
    return tuple(outputs)


@torch.library.custom_op("fused_lm_loss::linear_token_stats_backward", mutates_args=())
def linear_token_stats_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    low_rank_input: Optional[Tensor],
    low_rank_weight: Optional[Tensor],
    labels: Tensor,
    lse: Tensor,
    entropy: Tensor,
    logprob_unit: Tensor,
    kept_logits: Tensor,
    grad_logprobs: Optional[Tensor],
    grad_entropy: Optional[Tensor],
    logprob_grads: Sequence[Tensor],
    entropy_grads: Sequence[Tensor],
    needs: Sequence[bool],
    ignore_index: int,
    logit_scale: float,
    softcap: Optional[float],
    chunk_size: Optional[int],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """d(sum_i a_i logprob_i + b_i entropy_i) / d(hidden, weight, bias, u, B), in the inputs' dtypes, from the
    components made in forward (``logprob_grads`` / ``entropy_grads``: per input, or (0,)) where they serve,
    recomputing the rest from the logits kept in forward (``kept_logits``), or else from the inputs (see the
    module docstring)."""
    opts = _options(ignore_index, logit_scale, softcap, chunk_size)
    head, rows, backend, shard = _linear_call(opts, hidden, weight, bias, low_rank_input, low_rank_weight, labels,
                                              kept_logits)
    inputs = (hidden, weight, bias, low_rank_input, low_rank_weight)
    row_inputs, vocab_inputs = (0, 3), (1, 2, 4)
    a = None if grad_logprobs is None else _kept(grad_logprobs.reshape(-1).float(), rows)
    b = None if grad_entropy is None else _kept(grad_entropy.reshape(-1).float(), rows)
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
        plan = make_plan(opts, backend, shard, rows, head, needs=sub, epilogue_stats=False, vocab_tiles=True,
                         kept_logits="reuse" if kept_logits.numel() else None)
        step = TokenStep(plan, hidden.device, weights=(wa, wb), lse=_kept(lse.reshape(-1), rows),
                         entropy=_kept(entropy.reshape(-1), rows))
        for i, g in enumerate(run_chunks(plan, head, rows, step).grads[0]):
            if g is not None:
                add(i, g.view(inputs[i].shape))

    vocab_side = any(needs[i] for i in vocab_inputs)
    # (checked only where it decides something: a host sync)
    uniform = vocab_side and has_lp and b is None and rows.count > 0 and bool(a.min() == a.max())
    vocab_from_forward = vocab_side and uniform
    if vocab_side and not vocab_from_forward:
        recompute(a, b, range(5))  # the vocabulary side needs the logits again: recompute it all
    else:
        unit = float(logprob_unit)  # the logprob component's weight in forward (the entropy one's: 1)
        kept = label_ids(labels).view(labels.shape) != ignore_index
        components = ((a, grad_logprobs, logprob_grads, has_lp, unit), (b, grad_entropy, entropy_grads, has_h, 1.0))
        for weights, per_token, grads, precomputed, made_with in components:
            if weights is None:
                continue
            if not precomputed:
                recompute(*((weights, None) if grads is logprob_grads else (None, weights)), row_inputs)
                continue
            for i in row_inputs:
                if needs[i]:
                    add(i, _weighted_rows(grads[i], per_token, made_with, kept))
            if grads is logprob_grads and vocab_from_forward:
                for i in vocab_inputs:
                    if needs[i]:
                        add(i, grads[i] * (a[0] / unit))
    return tuple(
        _empty(hidden) if g is None or not need else g.to(x.dtype) for g, x, need in zip(total, inputs, needs)
    )


@linear_token_stats_backward.register_fake
def _(hidden, weight, bias, low_rank_input, low_rank_weight, labels, lse, entropy, logprob_unit, kept_logits,
      grad_logprobs, grad_entropy, logprob_grads, entropy_grads, needs, *options):
    inputs = (hidden, weight, bias, low_rank_input, low_rank_weight)
    return tuple(x.new_empty(x.shape) if need else hidden.new_empty((0,)) for need, x in zip(needs, inputs))


def _setup(ctx, inputs, output) -> None:
    hidden, weight, bias, u, b, labels, needs, _, _, _, *options = inputs
    logprobs, entropy, lse, argmax, unit, *grads, kept = output
    ctx.needs, ctx.options = tuple(needs), tuple(options)
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse, argmax, unit, kept, *grads)
    ctx.save_for_backward(hidden, weight, bias, u, b, labels, lse, entropy, unit, kept, *grads)


def _backward(ctx, grad_logprobs, grad_entropy, *unused):
    _refuse_double_backward(grad_logprobs if grad_logprobs is not None else grad_entropy)
    nothing = (None,) * 9  # labels, needs, the precompute and keep flags, the options
    if (grad_logprobs is None and grad_entropy is None) or not any(ctx.needs):
        return (None,) * 5 + nothing
    hidden, weight, bias, u, b, labels, lse, entropy, unit, kept, *grads = ctx.saved_tensors
    inputs, logprob_grads, entropy_grads = (hidden, weight, bias, u, b), grads[:5], grads[5:]
    has_lp, has_h = (any(g.numel() for g in component) for component in (logprob_grads, entropy_grads))
    rows_only = not any(ctx.needs[i] for i in (1, 2, 4))
    if rows_only and (grad_logprobs is None or has_lp) and (grad_entropy is None or has_h):
        # frozen head: every needed gradient made in forward, weighted per row; no host sync, no recompute
        kept = label_ids(labels).view(labels.shape) != ctx.options[0]
        components = [(logprob_grads, grad_logprobs, unit), (entropy_grads, grad_entropy, 1.0)]
        result = []
        for i, (x, need) in enumerate(zip(inputs, ctx.needs)):
            total = None
            for grads, per_token, made_with in components:
                if need and per_token is not None:
                    term = _weighted_rows(grads[i], per_token, made_with, kept)
                    total = term if total is None else total + term
            result.append(None if total is None else total.to(x.dtype))
        return (*result, *nothing)
    if not _traced(grad_logprobs) and has_lp:
        factor = _uniform_factor(labels, ctx.options[0], unit, grad_logprobs, grad_entropy)
        if factor is not None:  # the logprob gradients made in forward serve, rescaled (eager: as the loss's)
            kept = [(g, x.dtype) for g, x, need in zip(logprob_grads, inputs, ctx.needs) if need]
            rescaled = iter(_apply_factor([g for g, _ in kept], [dtype for _, dtype in kept], factor))
            return (*(next(rescaled) if need else None for need in ctx.needs), *nothing)
    result = linear_token_stats_backward(
        hidden, weight, bias, u, b, labels, lse, entropy, unit, kept, grad_logprobs, grad_entropy, logprob_grads,
        entropy_grads, list(ctx.needs), *ctx.options,
    )
    return (*(g if need else None for g, need in zip(result, ctx.needs)), *nothing)


def _uniform_factor(labels: Tensor, ignore_index: int, unit: Tensor, grad_logprobs: Tensor | None,
                    grad_entropy: Tensor | None) -> float | None:
    """a / unit (the logprob component's weight in forward) when the logprob weight a is one value over the
    kept rows and the entropy weight is absent or zero there; else None. One host sync."""
    if grad_logprobs is None:
        return None
    kept = label_ids(labels) != ignore_index
    a = grad_logprobs.reshape(-1).float()
    parts = [unit, torch.where(kept, a, float("inf")).amin(), torch.where(kept, a, float("-inf")).amax()]
    if grad_entropy is not None:
        parts.append(torch.where(kept, grad_entropy.reshape(-1).float().abs(), 0.0).amax())
    made_with, lowest, highest, *entropy_weight = torch.stack(parts).tolist()
    if lowest != highest or any(w != 0 for w in entropy_weight):
        return None  # (no kept row: inf != -inf; NaN weights land here too, and propagate through the custom op)
    return lowest / made_with


linear_token_stats.register_autograd(_backward, setup_context=_setup)

__all__ = ["EXPECTED_GRADS", "TokenStats", "token_stats"]
