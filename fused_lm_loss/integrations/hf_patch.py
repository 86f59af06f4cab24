"""``patch`` / ``unpatch`` for Hugging Face causal LMs (and peft models around them).

How a patched model trains (one mechanism for every ``*ForCausalLM`` whose forward is
"decoder -> last hidden state -> lm_head -> self.loss_function"):

1. ``model.forward`` (instance attribute) is wrapped. In training with labels it runs the original
   forward while ``lm_head.forward`` is temporarily replaced (``hf_forward.FusedCall``).
2. The replacement receives the hidden states (already sliced by ``logits_to_keep``) and computes
   the fused loss right there, inside the lm_head module call, from ``lm_head.weight`` (and the LoRA
   pieces when peft wraps lm_head): under FSDP2 with lm_head as its own unit, that is when the full
   weight exists. It returns a tiny probe tensor instead of the logits.
3. The model's family-specific logit ops run on the probe for free; ``self.loss_function(...)`` then
   returns the precomputed loss after checking that the model transformed the probe exactly as the fused
   loss does (softcap and logit scale read from the config: ``hf_config.py``), so a model that does
   something else to its logits gets an error instead of a wrong loss.
4. The output's ``logits`` is None (they were never computed).

In eval mode, without labels, or when ``model.loss_function`` is a callable other than a
``FusedLMLoss``, the original forward runs untouched; with a ``FusedLMLoss`` assigned, the loss of
those calls is computed from the logits the model made (``hf_loss.causal_lm_loss``).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from typing import Any, Callable

import torch
from torch import nn

from ..loss import FusedLMLoss
from ..options import LossOptions, check_supported
from . import deepspeed as deepspeed_integration
from . import peft as peft_integration
from . import trl as trl_integration
from .hf_config import model_options, unsupported
from .hf_forward import FusedCall
from .hf_loss import causal_lm_loss
from .wrappers import inner_model

_STATE_ATTR = "_fused_lm_loss_patch"
_SWAPPED_CLASSES: dict[type, type] = {}


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
        model.train()                                      # (from_pretrained returns the model in eval mode)
        loss = model(input_ids=ids, labels=ids).loss      # fused in training mode; outputs.logits is None
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
        model_options=model_options(target),
        grad_scaler=grad_scaler,
        saved_forward=vars(target).get("forward"),
        original_class=type(target),
        loss_type=getattr(target, "loss_type", None),
    )
    state.assign(target, loss_fn)
    object.__setattr__(target, _STATE_ATTR, state)
    object.__setattr__(target, "forward", _FusedForward(target, target.forward))
    _HeadForward.install(target.get_output_embeddings(), state)
    target.__class__ = _swapped_class(type(target))
    trl_integration.register(target, patched_options)  # TRL's fused LM head (if installed) runs on our kernels
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
    if not isinstance(target.__dict__.get("forward"), _FusedForward):
        raise RuntimeError(
            f"{type(target).__name__}.forward was wrapped again after patch() (accelerate's mixed-precision "
            "wrapper, e.g. Trainer(bf16=True) or a TRL trainer built on the patched model): unpatching would remove "
            "that wrapper too. Unwrap it first (accelerator.unwrap_model(model, keep_fp32_wrapper=False)), unpatch "
            "before wrapping, or keep the patch"
        )
    if type(target) is not _swapped_class(state.original_class):
        raise RuntimeError(
            f"{type(target).__name__} subclasses the patched class (FSDP2's fully_shard after patch()): unpatching "
            "would drop that subclass too. Unpatch before fully_shard, or keep the patch"
        )
    target.__class__ = state.original_class
    del target.__dict__[_STATE_ATTR]
    if state.saved_forward is None:
        del target.__dict__["forward"]
    else:
        target.__dict__["forward"] = state.saved_forward
    trl_integration.unregister(target)
    for head in state.heads:
        _HeadForward.remove(head)
    # An assignment made while unpatched (see integrations.__init__) left the loss as a child module.
    for owner in {id(model): model, id(target): target}.values():
        if isinstance(owner._modules.get("loss_function"), FusedLMLoss):
            del owner._modules["loss_function"]
    return model


def patched_options(model: nn.Module) -> LossOptions | None:
    """The options a patched model trains with (its FusedLMLoss's, with the model's softcap / logit scale); None
    while another callable is its loss_function (it computes logits then, as unpatched)."""
    state = getattr(_causal_lm(model), _STATE_ATTR, None)
    if state is None:
        raise RuntimeError(f"{type(model).__name__} is not patched by fused_lm_loss")
    return state.fused_options


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


# ---- the patch state and the swapped class (its ``loss_function`` property and ``__setattr__``) ----


@dataclasses.dataclass
class _PatchState:
    model_options: dict  # softcap / logit_scale of this model's forward
    grad_scaler: Any
    saved_forward: Any  # the instance-level forward before patching (None: the class's)
    original_class: type
    user_loss: Any = None  # what was assigned to loss_function (None: the transformers default)
    fused_options: LossOptions | None = None  # the fused loss's options, None when not fusing
    forward_loss: Callable | None = None  # what loss_function gives during a forward in progress
    call: "FusedCall | None" = None  # the training forward in progress (its lm_head computes the loss)
    heads: list = dataclasses.field(default_factory=list)  # the lm_head modules whose forward is wrapped
    loss_type: Any = None  # the model's loss_type when last checked (``_check_loss_type``)
    warned_without_labels: bool = False

    def assign(self, model: nn.Module, loss_fn: Any) -> None:
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_function must be callable, got {type(loss_fn).__name__}")
        user = FusedLMLoss() if loss_fn is None else loss_fn
        if isinstance(user, FusedLMLoss):
            check_only_options(user, model)
            self.fused_options = _merge_options(user.options, self.model_options, self.grad_scaler, model)
        else:
            self.fused_options = None
        self.user_loss = loss_fn
        model._modules.pop("loss_function", None)


def check_only_options(loss: FusedLMLoss, model: nn.Module) -> None:
    """A patched model computes its loss from the FusedLMLoss's options alone (the loss inside lm_head's call): a
    subclass's own forward or a forward hook on the loss would never run, so they are refused, not dropped."""
    overridden = type(loss).forward is not FusedLMLoss.forward
    if overridden or loss._forward_hooks or loss._forward_pre_hooks:
        what = f"{type(loss).__name__} overrides forward" if overridden else "the loss has forward hooks"
        raise ValueError(
            f"{what}, but a patched {type(model).__name__} uses only a FusedLMLoss's options (it computes the loss "
            "inside lm_head's call, never calling the module). Assign a plain FusedLMLoss(...) and transform the "
            "model's loss instead, or assign your own callable (the model then computes its logits)"
        )


def _merge_options(user: LossOptions, model_options: dict, grad_scaler: Any, model: nn.Module) -> LossOptions:
    """The user's options with the model's softcap / logit scale (which must not contradict them)."""
    for name, default in (("softcap", None), ("logit_scale", 1.0)):
        mine, theirs = getattr(user, name), model_options[name]
        if mine != default and mine != theirs:
            raise ValueError(
                f"{name}={mine} contradicts {type(model).__name__}, whose forward applies {name}={theirs}: "
                f"leave {name} unset, the patched model takes it from its config"
            )
    check_supported(user, "patch", f"patch({type(model).__name__})")
    scaler = grad_scaler if user.grad_scaler is None else user.grad_scaler
    return dataclasses.replace(user, **model_options, grad_scaler=scaler)


def _loss_function_get(self: nn.Module) -> Any:
    state = self.__dict__[_STATE_ATTR]
    if state.forward_loss is not None:
        return state.forward_loss
    if state.user_loss is not None:
        return state.user_loss
    return state.original_class.loss_function.__get__(self)


def _setstate(self: nn.Module, state: dict) -> None:
    """A copy of a patched model (copy.deepcopy) is patched as the original is: TRL's head must find it too."""
    state[_STATE_ATTR].original_class.__setstate__(self, state)
    trl_integration.register(self, patched_options)


def _setattr(self: nn.Module, name: str, value: Any) -> None:
    state = self.__dict__.get(_STATE_ATTR)  # (None on a replica that DataParallel is still filling in)
    if name == "loss_function" and state is not None:
        state.assign(self, value)
    else:  # (past the swapped class itself, not type(self): FSDP2's fully_shard subclasses it after patch())
        super(_swapped_in(type(self)), self).__setattr__(name, value)


def _swapped_in(cls: type) -> type:
    """The class ``_swapped_class`` made among ``cls`` and its bases."""
    return next(c for c in cls.__mro__ if c.__dict__.get("__setattr__") is _setattr)


def _replicate_for_data_parallel(self: nn.Module) -> nn.Module:
    """A DataParallel replica (``torch.nn.parallel.replicate``) is patched as the original is, with a state and a
    forward of its own: the replica's copy of the original's attributes would run the original's modules, and its
    replicas (one thread each) would share one forward in progress."""
    state = self.__dict__[_STATE_ATTR]
    replica = state.original_class._replicate_for_data_parallel(self)
    forward = self.__dict__.get("forward")
    inner = forward.inner if isinstance(forward, _FusedForward) else None
    if getattr(inner, "__self__", None) is not self:  # (a wrapper that the replica cannot rebind to itself)
        raise RuntimeError(
            f"fused_lm_loss: DataParallel cannot replicate this patched {type(self).__name__}: its forward is wrapped "
            f"before or after patch() ({(inner or forward)!r}), and a replica would run the original's modules. Use "
            "DistributedDataParallel (torchrun, accelerate launch), or patch the model before anything wraps it"
        )
    replica_state = dataclasses.replace(state, call=None, forward_loss=None, heads=[])
    object.__setattr__(replica, _STATE_ATTR, replica_state)
    object.__setattr__(replica, "forward", _FusedForward(replica, inner.__func__.__get__(replica)))
    return replica  # (its lm_head, a replica too, gets a wrapper of its own at its first fused forward)


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
                "__setstate__": _setstate,
                "_replicate_for_data_parallel": _replicate_for_data_parallel,
            },
        )
    return _SWAPPED_CLASSES[cls]


# ---- the forward wrapper ----


class _FusedForward:
    """``model.forward`` of a patched model. A callable object rather than a closure so that
    ``copy.deepcopy(model)`` gives a copy whose forward drives the copy, and with the original
    signature so that ``Trainer`` keeps the right dataset columns and passes ``num_items_in_batch``."""

    def __init__(self, model: nn.Module, inner: Callable) -> None:
        self.model, self.inner = model, inner
        self.__signature__ = inspect.signature(inner)
        params = self.__signature__.parameters
        self._names = frozenset(params)
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        labels = params.get("labels")
        self._labels_position = list(params).index("labels") if labels is not None and labels.kind in positional else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        state = model.__dict__[_STATE_ATTR]
        if state.fused_options is None:  # another callable was assigned to loss_function
            return self.inner(*args, **kwargs)
        if state.forward_loss is not None:
            raise RuntimeError(f"{type(model).__name__}.forward re-entered during a fused-loss forward")
        labels, extra = self._labels(args, kwargs) if model.training else (None, {})
        if model.training and not torch.compiler.is_compiling():
            # (without autograd no training loss is made from the logits: RL trainers generate in training mode)
            if labels is None and torch.is_grad_enabled():
                _warn_training_without_labels(model)
            else:
                trl_integration.check_caller()
        head = model.get_output_embeddings()
        # already there, unless peft replaced lm_head after patch() or this is a DataParallel replica, whose lm_head
        # came with a copy of the original's wrapper (which would run the original's head, on every path)
        _HeadForward.install(head, state)
        if labels is None:  # eval, or no labels: the model makes its logits and, with labels, its loss of them
            if state.user_loss is None:  # exactly as before patching
                return self.inner(*args, **kwargs)
            return self._run(state, functools.partial(causal_lm_loss, state.fused_options), args, kwargs)
        if state.user_loss is not None:  # (hooks registered on it after the assignment)
            check_only_options(state.user_loss, model)
        else:
            _check_loss_type(model, state)
        deepspeed_integration.register_partitioned_head(model, head)  # ZeRO-3: gathered for backward too
        state.call = FusedCall(model, head, state.fused_options, labels, extra)
        try:
            outputs = self._run(state, state.call.loss_function, args, kwargs)
            return state.call.finish(outputs)
        finally:
            state.call = None

    def _labels(self, args: tuple, kwargs: dict) -> tuple[Any, dict]:
        """(labels, the keyword arguments the signature does not name) of a call, by name or position.
        (Read from names taken at construction: torch.compile does not trace ``inspect`` on every version.)"""
        labels = kwargs.get("labels")
        if labels is None and self._labels_position is not None and self._labels_position < len(args):
            labels = args[self._labels_position]
        return labels, {k: v for k, v in kwargs.items() if k not in self._names}

    def _run(self, state: _PatchState, loss_function: Callable, args: tuple, kwargs: dict) -> Any:
        state.forward_loss = loss_function
        try:
            return self.inner(*args, **kwargs)
        finally:
            state.forward_loss = None


def _warn_training_without_labels(model: nn.Module) -> None:
    state = model.__dict__[_STATE_ATTR]
    if not state.warned_without_labels:  # once per patched model
        state.warned_without_labels = True
        warnings.warn(
            f"fused_lm_loss: the patched {type(model).__name__} was called in training mode without labels, so it "
            "computed its logits and no fused loss: the caller computes its loss from the full logits. With "
            "Trainer's label_smoothing_factor > 0 (which withholds the labels), set label_smoothing_factor=0 and "
            "patch with FusedLMLoss(label_smoothing=...) instead; a trainer that needs the logits themselves (e.g. "
            "TRL's experimental GKD) runs unfused",
            stacklevel=3,
        )


class _HeadForward:
    """``lm_head.forward`` of a patched model: during a fused training forward, the call's ``head_forward``
    (the fused loss from the hidden states); otherwise the module's own forward.

    Installed once, as an instance attribute (module hooks, e.g. FSDP2's unshard, still run around it), rather
    than swapped in and out around each forward, so that a compiled forward mutates no module.
    """

    def __init__(self, head: nn.Module, state: "_PatchState") -> None:
        self.head, self.state = head, state
        self.saved = head.__dict__.get("forward")  # an instance-level forward before ours, else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.state.call is not None:
            hook = getattr(self.head, "_hf_hook", None)
            if hook is None:
                return self.state.call.head_forward(*args, **kwargs)
            # accelerate (device_map): its hook moves the hidden states to lm_head's device and loads an offloaded
            # weight before the forward (and releases it after), as its own wrapper (``self.saved``) does
            args, kwargs = hook.pre_forward(self.head, *args, **kwargs)
            return hook.post_forward(self.head, self.state.call.head_forward(*args, **kwargs))
        if self.saved is not None:
            return self.saved(*args, **kwargs)
        return type(self.head).forward(self.head, *args, **kwargs)

    @classmethod
    def install(cls, head: nn.Module, state: "_PatchState") -> None:
        """Wrap ``head`` for this patch, unless it already is. A wrapper of another head or patch (a DataParallel
        replica's copy of the original's, or one lm_head shared by two patched models) is replaced, keeping the
        forward it saved."""
        current = head.__dict__.get("forward")
        if isinstance(current, cls) and current.head is head and current.state is state:
            return
        wrapper = cls(head, state)
        if isinstance(current, cls):
            wrapper.saved = current.saved
        head.forward = wrapper
        if head not in state.heads:
            state.heads.append(head)

    @staticmethod
    def remove(head: nn.Module) -> None:
        wrapper = head.__dict__.get("forward")
        if isinstance(wrapper, _HeadForward):
            if wrapper.saved is None:
                del head.forward
            else:
                head.forward = wrapper.saved


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
    default_loss = _default_loss_name(model, type(model))
    if default_loss not in (None, "ForCausalLMLoss"):
        raise TypeError(
            f"fused_lm_loss.patch: {name}'s loss is {default_loss} (loss_type={getattr(model, 'loss_type', None)!r}); "
            "the fused loss computes transformers' ForCausalLMLoss"
        )
    reason = unsupported(model)
    if reason is not None:
        raise TypeError(f"fused_lm_loss.patch: {name} is not supported: {reason}")
    peft_integration.check_head(head)


def _default_loss_name(model: nn.Module, cls: type) -> str | None:
    """The name of the loss transformers picks for ``model`` by its ``loss_type`` (``cls``'s property), None when
    the model has a loss_function of its own."""
    if "_loss_function" in vars(model):
        return None
    loss = cls.loss_function.fget(model)
    return getattr(loss, "__name__", repr(loss))


def _check_loss_type(model: nn.Module, state: "_PatchState") -> None:
    """A training forward of the default loss (nothing assigned): ``loss_type`` changed since patch() must still
    name ForCausalLMLoss, the loss the fused one stands in for (only a change is looked up: an attribute read per
    call otherwise, which torch.compile traces)."""
    loss_type = getattr(model, "loss_type", None)
    if loss_type == state.loss_type:
        return
    default_loss = _default_loss_name(model, state.original_class)
    if default_loss not in (None, "ForCausalLMLoss"):
        raise RuntimeError(
            f"fused_lm_loss: {type(model).__name__}.loss_type is now {loss_type!r} ({default_loss}), but the patched "
            "model trains with the fused ForCausalLMLoss: unpatch it, or assign the loss you want to loss_function"
        )
    state.loss_type = loss_type


def _causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper or DDP (``wrappers.inner_model``), or the model itself."""
    return inner_model(model)
