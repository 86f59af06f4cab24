"""fused_lm_loss: the language-model loss (lm_head matmul + cross-entropy) without the full logits.

    from fused_lm_loss import FusedLMLoss, fused_linear_cross_entropy
    loss = FusedLMLoss()(hidden, lm_head.weight, labels)
"""
from .chunked import use_backend
from .loss import FusedLMLoss, fused_linear_cross_entropy

__all__ = ["FusedLMLoss", "fused_linear_cross_entropy", "use_backend"]
__version__ = "0.1.0"
