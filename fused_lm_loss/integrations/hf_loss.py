"""transformers' loss signature on logits that already exist: ``loss_function(logits, labels, vocab_size, **kw)``.

A patched model computes its training loss from the hidden states (``hf_patch``). Where transformers calls
its ``loss_function`` with logits it made (an eval forward of a model whose ``loss_function`` is a
``FusedLMLoss``), this computes ``ForCausalLMLoss`` with that loss's options, on the same chunk loop
(``loss.logits_loss``): no fp32 copy of the logits.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.nn import functional as F

from ..loss import logits_loss
from ..options import LossOptions


def causal_lm_loss(
    opts: LossOptions,
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    *,
    num_items_in_batch: Any = None,
    ignore_index: int | None = None,
    shift_labels: torch.Tensor | None = None,
    **unused: Any,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` with the options of a FusedLMLoss.

    The logits already went through the model's softcap / scale, so ``opts.softcap`` and
    ``opts.logit_scale`` are not applied again; the temperature, label smoothing, z-loss and the reduction are.

    Example::

        loss = causal_lm_loss(FusedLMLoss(label_smoothing=0.1).options, out.logits, labels, model.config.vocab_size)
    """
    if logits.shape[-1] != vocab_size:
        raise ValueError(f"logits have {logits.shape[-1]} classes but vocab_size={vocab_size}")
    if ignore_index is not None:
        opts = dataclasses.replace(opts, ignore_index=ignore_index)
    targets = shifted_labels(labels, shift_labels, opts.ignore_index).to(logits.device)
    return logits_loss(logits, targets, opts, num_items_in_batch=num_items_in_batch)


def shifted_labels(labels: torch.Tensor, shift_labels: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """transformers' ForCausalLMLoss targets: ``shift_labels`` if given, else labels shifted left by one."""
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
