"""fused_lm_loss: the language-model loss (lm_head matmul + cross-entropy) without the full logits.

    from fused_lm_loss import FusedLMLoss, fused_linear_cross_entropy
    loss = FusedLMLoss()(hidden, lm_head.weight, labels)

    model = fused_lm_loss.patch(model)     # a Hugging Face causal LM (or peft model) trains with it

    out = fused_lm_loss.token_stats(hidden, lm_head.weight, labels)   # per-token logprobs, entropy, ... (RL)
    loss = fused_lm_loss.fused_divergence(student_h, student_w, teacher_h, teacher_w, labels)   # distillation
"""
from .backends import use_backend
from .divergence import FusedDivergence, fused_divergence
from .integrations import patch, unpatch
from .loss import FusedLMLoss, LossOutput, fused_linear_cross_entropy
from .per_token import TokenStats, token_stats

__all__ = ["FusedDivergence", "FusedLMLoss", "LossOutput", "TokenStats", "fused_divergence",
           "fused_linear_cross_entropy", "patch", "token_stats", "unpatch", "use_backend"]
__version__ = "0.1.0"
