"""fused_lm_loss: the language-model loss (lm_head matmul + cross-entropy) without the full logits.

    from fused_lm_loss import FusedLMLoss, fused_linear_cross_entropy
    loss = FusedLMLoss()(hidden, lm_head.weight, labels)

    model = fused_lm_loss.patch(model)     # a Hugging Face causal LM (or peft model) trains with it
"""
from .backends import use_backend
from .integrations import patch, unpatch
from .loss import FusedLMLoss, fused_linear_cross_entropy

__all__ = ["FusedLMLoss", "fused_linear_cross_entropy", "patch", "unpatch", "use_backend"]
__version__ = "0.1.0"
