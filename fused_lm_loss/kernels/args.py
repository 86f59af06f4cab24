"""Host-side helpers of the kernel launchers: cheap checks of the tensors they are given."""
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
