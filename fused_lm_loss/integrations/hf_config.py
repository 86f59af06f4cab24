"""What a Hugging Face model's forward does to its lm_head output, read from its config."""
from __future__ import annotations

from torch import nn


def model_options(model: nn.Module) -> dict:
    """softcap and logit scale that this model's forward applies to the lm_head output."""
    config = model.config
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:  # Cohere: logits * logit_scale
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:  # Granite: logits / logits_scaling
        scale /= float(config.logits_scaling)
    softcap = getattr(config, "final_logit_softcapping", None)  # Gemma 2 / 3
    return {"softcap": None if softcap is None else float(softcap), "logit_scale": scale}


