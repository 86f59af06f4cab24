"""Per-token outputs of the lm_head softmax without the logits: the label's log-probability, the entropy, the
log-sum-exp, whether the label is the top-1 token, and the argmax, with gradients for any per-token weights.

    z = softcap(logit_scale * (h @ W.T + b + u @ B.T)) / temperature          (per token, fp32)
    logprob = z[y] - lse(z)      entropy = lse(z) - sum_j softmax(z)_j z_j      is_top1 = argmax(z) == y
    and, when asked for (``extra_outputs``, detached, as TRL's fused head gives them to DPO and KTO):
    mean_logits = sum_j z_j / V      log_sum_sq_probs = log sum_j softmax(z)_j^2

``logprobs`` and ``entropy`` are differentiable: backward receives per-token weights a (for logprobs) and b
(for entropy) and the gradient is that of ``sum_i a_i logprob_i + b_i entropy_i``. How it is made depends on
what can be done in forward, where the weights are still unknown (``expected_grads`` says what to expect; it
changes the cost, never the result):

- frozen lm_head (only the hidden states or a LoRA input need gradients): each selected row's gradient is
  formed in forward (dX_logprob, and dX_entropy with "logprobs_and_entropy"), and backward weights it per
  row on the device: no recompute, no host sync. An entropy weight that was not expected is recomputed.
- trainable lm_head, "uniform" (SFT: the mean negative log-likelihood): the gradients of that mean are
  made in forward as the loss makes them; backward checks (one host sync) that a is uniform over the selected
  rows and b is absent or zero there, and rescales; otherwise it recomputes. Not in fp16: there backward
  recomputes (G = p / count, formed before backward brings a GradScaler's scale, would sink into fp16's
  subnormals).
- trainable lm_head otherwise (RL: per-token advantages): backward recomputes the logits, chunk by chunk or
  over tiles of the vocabulary (plan.vocab_tiling: it knows each row's lse from forward); with
  ``keep_logits`` forward keeps them (N x V in the matmul dtype) and backward reads them: one matmul fewer.

The logprob component made in forward is the gradient of the mean negative log-probability over the selected
rows (per-row weight ``mean_nll_weight(count)`` = -1/count in fp32, returned by the forward operator), the
weight an SFT loss ``-logprobs.sum() / count`` (or ``.mean()`` over the tokens with a label) sends back: in eager
mode that backward returns the saved gradients untouched, as the loss does for grad_output = 1; any other
uniform weight is one multiply (the loss's grad_output / scaling). The entropy component has weight 1. A frozen
head in fp16 makes the logprob component with weight -1 instead (``token_ops.component_weight``), for the same
reason.

Ignored positions (label == ignore_index) give 0 (logprobs, entropy, lse, mean_logits, log_sum_sq_probs), False
(is_top1) and -1 (argmax).
The operators are in ``token_ops.py``.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

import torch
from torch import Tensor

from .inputs import linear_inputs
from .options import LossOptions, check_supported
from .token_ops import EXPECTED_GRADS, linear_token_stats


class TokenStats(NamedTuple):
    """Per-token outputs, each shaped like the labels."""

    logprobs: Tensor  # fp32, log p(label); differentiable
    entropy: Tensor  # fp32, entropy of the softmax; differentiable
    lse: Tensor  # fp32, log-sum-exp of z; detached: no gradient flows through it (a z-loss: FusedLMLoss(z_loss=))
    is_top1: Tensor  # bool, argmax == label (the first maximum on ties, as torch.argmax)
    argmax: Tensor  # int64, the top-1 token (-1 at ignored positions)
    mean_logits: Tensor | None = None  # fp32, the mean of z over the vocabulary; only when asked for, detached
    log_sum_sq_probs: Tensor | None = None  # fp32, log sum_j p_j^2; only when asked for, detached


EXTRA_OUTPUTS = ("mean_logits", "log_sum_sq_probs")


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
    accum_dtype: torch.dtype | None = torch.float32,
    low_rank: tuple[Tensor, Tensor] | None = None,
    expected_grads: str = "logprobs",
    keep_logits: bool = False,
    extra_outputs: Sequence[str] = (),
) -> TokenStats:
    """Per-token log-probabilities, entropy, lse, top-1 and argmax of ``hidden @ weight.T (+ bias)``, chunked.

    Args:
        hidden (..., H), weight (V, H), labels shaped like ``hidden.shape[:-1]`` (already shifted), bias (V,).
        ignore_index: labels with this value give no output (0) and no gradient.
        temperature: divides the (scaled, softcapped) logits, as sampling does.
        logit_scale, softcap: the model's transforms of the lm_head output (see FusedLMLoss).
        chunk_size: at most this many rows per chunk (default: by memory, as FusedLMLoss).
        accum_dtype: dtype of the lm_head weight-gradient accumulator (as FusedLMLoss).
        low_rank: ``(u, B)`` adds ``u @ B.T`` to the logits (LoRA on lm_head; see FusedLMLoss).
        expected_grads: "logprobs" (per-token weights on the log-probabilities, e.g. RL advantages),
            "logprobs_and_entropy" (also an entropy term), or "uniform" (the mean of the log-probabilities over
            the tokens with a label, e.g. SFT): what backward will most likely receive; any other gradient is
            still exact, at the cost of a recompute.
        keep_logits: with a trainable lm_head and expected_grads "logprobs" / "logprobs_and_entropy" (where
            backward recomputes the logits), keep them from forward instead: one matmul fewer, for N x V values
            in the matmul dtype held until backward (see FusedLMLoss). Elsewhere nothing is kept.
        extra_outputs: any of "mean_logits" and "log_sum_sq_probs" (``TokenStats`` fields, None unless asked
            for): computed in the same pass over each chunk's logits, without gradient.

    Example::

        out = token_stats(hidden, model.lm_head.weight, labels, temperature=0.7,
                          expected_grads="logprobs_and_entropy")
        n = (labels != -100).sum()                         # ignored positions give 0: divide by the kept ones
        loss = -(advantages * out.logprobs).sum() / n - 0.01 * out.entropy.sum() / n
        loss.backward()
    """
    opts = LossOptions(ignore_index=ignore_index, temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                       chunk_size=chunk_size, accum_dtype=accum_dtype, keep_logits=keep_logits)
    return token_stats_with(opts, hidden, weight, labels, bias, low_rank=low_rank, expected_grads=expected_grads,
                            extra_outputs=extra_outputs)


def token_stats_with(
    opts: LossOptions,
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    *,
    low_rank: tuple[Tensor, Tensor] | None = None,
    expected_grads: str = "logprobs",
    extra_outputs: Sequence[str] = (),
    where: str = "token_stats",
    owner: str = "",
) -> TokenStats:
    """``token_stats`` with options that were made elsewhere (a patched model's, for TRL's head): those that
    ``where`` (a key of ``options.UNSUPPORTED``) cannot honour raise, naming ``owner``."""
    if expected_grads not in EXPECTED_GRADS:
        raise ValueError(f"expected_grads must be one of {EXPECTED_GRADS}, got {expected_grads!r}")
    # (read once into a tuple: an iterator would be empty by the time the outputs are asked for)
    names = None if isinstance(extra_outputs, str) or not isinstance(extra_outputs, Iterable) else tuple(extra_outputs)
    if names is None or any(name not in EXTRA_OUTPUTS for name in names):
        raise ValueError(f"extra_outputs must be a sequence of names among {EXTRA_OUTPUTS}, got {extra_outputs!r}")
    check_supported(opts, where, owner)
    tensors, needs = linear_inputs(hidden, weight, labels, bias, low_rank)
    asked = [name in names for name in EXTRA_OUTPUTS]
    logprobs, entropy, lse, argmax, is_top1, mean_logits, log_sum_sq_probs = linear_token_stats(
        *tensors, labels, needs, expected_grads, *asked, opts=opts)[:7]
    return TokenStats(logprobs, entropy, lse, is_top1, argmax, mean_logits if asked[0] else None,
                      log_sum_sq_probs if asked[1] else None)


__all__ = ["EXPECTED_GRADS", "EXTRA_OUTPUTS", "TokenStats", "token_stats"]
