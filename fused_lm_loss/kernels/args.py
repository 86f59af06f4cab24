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
        described = (
            f"dtype={target.dtype}, shape={tuple(target.shape)}, stride={target.stride()}, device={target.device}"
            if isinstance(target, torch.Tensor)
            else type(target).__name__
        )
        raise ValueError(
            f"{caller}: target must be a contiguous 1-d int64 tensor of {rows} rows on {device}, got {described}"
        )


def check_class_weight(class_weight: torch.Tensor | None, n_cols: int, device: torch.device, caller: str) -> None:
    """Class weights, when given, are read by the kernels as a contiguous (V,) fp32 vector on the logits' device."""
    if class_weight is None:
        return
    if not (
        isinstance(class_weight, torch.Tensor)
        and class_weight.dtype == torch.float32
        and class_weight.shape == (n_cols,)
        and class_weight.is_contiguous()
        and class_weight.device == device
    ):
        described = (
            f"dtype={class_weight.dtype}, shape={tuple(class_weight.shape)}, stride={class_weight.stride()}, "
            f"device={class_weight.device}"
            if isinstance(class_weight, torch.Tensor)
            else type(class_weight).__name__
        )
        raise ValueError(
            f"{caller}: class_weight must be a contiguous (V,) = ({n_cols},) fp32 tensor on {device}, got {described}"
        )


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors view one storage: a kernel that writes one while other threads still read the other
    must order them (a barrier), since Triton orders no global accesses across a program's threads."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
