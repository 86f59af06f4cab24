"""One patched training forward: lm_head computes the fused loss and returns a probe, loss_function
returns that loss after checking what the model did to the probe (see ``hf_patch``)."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from ..loss import lm_loss
from ..options import LossOptions
from ..transform import LogitTransform
from . import peft as peft_integration
from .hf_loss import shifted_labels

_PROBE_VALUES = (-1024.0, -48.0, -3.0, 0.75, 6.0, 256.0)


class FusedCall:
    """State of one patched training forward: lm_head computes the loss, loss_function returns it."""

    def __init__(self, model: nn.Module, head: nn.Module, opts: LossOptions, labels: torch.Tensor, kwargs: dict):
        self.model, self.head, self.labels, self.kwargs = model, head, labels, kwargs
        if kwargs.get("ignore_index") is not None:
            opts = dataclasses.replace(opts, ignore_index=kwargs["ignore_index"])
        self.opts = opts
        self.loss: torch.Tensor | None = None
        self.vocab = 0
        self.probe: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None  # what the model passed to loss_function

    def head_forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        name = type(self.model).__name__
        if args or kwargs:
            raise TypeError(f"fused_lm_loss: {name} calls its lm_head with extra arguments; not supported")
        if self.loss is not None:
            raise RuntimeError(f"fused_lm_loss: {name} calls its lm_head twice in one forward; not supported")
        weight, bias, low_rank = peft_integration.head_pieces(self.head, x)
        labels = shifted_labels(self.labels, self.kwargs.get("shift_labels"), self.opts.ignore_index)
        labels = labels.reshape(-1).to(x.device)
        hidden = x.reshape(-1, x.shape[-1])
        if hidden.shape[0] != labels.shape[0]:
            raise ValueError(
                f"{name}: {hidden.shape[0]} positions have hidden states (logits_to_keep?) but there are "
                f"{labels.shape[0]} labels; as in transformers, they must match"
            )
        if low_rank is not None:
            low_rank = (low_rank[0].reshape(hidden.shape[0], -1), low_rank[1])
        self.loss = lm_loss(
            hidden, weight, labels, bias, self.opts,
            num_items_in_batch=self.kwargs.get("num_items_in_batch"), low_rank=low_rank,
        )
        self.vocab = weight.shape[0]
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else weight.dtype
        row = torch.tensor(_PROBE_VALUES, dtype=dtype, device=x.device)
        self.probe = row.expand(*x.shape[:-1], len(_PROBE_VALUES)).contiguous()
        return self.probe

    def loss_function(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, **kwargs: Any) -> torch.Tensor:
        """Stands in for ``model.loss_function`` during the forward: returns (a copy of) the fused loss.

        The probe the model passes is kept for the check in ``finish`` and then filled with NaN: a forward that
        reads its logits after this (Bamba's z-loss) gets a NaN loss, which ``finish`` turns into an error.
        """
        name = type(self.model).__name__
        if self.loss is None:
            raise RuntimeError(f"fused_lm_loss: {name} called loss_function before its lm_head; not supported")
        if not _same_argument(labels, self.labels) or any(
            not _same_argument(kwargs.get(k), self.kwargs.get(k)) for k in _LOSS_KWARGS
        ):
            raise RuntimeError(
                f"fused_lm_loss: {name} changes the labels or loss arguments between its forward and "
                "loss_function; the fused loss cannot reproduce that"
            )
        # (a forward that passes its logits' width, as Inkling's, passes the probe's: the lm_head's rows unpatched)
        if vocab_size not in (self.vocab, len(_PROBE_VALUES)):
            raise RuntimeError(
                f"fused_lm_loss: {name}'s lm_head has {self.vocab} rows but its loss uses vocab_size={vocab_size}"
            )
        if not isinstance(logits, torch.Tensor) or logits.shape != self.probe.shape:
            raise RuntimeError(f"fused_lm_loss: {name} reshapes or replaces its logits before the loss; not supported")
        self.logits, self.transformed_probe = logits, logits.detach().clone()
        with torch.no_grad():
            logits.fill_(float("nan"))
        return self.loss * 1.0  # a new tensor: the model may add to it in place (MoE aux losses)

    def finish(self, outputs: Any) -> Any:
        """Check the forward went through lm_head and loss_function and did to the probe exactly what the
        fused loss's logit_scale / softcap do, and nothing after; drop the probe logits."""
        name = type(self.model).__name__
        if self.loss is None:  # a path that never projects: nothing was replaced
            return outputs
        if self.logits is None:
            raise RuntimeError(
                f"fused_lm_loss: {name}.forward did not pass its logits to self.loss_function; not supported"
            )
        if isinstance(outputs, tuple):
            loss, *rest = outputs
            return (self._checked(loss), *(o for o in rest if o is not self.logits))
        from transformers.utils import ModelOutput

        if isinstance(outputs, ModelOutput):
            fields = {k: v for k, v in outputs.items() if v is not self.logits}
            fields["loss"] = self._checked(fields["loss"])
            return type(outputs)(**fields)
        raise RuntimeError(f"fused_lm_loss: {name}.forward returned a {type(outputs).__name__}; not supported")

    def _checked(self, loss: torch.Tensor) -> torch.Tensor:
        # The checks read tensor values, so they run as an operator: under torch.compile it stays in the graph.
        return checked_model_loss(
            loss, self.loss, self.transformed_probe, self.opts.logit_scale, self.opts.softcap, type(self.model).__name__
        )


_LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")


def _same_argument(passed: Any, captured: Any) -> bool:
    """Whether the model passed loss_function what its forward was called with: the same object, or an equal
    copy (a forward wrapper such as accelerate's ``device_map`` hook moves the inputs to the execution device).
    The values are compared only when the objects differ: one host sync on that path alone."""
    if passed is captured:
        return True
    if not isinstance(passed, torch.Tensor) or not isinstance(captured, torch.Tensor):
        return type(passed) is type(captured) and isinstance(passed, (int, float)) and passed == captured
    if torch.compiler.is_compiling():  # (a value comparison would break the graph)
        return False
    return (passed.shape == captured.shape and passed.dtype == captured.dtype
            and torch.equal(passed.to(captured.device), captured))


@torch.library.custom_op("fused_lm_loss::checked_model_loss", mutates_args=())
def checked_model_loss(
    model_loss: torch.Tensor,
    fused_loss: torch.Tensor,
    transformed_probe: torch.Tensor,
    logit_scale: float,
    softcap: Optional[float],
    model_name: str,
) -> torch.Tensor:
    """``model_loss`` (a copy) after two checks of a patched training forward: the model's ops between lm_head
    and the loss made of the probe exactly what logit_scale / softcap make of it, and the model's loss is not
    NaN where the fused loss is finite (it read its NaN-filled logits after loss_function)."""
    model_part = LogitTransform(scale=logit_scale, softcap=softcap)  # (the temperature is the loss's, not the model's)
    expected, _ = model_part.apply(torch.tensor(_PROBE_VALUES, dtype=torch.float32, device=transformed_probe.device))
    rtol = max(4 * torch.finfo(transformed_probe.dtype).eps, 1e-5)
    observed = transformed_probe.reshape(-1, len(_PROBE_VALUES)).float()
    if not torch.allclose(observed, expected.expand_as(observed), rtol=rtol, atol=0.0):
        raise RuntimeError(
            f"fused_lm_loss: {model_name} transforms its lm_head output in a way that logit_scale={logit_scale}, "
            f"softcap={softcap} (read from its config at patch()) does not reproduce: the probe "
            f"{list(_PROBE_VALUES)} became "
            f"{[round(v, 4) for v in observed[0].tolist()]}, not {[round(v, 4) for v in expected.tolist()]}. If its "
            "config changed after patch() (e.g. final_logit_softcapping), unpatch and patch it again; otherwise this "
            "model is not supported by patch()"
        )
    if torch.isfinite(fused_loss).all() and not torch.isfinite(model_loss).all():
        raise RuntimeError(
            f"fused_lm_loss: {model_name}'s loss is not finite where the fused loss is: its forward uses its logits "
            "after self.loss_function (a patched model never computes them), or an auxiliary loss is not finite; "
            "this model is not supported by patch()"
        )
    return model_loss.clone()


@checked_model_loss.register_fake
def _(model_loss, fused_loss, transformed_probe, logit_scale, softcap, model_name):
    return torch.empty_like(model_loss)


checked_model_loss.register_autograd(
    lambda ctx, grad: (grad, None, None, None, None, None), setup_context=lambda ctx, inputs, output: None
)
