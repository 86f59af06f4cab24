"""What a Hugging Face model's forward does to its lm_head output, read from its config.

The forwards of transformers' causal LMs apply at most a logit scale and then a softcap between lm_head and
``self.loss_function``, each read from a config field: the model's own config, or for multimodal models
its text config (``config.get_text_config()``). The tables below name those fields, the few models whose
forward does not use a field their config has, and the forwards the fused loss cannot reproduce. The
probe check of the first training forward (``hf_forward``) verifies the result, so a model that does
something else is refused, never trained with a wrong loss.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

#: logits = softcap * tanh(logits / softcap): Gemma 2/3/4, PaliGemma 2 (text config); RecurrentGemma; xLSTM
SOFTCAP_FIELDS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
#: logits = logits * field, before the softcap: Cohere; Falcon-H1; Muse
MULTIPLIER_FIELDS = ("logit_scale", "lm_head_multiplier", "output_multiplier")
#: logits = logits / field: Granite (MiniCPM3's field of that name divides the hidden states instead)
DIVISOR_FIELDS = ("logits_scaling",)

#: Models whose forward multiplies by a field that DIVISOR_FIELDS names (HyperCLOVAX's muP ``logits_scaling``).
MULTIPLIED_BY: dict[str, str] = {
    "HyperCLOVAXForCausalLM": "logits_scaling",
    "HyperCLOVAXVisionV2ForConditionalGeneration": "logits_scaling",
}

#: Fields a model's config has but its forward does not apply to the logits.
IGNORED_FIELDS: dict[str, frozenset] = {
    "Gemma3ForConditionalGeneration": frozenset({"final_logit_softcapping"}),  # no softcap in its forward
    "MiniCPM3ForCausalLM": frozenset({"logits_scaling"}),  # divides the hidden states before lm_head
}


def _bamba(model: nn.Module) -> str | None:
    coefficient = getattr(model, "z_loss_coefficient", 0) or 0
    if coefficient:
        return (
            f"its z_loss_coefficient={coefficient} adds a z-loss of its logits after self.loss_function (the mean "
            "over every position, ignored ones included). Set it to 0 and pass FusedLMLoss(z_loss=...) for a "
            "z-loss over the tokens that carry a loss"
        )
    return None


#: Forwards that use their logits beyond what the fused loss reproduces: class name -> why (None: fine).
UNSUPPORTED: dict[str, Callable[[nn.Module], "str | None"]] = {"BambaForCausalLM": _bamba}


def model_options(model: nn.Module) -> dict:
    """softcap and logit scale that this model's forward applies to the lm_head output."""
    ignored = IGNORED_FIELDS.get(type(model).__name__, frozenset())
    configs = [model.config]
    get_text_config = getattr(model.config, "get_text_config", None)
    if callable(get_text_config) and get_text_config() is not model.config:
        configs.append(get_text_config())

    def field(name: str):
        if name in ignored:
            return None
        return next((getattr(c, name) for c in configs if getattr(c, name, None) is not None), None)

    scale = 1.0
    for name in MULTIPLIER_FIELDS:
        if field(name) is not None:
            scale *= float(field(name))
    for name in DIVISOR_FIELDS:
        if field(name) is not None:
            multiplies = MULTIPLIED_BY.get(type(model).__name__) == name
            scale = scale * float(field(name)) if multiplies else scale / float(field(name))
    softcap = next((float(field(name)) for name in SOFTCAP_FIELDS if field(name) is not None), None)
    return {"softcap": softcap, "logit_scale": scale}


def unsupported(model: nn.Module) -> str | None:
    """Why patch() refuses this model's forward (None: it may patch)."""
    check = UNSUPPORTED.get(type(model).__name__)
    return None if check is None else check(model)
