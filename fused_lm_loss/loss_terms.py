"""The loss of one token from its softmax statistics: one value object (``LossTerms``) and one formula
(``loss_from_stats``), shared by both backends, the vocab-parallel merge and the matmul-epilogue path.

With z the loss-space logits (``transform.py``) of a row over the whole vocabulary of V classes, lse their
log-sum-exp, t the target and eps the label smoothing::

    loss = (1 - eps) * (lse - z_t) + eps * (lse - sum_j z_j / V) + z_loss * lse**2

and with class weights w (``F.cross_entropy(weight=...)``, combined with smoothing as PyTorch does), w_t the
target's weight and W = sum_j w_j::

    loss = (1 - eps) * w_t * (lse - z_t) + (eps / V) * (W * lse - sum_j w_j z_j) + z_loss * lse**2
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class LossTerms:
    """The terms of the per-token loss, besides the cross-entropy itself."""

    label_smoothing: float = 0.0
    z_loss: float = 0.0
    vocab_size: int = 1  # V: classes of the whole vocabulary (every vocab shard)
    class_weight: torch.Tensor | None = None  # (V_shard,) fp32 on the device, or None

    @property
    def smooths(self) -> bool:
        """Whether the loss needs the (weighted) sum of each row's logits."""
        return self.label_smoothing > 0

    @property
    def smoothing_per_class(self) -> float:
        return float(self.label_smoothing) / self.vocab_size

    def with_z_loss(self, z_loss: float) -> "LossTerms":
        return replace(self, z_loss=z_loss)


def loss_from_stats(
    row_max: torch.Tensor,
    row_sumexp: torch.Tensor,
    target_logit: torch.Tensor,
    logit_sum: torch.Tensor,
    terms: LossTerms,
    target_weight: torch.Tensor | None = None,
    weight_sum: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and lse (fp32) from row statistics over the whole vocabulary (module docstring); with class
    weights ``target_weight`` = w_t per row and ``weight_sum`` = W, and ``logit_sum`` the weighted sum_j w_j z_j."""
    lse = row_max + torch.log(row_sumexp)
    eps = terms.label_smoothing
    if target_weight is None:
        loss = lse - (1.0 - eps) * target_logit
        if terms.smooths:
            loss -= terms.smoothing_per_class * logit_sum
    else:
        loss = (1.0 - eps) * target_weight * (lse - target_logit)
        if terms.smooths:
            loss += terms.smoothing_per_class * (weight_sum * lse - logit_sum)
    if terms.z_loss > 0:
        loss += terms.z_loss * lse * lse
    return loss, lse
