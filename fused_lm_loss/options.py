"""The loss options, validated once (``ValueError`` for anything out of range)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

REDUCTIONS = ("mean", "sum", "none")
MATMUL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, eq=False)  # (class_weight is a tensor: options compare by identity)
class LossOptions:
    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None
    logit_scale: float = 1.0
    chunk_size: int | None = None
    accum_dtype: torch.dtype | None = torch.float32
    logits_dtype: torch.dtype | None = None
    grad_scaler: Any = None
    process_group: Any = None
    vocab_start: int | None = None
    vocab_size: int | None = None
    reduce_grad_input: bool = True
    class_weight: Any = None  # a (V,) float tensor: the weight of each class, as F.cross_entropy's weight=
    return_z_loss: bool = False
    return_token_accuracy: bool = False
    keep_logits: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise ValueError(f"ignore_index must be an int, got {self.ignore_index!r}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        _check_real("label_smoothing", self.label_smoothing)
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing}")
        _check_real("z_loss", self.z_loss)
        if self.z_loss < 0.0:
            raise ValueError(f"z_loss must be >= 0, got {self.z_loss}")
        if self.softcap is not None:
            _check_real("softcap", self.softcap)
            if self.softcap <= 0.0:
                raise ValueError(f"softcap must be > 0 or None, got {self.softcap}")
        _check_real("logit_scale", self.logit_scale)
        if self.logit_scale <= 0.0:
            raise ValueError(f"logit_scale must be > 0, got {self.logit_scale}")
        if self.chunk_size is not None:
            if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1:
                raise ValueError(f"chunk_size must be a positive int or None, got {self.chunk_size!r}")
        if self.accum_dtype is not None and self.accum_dtype not in MATMUL_DTYPES:
            raise ValueError(f"accum_dtype must be None or one of {MATMUL_DTYPES}, got {self.accum_dtype!r}")
        if self.logits_dtype not in (None, torch.float32):
            raise ValueError(f"logits_dtype must be None (the matmul dtype) or torch.float32, got {self.logits_dtype!r}")
        if self.grad_scaler is not None and not callable(getattr(self.grad_scaler, "get_scale", None)):
            raise ValueError("grad_scaler must be None or have a get_scale() method (e.g. torch.amp.GradScaler)")
        if self.process_group is None and (self.vocab_start is not None or self.vocab_size is not None):
            raise ValueError("vocab_start / vocab_size describe a vocab shard and need a process_group")
        if self.vocab_start is not None and (not isinstance(self.vocab_start, int) or self.vocab_start < 0):
            raise ValueError(f"vocab_start must be an int >= 0, got {self.vocab_start!r}")
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or self.vocab_size < 1):
            raise ValueError(f"vocab_size must be an int >= 1, got {self.vocab_size!r}")
        if (self.vocab_start is None) != (self.vocab_size is None):
            raise ValueError("give vocab_start and vocab_size together (unequal shards), or neither (equal shards)")
        if self.class_weight is not None:
            weight = self.class_weight
            if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not weight.is_floating_point():
                raise ValueError(f"class_weight must be a 1-d float tensor of one weight per class, got {weight!r}")
            if self.process_group is not None:
                raise ValueError("class_weight is not supported with vocab parallelism (process_group)")
        if self.return_token_accuracy and self.process_group is not None:
            raise ValueError("return_token_accuracy is not supported with vocab parallelism (process_group)")
        for name in ("return_z_loss", "return_token_accuracy", "keep_logits"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")


def _check_real(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
