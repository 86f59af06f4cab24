"""What the loss operators (``ops.py``) and the per-token operators (``token_ops.py``) share: how options cross
the operator boundary, output specs, and the autograd rules.

**Options as operator arguments.** ``fused_op`` turns a function ``f(<its own arguments>, *, opts)`` into a
``torch.library.custom_op`` whose schema is the function's own arguments followed by the ``LossOptions`` fields,
generated from the dataclass (``options.operator_fields``): ``class_weight`` as a positional ``Tensor?`` (custom
ops take no keyword tensors), the process group by its registered name, every other field a keyword argument of
its own type, e.g. ``fused_lm_loss::linear_cross_entropy(Tensor hidden, ..., Tensor? class_weight, *, int
ignore_index, str reduction, float label_smoothing, ...)``. Calls pass ``opts=``; the implementation, the fake
implementation, ``setup_context`` and backward all receive the decoded ``LossOptions`` and read it by name
(decoding does not validate again: the values were validated when the options were made).

**Output specs.** Each operator's outputs (shape, dtype) come from one function (``loss_outputs``,
``token_outputs``), which the fake implementation allocates from and the real one conforms to (``conform``): an
output that is not asked for is an empty (0,) tensor; a mismatch is a bug and raises at once.

**Autograd.** Gradients made in forward are saved through ``save_for_backward`` (``save_grads``) and rescaled in
backward (``rescaled``: the factor read on the device where the graph is freed, out of place under retain_graph); a
higher-order gradient raises (``refuse_double_backward``).
"""
from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensor

from . import distributed
from .backends import get_backend
from .chunked import KeptLogits, LinearHead, Rows, label_ids, select_rows
from .options import FP32_SAFE_RANGE, LossOptions, operator_fields
from .plan import grad_dtypes

# ---- options as operator arguments -------------------------------------------------------------------------

_FIELDS = [(name, crosses, kind) for name, crosses, kind in operator_fields() if crosses is not None]
TENSOR_OPTIONS = tuple(name for name, crosses, _ in _FIELDS if crosses == "tensor")
KEYWORD_OPTIONS = tuple((name, crosses, kind) for name, crosses, kind in _FIELDS if crosses != "tensor")


def encode(opts: LossOptions) -> tuple[tuple, dict]:
    """(positional tensor options, keyword options) of ``opts`` as an operator takes them."""
    keywords = {}
    for name, crosses, kind in KEYWORD_OPTIONS:
        value = getattr(opts, name)
        if crosses == "group":
            if value is not None and torch.compiler.is_compiling():
                # (the group crosses the operator as a name in a registry, which a trace cannot fill in)
                raise RuntimeError("fused_lm_loss: vocab parallelism (process_group) does not run under "
                                   "torch.compile; compile the rest of the step and call the loss outside it")
            value = distributed.group_name(value)
        elif kind in (float, Optional[float]) and value is not None:
            value = float(value)  # (an int given for a float option: the schema takes a float)
        keywords[name] = value
    return tuple(getattr(opts, name) for name in TENSOR_OPTIONS), keywords


def decode(tensors: Sequence[Tensor | None], keywords: dict) -> LossOptions:
    """The options of an operator call (``encode``'s inverse), without validating them again."""
    values = dict(zip(TENSOR_OPTIONS, tensors))
    for name, crosses, _ in KEYWORD_OPTIONS:
        values[name] = distributed.group_of(keywords[name]) if crosses == "group" else keywords[name]
    return LossOptions.trusted(**values)


class FusedOp:
    """A custom op whose trailing arguments are the options: call it as ``op(*own_args, opts=...)``."""

    def __init__(self, name: str, fn: Callable) -> None:
        hints = typing.get_type_hints(fn)
        own = [p.replace(annotation=hints[p.name]) for p in inspect.signature(fn).parameters.values()
               if p.name != "opts"]
        self.n_own = len(own)
        self.arg_names = [p.name for p in own] + list(TENSOR_OPTIONS)
        params = own + [
            inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Optional[Tensor])
            for n in TENSOR_OPTIONS
        ] + [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=kind) for n, _, kind in KEYWORD_OPTIONS]

        def implementation(*args, **keywords):
            return fn(*args[: self.n_own], opts=decode(args[self.n_own:], keywords))

        implementation.__signature__ = inspect.Signature(params, return_annotation=hints["return"])
        implementation.__name__, implementation.__doc__ = fn.__name__, fn.__doc__
        self.op = torch.library.custom_op(name, mutates_args=())(implementation)
        self.__doc__ = fn.__doc__

    def __call__(self, *args: Any, opts: LossOptions):
        tensors, keywords = encode(opts)
        refuse_mixed_meta(self.arg_names, (*args, *tensors))
        return self.op(*args, *tensors, **keywords)

    def register_fake(self, fake: Callable) -> Callable:
        """``fake(*own_args, opts)``: outputs of the right shapes and dtypes (``specs``, then ``allocate``)."""
        def implementation(*args, **keywords):
            return fake(*args[: self.n_own], opts=decode(args[self.n_own:], keywords))

        self.op.register_fake(implementation)
        return fake

    def register_autograd(self, backward: Callable, setup_context: Callable) -> None:
        """``setup_context(ctx, own_inputs, opts, output)``; ``backward(ctx, *grads)`` returns one gradient per own
        input (the options get none)."""
        def setup(ctx, inputs, keyword_only_inputs, output):  # (these names: torch passes them by name)
            setup_context(ctx, inputs[: self.n_own], decode(inputs[self.n_own:], keyword_only_inputs), output)

        def backward_all(ctx, *grads):
            return (*backward(ctx, *grads), *(None for _ in TENSOR_OPTIONS))

        self.op.register_autograd(backward_all, setup_context=setup)


def refuse_mixed_meta(names: Sequence[str], values: Sequence[Any]) -> None:
    """A meta tensor (a shape without values) beside tensors that hold values would make the dispatcher run the
    operator's fake implementation, whose outputs are uninitialized memory: a ValueError instead. (All on meta,
    shapes only, is what the fake implementation is for.)"""
    tensors = [(name, v) for name, v in zip(names, values, strict=True) if isinstance(v, Tensor)]
    on_meta = [name for name, v in tensors if v.device.type == "meta"]
    if on_meta and len(on_meta) < len(tensors):
        raise ValueError(f"{', '.join(on_meta)} on the meta device (a shape without values) beside tensors that hold "
                         "values: move them to the computation's device")


def fused_op(name: str) -> Callable[[Callable], FusedOp]:
    """Decorator: ``@fused_op("fused_lm_loss::name")`` on ``def f(<tensors, call values>, *, opts) -> tuple``."""
    return lambda fn: FusedOp(name, fn)


# ---- output specs ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """An operator output's shape and dtype."""

    shape: tuple
    dtype: torch.dtype


def absent(like: Tensor) -> Spec:
    """An output that was not asked for: (0,), in ``like``'s dtype."""
    return Spec((0,), like.dtype)


def allocate(specs: Sequence[Spec], device: torch.device) -> tuple:
    """Empty tensors of ``specs`` (the fake implementations' outputs)."""
    return tuple(torch.empty(s.shape, dtype=s.dtype, device=device) for s in specs)


def conform(specs: Sequence[Spec], outputs: Sequence[Tensor | None], device: torch.device) -> tuple:
    """The real outputs, ``None`` replaced by zeros of its spec, each checked against its spec: the fake
    implementation promised exactly these shapes and dtypes to the compiler."""
    result = []
    for k, (spec, out) in enumerate(zip(specs, outputs, strict=True)):
        if out is None:  # (asked for but never made, e.g. by weights that are all 0: its gradient is 0)
            out = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
        if tuple(out.shape) != tuple(spec.shape) or out.dtype != spec.dtype:
            raise RuntimeError(f"fused_lm_loss: output {k} is {tuple(out.shape)} {out.dtype}, but its spec says "
                               f"{tuple(spec.shape)} {spec.dtype} (a bug: please report it)")
        result.append(out)
    return tuple(result)


def grad_specs(opts: LossOptions, needs: Sequence[bool], made: bool, inputs: Sequence[Tensor | None],
               labels: Tensor) -> list[Spec]:
    """Specs of the gradients (hidden, weight, bias, u, B) made in forward (``made``; each where ``needs`` says),
    in the dtypes they are saved in until backward (``plan.grad_dtypes``)."""
    hidden, weight, bias, _, low_rank_weight = inputs
    dtypes = grad_dtypes(opts, hidden.device, hidden, weight, bias, low_rank_weight, labels.numel(),
                         distributed.Shard.of(weight, opts).chunk_vocab, get_backend(hidden.device).name)
    return [Spec(tuple(x.shape), dtype) if made and need else absent(hidden)
            for need, x, dtype in zip(needs, inputs, dtypes)]


def kept_logits_spec(opts: LossOptions, recomputes: bool, hidden: Tensor, weight: Tensor, labels: Tensor) -> Spec:
    """The logits kept from forward for backward (``keep_logits`` where backward would recompute them): one row
    per token (the shape must not depend on the data), this shard's vocabulary, the logits dtype."""
    if not (opts.keep_logits and recomputes):
        return absent(hidden)
    return Spec((labels.numel(), weight.shape[0]), opts.logits_dtype or hidden.dtype)


# ---- one call's head and rows ------------------------------------------------------------------------------


def linear_call(opts: LossOptions, hidden: Tensor, weight: Tensor, bias: Tensor | None, low_rank_input: Tensor | None,
                low_rank_weight: Tensor | None, labels: Tensor, kept_logits: KeptLogits | None = None,
                needs: Sequence[bool] = (), num_items: Tensor | None = None):
    """(head, rows, backend, shard) of a call on hidden states: the inputs as (N, .) rows, the selected rows.
    ``needs``: the gradients the call makes, ``num_items``: its num_items_in_batch (with vocab parallelism every
    rank must make the same ones, and have the same)."""
    labels = label_ids(labels)
    n = labels.numel()  # not -1: hidden may have 0 columns (the logits are then the bias, as in F.linear)
    low_rank = None
    if low_rank_input is not None:
        low_rank = (low_rank_input.reshape(n, low_rank_input.shape[-1]), low_rank_weight)
    backend = get_backend(hidden.device)
    shard = distributed.Shard.of(weight, opts, needs, num_items)
    rows = select_rows(labels, opts.ignore_index, shard, backend)
    return LinearHead(hidden.reshape(n, hidden.shape[-1]), weight, bias, low_rank, kept_logits), rows, backend, shard


def shaped_like(grad: Tensor | None, like: Tensor | None, dtype: torch.dtype | None = None) -> Tensor | None:
    """A gradient of the chunk loop in its input's shape (rounded to ``dtype`` if given), None if not made."""
    if grad is None:
        return None
    return grad.view(like.shape) if dtype is None else grad.view(like.shape).to(dtype)


def per_token(values: Tensor, rows: Rows, labels: Tensor) -> Tensor:
    """(rows.count,) values of the selected rows, shaped like ``labels`` (0 at ignored positions)."""
    return rows.scatter(values).view(labels.shape)


# ---- autograd ------------------------------------------------------------------------------------------------


def gradient_scale(scale: Tensor | None, scaling: float) -> float:
    """The gradient scale of a call: the GradScaler's scale tensor when given, else ``scaling``."""
    value = float(scale) if scale is not None else float(scaling)
    # forward forms the gradients in fp32 times the scaling, backward multiplies them by grad_output / scaling:
    # outside the range either step leaves fp32's normal numbers (inf / NaN gradients)
    low, high = FP32_SAFE_RANGE
    if not (value == 0.0 or low <= value <= high):
        raise ValueError(f"the gradient scaling must be 0 or between 2**-64 and 2**64 (fp32 gradients are formed times "
                         f"it and rescaled by its reciprocal), got {value}")
    return value


def grad_factor(grad_output: Tensor, scaling: float) -> float:
    """grad_output / scaling for the gradients made in forward (scaled by ``scaling``); one host sync."""
    go = float(grad_output)
    if scaling == 0.0 and go != 0.0:
        raise RuntimeError(
            "the fused loss was computed with scaling=0 (a GradScaler scale of 0?): its gradients are all zero "
            f"and cannot be rescaled to grad_output={go}. Use a non-zero scale."
        )
    return 0.0 if scaling == 0.0 else go / scaling


@torch.library.custom_op("fused_lm_loss::rescale_grads", mutates_args=())
def rescale_grads(grads: Sequence[Tensor], grad_output: Tensor, scale: Optional[Tensor], scaling: float) -> List[Tensor]:
    """Each gradient made in forward times grad_output / scaling, as new tensors of its dtype (compiled
    backward; the caller rounds them to the inputs' dtypes)."""
    factor = grad_factor(grad_output, gradient_scale(scale, scaling))
    return [g * factor for g in grads]


@rescale_grads.register_fake
def _(grads, grad_output, scale, scaling):
    return [torch.empty_like(g) for g in grads]


def shapes_only(t: Tensor | None) -> bool:
    """Whether ``t`` holds no values the host may read: torch.compile traces (AOTAutograd traces backward with fake
    tensors; torch 2.5 does not report that through ``torch.compiler.is_compiling``), or it is on the meta device.
    The operators then run without host syncs, and their fake implementations give the shapes."""
    if torch.compiler.is_compiling():
        return True
    return t is not None and (isinstance(t, FunctionalTensor) or is_fake(t) or t.is_meta)


def rescaled(grads: list[Tensor], dtypes: list[torch.dtype], grad_output: Tensor, scale: Tensor | None,
             scaling: float) -> list[Tensor]:
    """grad_output / scaling applied to the saved gradients, each result rounded once to its ``dtypes`` entry (the
    input's dtype); in eager mode a factor of exactly 1.0 returns the gradients saved in that dtype as they are.

    Eager, with a number for ``scaling`` (not 0) and a graph that this backward frees (no retain_graph), the factor
    stays on the device (``backend.scale_grad``): no host sync, so the host queues what follows while the forward
    still runs. A gradient already in its dtype is then scaled in place (untouched at a factor of 1): nothing else
    reads it, since the engine releases it after this backward. Otherwise (retain_graph: a later backward reads it
    again; a GradScaler's scale tensor or scaling 0, whose values the host checks) out of place, after one sync."""
    if shapes_only(grad_output):
        return [g.to(dtype) for g, dtype in zip(rescale_grads(grads, grad_output, scale, scaling), dtypes)]
    if scale is None and scaling != 0.0 and grads and not _graph_kept():
        backend = get_backend(grads[0].device)
        factor = grad_output.detach().reshape(()).to(torch.float64) / float(scaling)
        results = []
        for g, dtype in zip(grads, dtypes):
            out = g if g.dtype == dtype else torch.empty(g.shape, dtype=dtype, device=g.device)
            backend.scale_grad(g, factor, out)
            results.append(out)
        return results
    return apply_factor(grads, dtypes, grad_factor(grad_output, gradient_scale(scale, scaling)))


def _graph_kept() -> bool:
    """Whether the running backward keeps its graph (retain_graph / create_graph): then the saved gradients are read
    again. True where torch cannot say (outside a backward, or a torch without the query)."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if query is None else bool(query())


def apply_factor(grads: list[Tensor], dtypes: list[torch.dtype], factor: float) -> list[Tensor]:
    """Eager: each gradient times ``factor``, out of place, rounded once to its ``dtypes`` entry; a factor of
    exactly 1.0 returns the gradients already in that dtype as they are."""
    if factor == 1.0:
        return [g if g.dtype == dtype else g.to(dtype) for g, dtype in zip(grads, dtypes)]
    return [torch.mul(g, factor, out=g.new_empty(g.shape, dtype=dtype)) for g, dtype in zip(grads, dtypes)]


def refuse_double_backward(grad_output: Tensor | None) -> None:
    # backward runs with grad mode on only for create_graph=True; tracing a compiled backward is not that
    if torch.is_grad_enabled() and not shapes_only(grad_output):
        raise RuntimeError(
            "fused_lm_loss does not support higher-order gradients: its backward only rescales gradients made in "
            "forward, so a gradient of its gradient would be silently wrong. Call autograd.grad / backward without "
            "create_graph=True, or compute this loss with F.cross_entropy on the logits."
        )


def save_grads(ctx, grads: Sequence[Tensor], *also_saved: Tensor | None) -> None:
    """Save the gradients made in forward for backward, after ``also_saved`` (which backward reads too).

    Through ``save_for_backward``, so that the engine releases them as soon as backward has run (unless
    retain_graph): ``param.grad`` then adopts the returned tensor instead of copying it. Under retain_graph
    they stay saved, the engine sees a second owner and copies into ``param.grad``, so a second backward never
    accumulates into a saved gradient.
    """
    ctx.save_for_backward(*also_saved, *grads)


def save_with_options(ctx, opts: LossOptions, *tensors: Tensor | None) -> None:
    """Save ``tensors`` and the options' tensors (class weights) for backward, through ``save_for_backward``
    (version counters guard them all; a tensor kept as a ctx attribute would escape that, and torch.compile's
    tracing); ``saved_with_options`` gives them back."""
    ctx.opts = without_tensors(opts)
    ctx.save_for_backward(*tensors, *(getattr(opts, name) for name in TENSOR_OPTIONS))


def saved_with_options(ctx) -> tuple[tuple, LossOptions]:
    """(the tensors saved by ``save_with_options``, the options with their tensors)."""
    saved = ctx.saved_tensors
    own = len(saved) - len(TENSOR_OPTIONS)
    return saved[:own], LossOptions.trusted(**{**vars(ctx.opts), **dict(zip(TENSOR_OPTIONS, saved[own:]))})


def without_tensors(opts: LossOptions) -> LossOptions:
    """The options for a ctx attribute: their tensors (class weights) dropped (backward of the mean / sum loss
    only rescales, and reads none)."""
    return LossOptions.trusted(**{**vars(opts), **{name: None for name in TENSOR_OPTIONS}})


def only_needed(grads: Sequence[Tensor | None], needs: Sequence[bool]) -> tuple:
    """One gradient per input: those asked for, None elsewhere."""
    return tuple(g if need else None for g, need in zip(grads, needs))
