"""Hugging Face causal LMs: ``patch`` / ``unpatch`` and the loss on already-materialized logits.

How a patched model trains (one mechanism for every ``*ForCausalLM`` whose forward is
"decoder -> last hidden state -> lm_head -> self.loss_function"):

1. ``model.forward`` (instance attribute) is wrapped. In training with labels it runs the original
   forward while ``lm_head.forward`` is temporarily replaced.
2. The replacement receives the hidden states (already sliced by ``logits_to_keep``) and computes
   the fused loss right there, inside the lm_head module call, from ``lm_head.weight`` (and the LoRA
   pieces when peft wraps lm_head): under FSDP2 with lm_head as its own unit, that is when the full
   weight exists. It returns a tiny probe tensor (6 logits per token) instead of the logits.
3. The model's family-specific logit ops (Gemma 2 softcap, Cohere ``* logit_scale``, Granite
   ``/ logits_scaling``) run on the probe for free; ``self.loss_function(...)`` then returns the
   precomputed loss after checking that the model transformed the probe exactly as the fused loss
   does (softcap and logit scale taken from the config), so a model that does something else to its
   logits gets an error instead of a wrong loss. MoE models add their router aux loss to it.
4. The output's ``logits`` is None (they were never computed).

In eval mode, without labels, or when ``model.loss_function`` is a callable other than a
``FusedLMLoss``, the original forward runs untouched.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from .. import chunked, distributed
from ..loss import FusedLMLoss, fused_lm_loss
from ..options import LossOptions

_STATE_ATTR = "_fused_lm_loss_patch"
_SWAPPED_CLASSES: dict[type, type] = {}
_PROBE_VALUES = (-1024.0, -48.0, -3.0, 0.75, 6.0, 256.0)


def patch(model: nn.Module, loss_fn: FusedLMLoss | None = None, *, grad_scaler: Any = None) -> nn.Module:
    """Make a Hugging Face causal LM (or a peft ``PeftModel`` around one) train with the fused loss.

    Instance-level: only this model changes, and :func:`unpatch` restores it. In training mode with
    ``labels``, the hidden states go straight to the fused loss and ``outputs.logits`` is ``None``;
    ``logits_to_keep``, ``shift_labels``, ``num_items_in_batch`` and every other keyword behave as in
    transformers. In eval mode, without labels, or during ``generate()``, the model is unchanged.

    Args:
        model: a ``*ForCausalLM`` (or a ``PeftModel``: its base model is patched).
        loss_fn: the loss to train with; None builds ``FusedLMLoss()``. The model's softcap
            (``final_logit_softcapping``) and logit scale (Cohere ``logit_scale``, Granite
            ``1 / logits_scaling``) always come from its config.
        grad_scaler: fp16 training: the ``torch.amp.GradScaler`` whose scale the fused gradients
            are stored with, used when ``loss_fn`` has none. With ``Trainer(fp16=True)``:
            ``patch(trainer.model, grad_scaler=trainer.accelerator.scaler)``.

    After patching, ``model.loss_function = FusedLMLoss(label_smoothing=0.1)`` reconfigures the loss
    (transformers alone would silently ignore an ``nn.Module`` assigned there); assigning any other
    callable makes the model compute logits and call it, as transformers does. With ``Trainer``, use
    ``FusedLMLoss(label_smoothing=...)`` rather than ``label_smoothing_factor`` (Trainer then withholds the
    labels from the model and smooths the full logits itself).

    Example::

        import fused_lm_loss
        model = AutoModelForCausalLM.from_pretrained("...")
        model = fused_lm_loss.patch(model)
        loss = model(input_ids=ids, labels=ids).loss      # fused; outputs.logits is None
        fused_lm_loss.unpatch(model)                       # back to the original forward
    """
    target = _causal_lm(model)
    if getattr(target, _STATE_ATTR, None) is not None:
        raise RuntimeError(f"{type(target).__name__} is already patched; call fused_lm_loss.unpatch(model) first")
    if loss_fn is not None and not isinstance(loss_fn, FusedLMLoss):
        raise TypeError(f"loss_fn must be a FusedLMLoss or None, got {type(loss_fn).__name__}")
    _check_structure(target)
    if "_loss_function" in vars(target) and loss_fn is None:
        raise ValueError(
            f"{type(target).__name__} already has a custom loss_function ({target._loss_function!r}); "
            "patching would replace it: pass loss_fn=FusedLMLoss(...) or remove it first"
        )
    state = _PatchState(
        model_options=_model_options(target),
        grad_scaler=grad_scaler,
        saved_forward=vars(target).get("forward"),
        original_class=type(target),
    )
    state.assign(target, loss_fn)
    object.__setattr__(target, _STATE_ATTR, state)
    object.__setattr__(target, "forward", _FusedForward(target, target.forward))
    target.__class__ = _swapped_class(type(target))
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch`: restore the original class, forward and loss_function of ``model``.

    Example::

        model = fused_lm_loss.patch(model)
        ...                                  # train
        fused_lm_loss.unpatch(model)         # generate / save exactly as before
    """
    target = _causal_lm(model)
    state = getattr(target, _STATE_ATTR, None)
    if state is None:
        raise RuntimeError(f"{type(target).__name__} is not patched by fused_lm_loss")
    target.__class__ = state.original_class
    del target.__dict__[_STATE_ATTR]
    if state.saved_forward is None:
        del target.__dict__["forward"]
    else:
        target.__dict__["forward"] = state.saved_forward
    # An assignment made while unpatched (see integrations.__init__) left the loss as a child module.
    for owner in {id(model): model, id(target): target}.values():
        if isinstance(owner._modules.get("loss_function"), FusedLMLoss):
            del owner._modules["loss_function"]
    return model


def is_patched(model: nn.Module) -> bool:
    """Whether ``model`` (or the model inside a PeftModel) is patched."""
    return getattr(_causal_lm(model), _STATE_ATTR, None) is not None


def assign_loss_function(model: nn.Module, loss_fn: FusedLMLoss) -> None:
    """``model.loss_function = FusedLMLoss(...)`` on an unpatched model: patch it with that loss."""
    target = _causal_lm(model)
    state = getattr(target, _STATE_ATTR, None)
    if state is None:
        patch(target, loss_fn)
    else:
        state.assign(target, loss_fn)


# ----------------------------------------------------------------------------------------------
# Patch state and the swapped class (its ``loss_function`` property and ``__setattr__``)


@dataclasses.dataclass
class _PatchState:
    model_options: dict  # softcap / logit_scale of this model's forward
    grad_scaler: Any
    saved_forward: Any  # the instance-level forward before patching (None: the class's)
    original_class: type
    user_loss: Any = None  # what was assigned to loss_function (None: the transformers default)
    fused_options: LossOptions | None = None  # the fused loss's options, None when not fusing
    call: "_FusedCall | None" = None  # the training forward in progress

    def assign(self, model: nn.Module, loss_fn: Any) -> None:
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_function must be callable, got {type(loss_fn).__name__}")
        user = FusedLMLoss() if loss_fn is None else loss_fn
        if isinstance(user, FusedLMLoss):
            self.fused_options = _merge_options(user.options, self.model_options, self.grad_scaler, model)
        else:
            self.fused_options = None
        self.user_loss = loss_fn
        model._modules.pop("loss_function", None)


def _merge_options(user: LossOptions, model_options: dict, grad_scaler: Any, model: nn.Module) -> LossOptions:
    """The user's options with the model's softcap / logit scale (which must not contradict them)."""
    for name, default in (("softcap", None), ("logit_scale", 1.0)):
        mine, theirs = getattr(user, name), model_options[name]
        if mine != default and mine != theirs:
            raise ValueError(
                f"{name}={mine} contradicts {type(model).__name__}, whose forward applies {name}={theirs}: "
                f"leave {name} unset, the patched model takes it from its config"
            )
    if user.process_group is not None:
        raise ValueError("patch() does not handle a vocab-parallel FusedLMLoss (process_group); use the core API")
    scaler = grad_scaler if user.grad_scaler is None else user.grad_scaler
    return dataclasses.replace(user, **model_options, grad_scaler=scaler)


def _loss_function_get(self: nn.Module) -> Any:
    state = self.__dict__[_STATE_ATTR]
    if state.call is not None:
        return state.call.loss_function
    if state.user_loss is not None:
        return state.user_loss
    return state.original_class.loss_function.__get__(self)


def _setattr(self: nn.Module, name: str, value: Any) -> None:
    if name == "loss_function":
        self.__dict__[_STATE_ATTR].assign(self, value)
    else:
        self.__dict__[_STATE_ATTR].original_class.__setattr__(self, name, value)


def _swapped_class(cls: type) -> type:
    """A subclass with the same name (so save_pretrained records the real architecture)."""
    if cls not in _SWAPPED_CLASSES:
        _SWAPPED_CLASSES[cls] = type(
            cls.__name__,
            (cls,),
            {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "loss_function": property(_loss_function_get),  # assignment goes through __setattr__
                "__setattr__": _setattr,
            },
        )
    return _SWAPPED_CLASSES[cls]


# ----------------------------------------------------------------------------------------------
# The forward wrapper


class _FusedForward:
    """``model.forward`` of a patched model. A callable object rather than a closure so that
    ``copy.deepcopy(model)`` gives a copy whose forward drives the copy, and with the original
    signature so that ``Trainer`` keeps the right dataset columns and passes ``num_items_in_batch``."""

    def __init__(self, model: nn.Module, inner: Callable) -> None:
        self.model, self.inner = model, inner
        self.__signature__ = inspect.signature(inner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        state = model.__dict__[_STATE_ATTR]
        if not model.training or state.fused_options is None:
            return self.inner(*args, **kwargs)
        try:
            bound = self.__signature__.bind(*args, **kwargs)
        except TypeError:
            return self.inner(*args, **kwargs)  # let the model report its own argument error
        params = self.__signature__.parameters
        extra = next((v for k, v in bound.arguments.items() if params[k].kind is inspect.Parameter.VAR_KEYWORD), {})
        labels = bound.arguments.get("labels", extra.get("labels"))
        if labels is None:
            return self.inner(*args, **kwargs)
        if state.call is not None:
            raise RuntimeError(f"{type(model).__name__}.forward re-entered during a fused-loss forward")

        head = model.get_output_embeddings()
        call = _FusedCall(model, head, state.fused_options, labels, extra)
        saved = head.__dict__.get("forward")
        state.call = call
        head.forward = call.head_forward  # instance attribute: hooks (FSDP2 unshard) still run around it
        try:
            outputs = self.inner(*args, **kwargs)
        finally:
            if saved is None:
                del head.forward
            else:
                head.forward = saved
            state.call = None
        return call.finish(outputs)


def _check_structure(model: nn.Module) -> None:
    name = type(model).__name__
    if not isinstance(inspect.getattr_static(type(model), "loss_function", None), property):
        raise TypeError(f"fused_lm_loss.patch: {name} is not a transformers PreTrainedModel with a loss_function")
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Module):
        raise TypeError(f"fused_lm_loss.patch: {name} has no output embeddings (lm_head); is it a *ForCausalLM?")
    code = getattr(inspect.unwrap(type(model).forward), "__code__", None)
    if code is not None and "loss_function" not in code.co_names:
        raise TypeError(
            f"fused_lm_loss.patch: {name}.forward does not compute its loss with self.loss_function, so the "
            "fused loss cannot replace it (supported: forwards of the form decoder -> lm_head -> loss_function)"
        )
    from . import peft as peft_integration

    peft_integration.check_head(head)


def _model_options(model: nn.Module) -> dict:
    """softcap and logit scale that this model's forward applies to the lm_head output."""
    config = model.config
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:  # Cohere: logits * logit_scale
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:  # Granite: logits / logits_scaling
        scale /= float(config.logits_scaling)
    softcap = getattr(config, "final_logit_softcapping", None)  # Gemma 2 / 3
    return {"softcap": None if softcap is None else float(softcap), "logit_scale": scale}


def _causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft PeftModel, or the model itself."""
    if hasattr(model, "get_base_model") and type(model).__module__.startswith("peft."):
        return model.get_base_model()
    return model


# ----------------------------------------------------------------------------------------------
# One training forward


class _FusedCall:
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
        from . import peft as peft_integration

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
        self.loss = fused_lm_loss(
            hidden, weight, labels, bias, self.opts,
            num_items_in_batch=self.kwargs.get("num_items_in_batch"), low_rank=low_rank,
        )
        self.vocab = weight.shape[0]
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else weight.dtype
        row = torch.tensor(_PROBE_VALUES, dtype=dtype, device=x.device)
        self.probe = row.expand(*x.shape[:-1], len(_PROBE_VALUES)).contiguous()
        return self.probe

    def loss_function(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, **kwargs: Any) -> torch.Tensor:
        """Stands in for ``model.loss_function`` during the forward: returns the fused loss."""
        name = type(self.model).__name__
        if self.loss is None:
            raise RuntimeError(f"fused_lm_loss: {name} called loss_function before its lm_head; not supported")
        if labels is not self.labels or any(kwargs.get(k) is not self.kwargs.get(k) for k in _LOSS_KWARGS):
            raise RuntimeError(
                f"fused_lm_loss: {name} changes the labels or loss arguments between its forward and "
                "loss_function; the fused loss cannot reproduce that"
            )
        if vocab_size != self.vocab:
            raise RuntimeError(
                f"fused_lm_loss: {name}'s lm_head has {self.vocab} rows but its loss uses vocab_size={vocab_size}"
            )
        self._check_logit_ops(logits)
        self.logits = logits
        return self.loss

    def _check_logit_ops(self, logits: torch.Tensor) -> None:
        """The model's ops between lm_head and the loss must be exactly the fused softcap / scale."""
        probe = self.probe
        if not isinstance(logits, torch.Tensor) or logits.shape != probe.shape:
            raise RuntimeError(
                f"fused_lm_loss: {type(self.model).__name__} reshapes or replaces its logits before the loss; "
                "not supported"
            )
        expected = probe.float() * self.opts.logit_scale
        if self.opts.softcap is not None:
            expected = torch.tanh(expected / self.opts.softcap) * self.opts.softcap
        rtol = max(4 * torch.finfo(logits.dtype).eps, 4 * torch.finfo(probe.dtype).eps, 1e-5)
        if not torch.allclose(logits.float(), expected, rtol=rtol, atol=0.0):
            raise RuntimeError(
                f"fused_lm_loss: {type(self.model).__name__} transforms its lm_head output in a way that "
                f"logit_scale={self.opts.logit_scale}, softcap={self.opts.softcap} (read from its config) does "
                "not reproduce; this model is not supported by patch()"
            )

    def finish(self, outputs: Any) -> Any:
        """Check the forward went through lm_head and loss_function; drop the probe logits."""
        name = type(self.model).__name__
        if self.loss is None:  # a path that never projects (e.g. TRL's own fused head): nothing was replaced
            return outputs
        if self.logits is None:
            raise RuntimeError(
                f"fused_lm_loss: {name}.forward did not pass its logits to self.loss_function; not supported"
            )
        if isinstance(outputs, tuple):
            return tuple(o for o in outputs if o is not self.logits)
        from transformers.utils import ModelOutput

        if isinstance(outputs, ModelOutput):
            fields = {k: v for k, v in outputs.items() if v is not self.logits}
            return type(outputs)(**fields)
        raise RuntimeError(f"fused_lm_loss: {name}.forward returned a {type(outputs).__name__}; not supported")


_LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")


def shifted_labels(labels: torch.Tensor, shift_labels: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """transformers' ForCausalLMLoss targets: ``shift_labels`` if given, else labels shifted left by one."""
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


# ----------------------------------------------------------------------------------------------
# FusedLMLoss called with transformers' loss signature (logits already materialized)


def loss_from_logits(
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
    """transformers' ``ForCausalLMLoss`` with the options of a FusedLMLoss, without an fp32 logits copy.

    The logits already went through the model's softcap / scale, so ``opts.softcap`` and
    ``opts.logit_scale`` are not applied again; label smoothing, z-loss and the reduction are.
    Rows are processed in chunks (fp32 only per chunk); the gradient is made in backward, in the
    logits' dtype.
    """
    if opts.process_group is not None:
        raise ValueError("a vocab-parallel FusedLMLoss (process_group) needs hidden states, not logits")
    if opts.reduction != "mean" and num_items_in_batch is not None:
        raise ValueError(f"num_items_in_batch divides the loss and needs reduction='mean', not {opts.reduction!r}")
    if ignore_index is not None:
        opts = dataclasses.replace(opts, ignore_index=ignore_index)
    targets = shifted_labels(labels, shift_labels, opts.ignore_index).reshape(-1).to(logits.device)
    return _LogitsCrossEntropy.apply(logits.reshape(-1, vocab_size), targets, opts, num_items_in_batch)


class _LogitsCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, opts, num_items):
        shard = distributed.Shard(start=0, size=logits.shape[1], total=logits.shape[1])
        rows = chunked.select_rows(targets, opts.ignore_index, shard)
        ops = chunked._kernels_for(logits.device)
        step = _chunk_rows(opts, logits, rows.count)
        smoothing, vocab = opts.label_smoothing, logits.shape[1]
        loss = torch.empty(rows.count, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(loss)
        for start in range(0, rows.count, step):
            end = min(start + step, rows.count)
            z = rows.gather(logits, start, end)
            ops.row_losses(
                z,
                rows.target[start:end],
                loss[start:end],
                lse[start:end],
                logit_scale=1.0,
                softcap=None,
                label_smoothing=smoothing,
                z_loss=opts.z_loss,
                vocab_size=vocab,
            )
        ctx.save_for_backward(logits)
        ctx.rows, ctx.lse, ctx.opts, ctx.step = rows, lse, opts, step
        ctx.denominator = 1.0
        if opts.reduction == "none":
            if rows.index is None:
                return loss
            return torch.zeros(targets.numel(), dtype=torch.float32, device=logits.device).index_copy_(
                0, rows.index, loss
            )
        if opts.reduction == "mean":
            ctx.denominator = chunked.mean_denominator(rows.count, num_items)
        return loss.sum() / ctx.denominator

    @staticmethod
    def backward(ctx, grad_output):
        (logits,) = ctx.saved_tensors
        rows, opts = ctx.rows, ctx.opts
        ops = chunked._kernels_for(logits.device)
        grad = chunked._row_grad_buffer(logits, rows, logits.dtype)
        if opts.reduction == "none":
            per_token = grad_output.reshape(-1)
            row_scale = (per_token if rows.index is None else per_token[rows.index]).float().contiguous()
            grad_scale = 1.0
        else:
            row_scale, grad_scale = None, float(grad_output) / ctx.denominator
        for start in range(0, rows.count, ctx.step):
            end = min(start + ctx.step, rows.count)
            z = rows.gather(logits, start, end)
            out = torch.empty_like(z)
            ops.grad_logits(
                z, out, rows.target[start:end], ctx.lse[start:end],
                grad_scale=grad_scale, row_scale=None if row_scale is None else row_scale[start:end],
                logit_scale=1.0, softcap=None, label_smoothing=opts.label_smoothing,
                vocab_size=logits.shape[1], z_loss=opts.z_loss,
            )
            if rows.index is None:
                grad[start:end] = out
            else:
                grad.index_copy_(0, rows.index[start:end], out)
        return grad, None, None, None


def _chunk_rows(opts: LossOptions, logits: torch.Tensor, n_rows: int) -> int:
    # fp32 temporaries of the row_stats / grad_logits steps dominate: ~3 fp32 copies per row
    return chunked.plan_chunk_rows(n_rows, opts.chunk_size or chunked.auto_chunk_rows(logits.shape[1] * 12))
