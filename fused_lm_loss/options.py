"""The options of a fused loss: one dataclass, validated once where it is made, and one table of what each way of
calling can honour.

``LossOptions`` is made by ``FusedLMLoss(...)``, ``fused_linear_cross_entropy(..., **options)``, ``token_stats`` and
the integrations; ``__post_init__`` raises ``ValueError`` for a value out of range or a combination no call can
serve (``CONFLICTS``). Each field says how it crosses into the PyTorch operators (``ops_common.py`` generates their
option arguments from these fields): as a keyword argument of its own type (the default), as a tensor argument
(``class_weight``), as a process group's registered name, or not at all (``grad_scaler``: its scale is read before
the call and passed as an argument of its own). ``UNSUPPORTED`` says, per way of calling, which options that call
cannot honour: ``check_supported`` raises there, so that nothing is silently dropped.

Example::

    opts = LossOptions(label_smoothing=0.1, temperature=0.7)     # ValueError for anything out of range
    check_supported(opts, "patch")                               # ValueError if a patched model cannot honour it
"""
from __future__ import annotations

import dataclasses
import math
import operator
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .transform import LogitTransform

REDUCTIONS = ("mean", "sum", "none")
MATMUL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# How a field crosses into the operators (``ops_common.py``); a field without this metadata is a keyword argument
# of its annotated type.
TENSOR_ARG = {"crosses": "tensor"}  # a positional Optional[Tensor] argument (custom ops take no keyword tensors)
GROUP_ARG = {"crosses": "group"}  # a torch.distributed group, by the name distributed.group_name gives it
HOST_ONLY = {"crosses": None}  # read on the host before the call; not an operator argument

#: Where a positive scalar that reaches fp32 math must lie: the options softcap, logit_scale, temperature and a
#: non-zero z_loss, the products the kernels take (scale / temperature, softcap / temperature, scale / softcap), and
#: a gradient scaling (``ops_common.gradient_scale``). Outside it fp32 rounds the value itself to 0 or inf, or its
#: product with a logit, an lse or a gradient leaves fp32's normal numbers: inf / NaN where float64 is finite.
FP32_SAFE_RANGE = (2.0**-64, 2.0**64)


@dataclass(frozen=True, eq=False)  # (class_weight is a tensor: options compare by identity)
class LossOptions:
    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: Optional[float] = None
    logit_scale: float = 1.0
    temperature: float = 1.0
    chunk_size: Optional[int] = None
    accum_dtype: Optional[torch.dtype] = torch.float32
    logits_dtype: Optional[torch.dtype] = None
    grad_scaler: Any = field(default=None, metadata=HOST_ONLY)
    process_group: Any = field(default=None, metadata=GROUP_ARG)
    vocab_start: Optional[int] = None
    vocab_size: Optional[int] = None
    reduce_grad_input: bool = True
    class_weight: Any = field(default=None, metadata=TENSOR_ARG)  # (V,) float: F.cross_entropy's weight=
    return_z_loss: bool = False
    return_token_accuracy: bool = False
    keep_logits: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "ignore_index", check_ignore_index(self.ignore_index))  # (a numpy int: an int)
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        check_real("label_smoothing", self.label_smoothing)
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing}")
        check_real("z_loss", self.z_loss)
        if self.z_loss < 0.0:
            raise ValueError(f"z_loss must be >= 0, got {self.z_loss}")
        if self.z_loss != 0.0:
            check_fp32_safe("z_loss", self.z_loss)
        if self.softcap is not None:
            check_real("softcap", self.softcap)
            if self.softcap <= 0.0:
                raise ValueError(f"softcap must be > 0 or None, got {self.softcap}")
            check_fp32_safe("softcap", self.softcap)
        for name in ("logit_scale", "temperature"):
            check_real(name, getattr(self, name))
            if getattr(self, name) <= 0.0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
            check_fp32_safe(name, getattr(self, name))
        check_transform_products(self.transform)
        if self.chunk_size is not None:
            if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1:
                raise ValueError(f"chunk_size must be a positive int or None, got {self.chunk_size!r}")
        if self.accum_dtype is not None and self.accum_dtype not in MATMUL_DTYPES:
            raise ValueError(f"accum_dtype must be None or one of {MATMUL_DTYPES}, got {self.accum_dtype!r}")
        if self.logits_dtype not in (None, torch.float32):
            raise ValueError(f"logits_dtype must be None (the matmul dtype) or torch.float32, got {self.logits_dtype!r}")
        if self.grad_scaler is not None and not callable(getattr(self.grad_scaler, "get_scale", None)):
            raise ValueError("grad_scaler must be None or have a get_scale() method (e.g. torch.amp.GradScaler)")
        for name in ("vocab_start", "vocab_size"):
            value, lowest = getattr(self, name), 0 if name == "vocab_start" else 1
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < lowest):
                raise ValueError(f"{name} must be an int >= {lowest}, got {value!r}")
        if self.process_group is not None and not is_process_group(self.process_group):
            raise ValueError(f"process_group must be None or a torch.distributed process group (e.g. "
                             f"dist.group.WORLD, dist.new_group(...)), got {self.process_group!r}")
        if self.process_group is None and (self.vocab_start is not None or self.vocab_size is not None):
            raise ValueError("vocab_start / vocab_size describe a vocab shard and need a process_group")
        if self.process_group is None and self.reduce_grad_input is False:
            raise ValueError("reduce_grad_input=False leaves dX as this rank's partial sum over a vocab shard and needs "
                             "a process_group (without one the whole vocabulary is here: nothing is partial)")
        if (self.vocab_start is None) != (self.vocab_size is None):
            raise ValueError("give vocab_start and vocab_size together (unequal shards), or neither (equal shards)")
        if self.class_weight is not None:
            weight = self.class_weight
            if (not isinstance(weight, torch.Tensor) or weight.layout != torch.strided or weight.dim() != 1
                    or not weight.is_floating_point()):
                raise ValueError(f"class_weight must be a dense 1-d float tensor of one weight per class, got {weight!r}")
            if weight.requires_grad:  # (F.cross_entropy would differentiate it; this loss does not)
                raise ValueError("class_weight requires grad, but the fused loss gives the class weights no gradient: "
                                 "pass class_weight.detach()")
        for name in ("reduce_grad_input", "return_z_loss", "return_token_accuracy", "keep_logits"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for (first, second), why in CONFLICTS.items():
            if self.is_set(first) and self.is_set(second):
                raise ValueError(f"{first} with {second}: {why}")

    def is_set(self, name: str) -> bool:
        """Whether option ``name`` differs from its default (a tensor or a group is set when given)."""
        value, default = getattr(self, name), _DEFAULTS[name]
        return value is not default and (isinstance(value, (torch.Tensor, torch.dtype)) or value != default)

    @property
    def transform(self) -> LogitTransform:
        """What the loss does to the raw logits before the softmax (scale, softcap, temperature)."""
        return LogitTransform(scale=self.logit_scale, softcap=self.softcap, temperature=self.temperature)

    @classmethod
    def trusted(cls, **values: Any) -> "LossOptions":
        """Options rebuilt from values that were validated when they were first made (an operator decoding its
        arguments): no second validation. Fields not given keep their defaults."""
        opts = object.__new__(cls)
        for name, default in _DEFAULTS.items():
            object.__setattr__(opts, name, values.pop(name, default))
        if values:
            raise TypeError(f"unknown options: {sorted(values)}")
        return opts


#: Pairs of options that no call can combine (both set): why.
CONFLICTS: dict[tuple[str, str], str] = {
    ("class_weight", "process_group"): "class weights are not supported with vocab parallelism",
    ("return_token_accuracy", "process_group"): "the token accuracy is not computed with vocab parallelism",
}

# What the fused computations cannot honour, per way of calling: option -> why. ``check_supported`` raises for any
# of these that is set. Options not listed are honoured; a few do not apply to a call and have nothing to change
# there (``logits_dtype``, ``accum_dtype`` and ``keep_logits`` on logits that already exist: no matmul, no dW;
# ``grad_scaler`` for the per-token outputs and TRL's distillation divergence, whose gradients backward rescales
# by the grad_output it receives, the scaler's scale included; ``logits_dtype`` for the divergence, whose logits
# are fp32 always).
_TOKEN_STATS = {
    "reduction": "the per-token outputs are not reduced (reduce them yourself)",
    "label_smoothing": "the per-token outputs are log-probabilities and entropy, not a smoothed loss",
    "z_loss": "the per-token outputs carry no z-loss",
    "logits_dtype": "fp32 logits are not supported for the per-token outputs",
    "process_group": "vocab parallelism is not supported for the per-token outputs",
    "vocab_start": "vocab parallelism is not supported for the per-token outputs",
    "class_weight": "class weights do not apply to log-probabilities",
    "return_z_loss": "the per-token outputs carry no z-loss",
    "return_token_accuracy": "is_top1 is always returned",
}
UNSUPPORTED: dict[str, dict[str, str]] = {
    "loss": {},  # FusedLMLoss / fused_linear_cross_entropy on hidden states
    "logits": {  # the loss of logits that already exist (integrations.causal_lm_loss, a patched model's eval loss)
        "process_group": "a vocab-parallel loss needs hidden states, not logits",
        "class_weight": "class weights need hidden states, not logits",
        "return_z_loss": "return_z_loss needs hidden states, not logits",
        "return_token_accuracy": "return_token_accuracy needs hidden states, not logits",
    },
    "patch": {  # a patched Hugging Face model's training loss
        "process_group": "patch() does not handle a vocab-parallel loss; use the core API",
        "return_z_loss": "the model returns its loss; return_z_loss is for direct FusedLMLoss calls",
        "return_token_accuracy": "the model returns its loss; return_token_accuracy is for direct FusedLMLoss calls",
        "class_weight": "transformers divides the loss by num_items_in_batch, a token count, which class weights "
        "redefine; use FusedLMLoss(class_weight=...) on the hidden states directly",
    },
    "token_stats": _TOKEN_STATS,
    "trl": {  # TRL's fused LM head on a patched model: per-token log-probabilities that TRL reduces itself
        **_TOKEN_STATS,
        "reduction": "TRL reduces the per-token log-probabilities itself",
        "label_smoothing": "TRL's loss is made of per-token log-probabilities, which carry no label smoothing",
        "z_loss": "TRL's loss is made of per-token log-probabilities, which carry no z-loss",
        "ignore_index": "TRL marks ignored positions with -100",
        "temperature": "TRL passes its own temperature (set it in TRL's config)",
    },
    "trl_distillation": {  # TRL's distillation trainer on a patched student: the per-token divergence
        **{name: why for name, why in _TOKEN_STATS.items() if name != "logits_dtype"},  # (its logits are fp32)
        "reduction": "TRL reduces the per-token divergence itself",
        "label_smoothing": "a divergence between two distributions has no label smoothing",
        "z_loss": "TRL's distillation loss carries no z-loss",
        "ignore_index": "TRL passes only the positions that count",
        "temperature": "TRL passes its own temperature (set it in TRL's config)",
        "accum_dtype": "the divergence keeps its gradients in fp32 until backward",
        "keep_logits": "the divergence does not keep logits for backward",
    },
}


def check_supported(opts: LossOptions, where: str, owner: str = "") -> None:
    """Raise ``ValueError`` naming every option set in ``opts`` that ``where`` (a key of UNSUPPORTED) cannot honour."""
    refused = {name: why for name, why in UNSUPPORTED[where].items() if opts.is_set(name)}
    if refused:
        reasons = "; ".join(f"{name}: {why}" for name, why in refused.items())
        raise ValueError(f"fused_lm_loss{': ' + owner if owner else ''}: {', '.join(refused)} cannot be honoured "
                         f"here ({reasons})")


def operator_fields() -> list[tuple[str, str | None, Any]]:
    """(name, how it crosses, operator type) of every field, in declaration order: how is "value" (a keyword
    argument of the operator type), "tensor", "group" (operator type Optional[str]) or None (not an argument)."""
    hints = typing.get_type_hints(LossOptions)
    out = []
    for f in dataclasses.fields(LossOptions):
        crosses = f.metadata.get("crosses", "value")
        kind = {"tensor": Optional[torch.Tensor], "group": Optional[str], None: None}.get(crosses, hints[f.name])
        if isinstance(kind, types.UnionType):  # X | None -> Optional[X], the spelling infer_schema knows
            kind = Optional[next(a for a in typing.get_args(kind) if a is not type(None))]
        out.append((f.name, crosses, kind))
    return out


def check_real(name: str, value: Any) -> None:
    """A finite int or float (not a bool), else a ValueError naming the option."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not is_finite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def check_fp32_safe(name: str, value: float) -> None:
    """``value`` within FP32_SAFE_RANGE, else a ValueError naming the option (or the options' product)."""
    low, high = FP32_SAFE_RANGE
    if not low <= value <= high:
        raise ValueError(f"{name} must be between 2**-64 and 2**64 (it enters fp32 math, where a value outside "
                         f"would give inf or NaN), got {value}")


def check_transform_products(transform: LogitTransform, scale: str = "logit_scale", softcap: str = "softcap") -> None:
    """The products of a logit transform's options that the kernels take (``LogitTransform.kernel_args``), each
    within FP32_SAFE_RANGE; ``scale`` / ``softcap`` name the options in the error."""
    factor, u_per_x, cap = transform.kernel_args()
    check_fp32_safe(f"{scale} / temperature", factor)
    if transform.softcap is not None:
        check_fp32_safe(f"{softcap} / temperature", cap)
        check_fp32_safe(f"{scale} / {softcap}", u_per_x)


def check_ignore_index(value: Any) -> int:
    """``value`` as an int that int64 labels can equal (a larger one would overflow the comparison with them): any
    integer (a Python or numpy int; not a bool or a float), else a ValueError."""
    try:
        index = operator.index(value)
    except TypeError:
        index = None
    if isinstance(value, bool) or index is None or not -(2**63) <= index < 2**63:
        raise ValueError(f"ignore_index must be an integer in the int64 range, got {value!r}")
    return index


def is_process_group(value: Any) -> bool:
    """Whether ``value`` is a torch.distributed process group (where torch.distributed is built)."""
    import torch.distributed as dist

    return dist.is_available() and isinstance(value, dist.ProcessGroup)


def is_finite(value: float) -> bool:
    """math.isfinite in comparisons, which torch.compile traces for a float it made symbolic (a changing
    temperature or scaling), where math.isfinite breaks the graph."""
    return value == value and value not in (math.inf, -math.inf)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LossOptions)}
