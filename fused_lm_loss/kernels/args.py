"""Host-side checks of the kernel launchers: cheap checks of the tensors a kernel would otherwise misread."""
from __future__ import annotations

import torch


def check_target(target: torch.Tensor, rows: int, device: torch.device, caller: str) -> None:
    """The chunk loop passes each chunk's targets as a contiguous (rows,) int64 tensor on the logits' device;
    a kernel would read anything else as garbage (or out of bounds), so refuse it here."""
    if not (
        isinstance(target, torch.Tensor)
        and target.dtype == torch.int64
        and target.dim() == 1
        and target.shape[0] == rows
        and target.is_contiguous()
        and target.device == device
    ):
        raise ValueError(f"{caller}: target must be a contiguous 1-d int64 tensor of {rows} rows on {device}, "
                         f"got {_described(target)}")


def check_class_weight(class_weight: torch.Tensor | None, n_cols: int, device: torch.device, caller: str) -> None:
    """Class weights, when given, are read by the kernels as a contiguous (V,) fp32 vector on the logits' device."""
    if class_weight is not None:
        check_vector(class_weight, n_cols, device, caller, "class_weight")


def check_vector(t: torch.Tensor | None, length: int, device: torch.device, caller: str, name: str) -> None:
    """A per-row (lse, row_scale, a loss output) or per-class fp32 vector, which the kernels read or write at
    ``t + i``: it must be a contiguous (length,) fp32 tensor on the logits' device (None: absent)."""
    if t is None:
        return
    if not (
        isinstance(t, torch.Tensor)
        and t.dtype == torch.float32
        and t.shape == (length,)
        and t.stride() == (1,)
        and t.device == device
    ):
        raise ValueError(f"{caller}: {name} must be a contiguous ({length},) fp32 tensor on {device}, "
                         f"got {_described(t)}")


def check_like(out: torch.Tensor | None, logits: torch.Tensor, caller: str, name: str) -> None:
    """An output the kernel writes row by row over the logits' (rows, V): that shape and device, unit column
    stride (None: absent)."""
    if out is None:
        return
    if not (
        isinstance(out, torch.Tensor)
        and out.shape == logits.shape
        and out.stride(1) == 1
        and out.device == logits.device
    ):
        raise ValueError(f"{caller}: {name} must be a {tuple(logits.shape)} tensor with unit column stride on "
                         f"{logits.device}, got {_described(out)}")


def _described(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"dtype={t.dtype}, shape={tuple(t.shape)}, stride={t.stride()}, device={t.device}"


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors view one storage: a kernel that writes one while other threads still read the other
    must order them (a barrier), since Triton orders no global accesses across a program's threads."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
