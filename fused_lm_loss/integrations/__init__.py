"""Framework integrations, one file per concern.

    hf_patch.py    patch / unpatch a Hugging Face causal LM (or a peft model around one)
    hf_forward.py  one patched training forward (lm_head computes the loss, the model's logit ops checked)
    hf_config.py   what a model's forward does to its logits, read from its config
    hf_loss.py     transformers' loss signature on given logits (eval forwards of a patched model)
    hf_assign.py   ``model.loss_function = FusedLMLoss(...)`` takes effect (a hook installed lazily)
    peft.py        peft layers on lm_head (LoRA as a low-rank term, modules_to_save)
    wrappers.py    the model inside peft / DDP / DataParallel wrappers
"""
from __future__ import annotations

from . import hf_assign  # noqa: F401  (arms the loss_function hook for the first FusedLMLoss)
from .hf_loss import causal_lm_loss
from .hf_patch import is_patched, patch, unpatch

__all__ = ["causal_lm_loss", "is_patched", "patch", "unpatch"]
