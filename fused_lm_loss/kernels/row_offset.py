"""Triton kernel: the Hopper epilogue's shared exponent offset per row, from the row's target logit.

For row i with label t_i (a column of this weight; a negative label reads column 0)::

    c_i = floor(log2e * (h_i . W[t_i]))      fp32, the dot product in fp32 from the bf16 / fp16 operands
    c_i = -inf                                where that is not finite

Any logit of the row is at most the row's max, so c_i is a lower bound of log2e * max_j z_ij (up to the order of
the dot product's sum): E = 2^(log2e z - c) then never loses the row's large values to underflow, and the epilogue's
``max(c, k_tile - HEADROOM)`` bounds it above (exp_epilogue.py). -inf (a NaN or infinite logit) leaves each tile
its own offset. Grid: (rows,); one program reads one row of h and one of W.
"""
import torch
import triton
import triton.language as tl

from .. import exp_epilogue
from .args import check_target
from .online import LOG2E


@triton.jit
def _row_offset_kernel(h_ptr, h_row_stride, w_ptr, w_row_stride, target_ptr, out_ptr, n_cols,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    target = tl.maximum(tl.load(target_ptr + row), 0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        h = tl.load(h_ptr + row * h_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + target * w_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        acc += h * w
    offset = tl.math.floor(tl.sum(acc, axis=0) * LOG2E)
    finite = tl.abs(offset) < float("inf")  # (False for NaN too)
    tl.store(out_ptr + row, tl.where(finite, offset, -float("inf")))


def row_offset(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(rows,) fp32: floor(log2e * hidden[i] . weight[target[i]]), -inf where not finite (see the module)."""
    rows, n_cols = hidden.shape
    check_target(target, rows, hidden.device, "row_offset")
    assert hidden.stride(1) == 1 and weight.stride(1) == 1 and weight.shape[1] == n_cols
    out = torch.empty(rows, dtype=torch.float32, device=hidden.device)
    if rows:
        _row_offset_kernel[(rows,)](hidden, hidden.stride(0), weight, weight.stride(0), target, out, n_cols,
                                    BLOCK=min(triton.next_power_of_2(max(n_cols, 16)), 1024))
    return out


def row_offset_reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The same in PyTorch (CPU)."""
    z = (hidden.float() * weight[target.clamp(min=0)].float()).sum(1)
    offset = torch.floor(z * exp_epilogue.LOG2E)
    return torch.where(torch.isfinite(offset), offset, torch.full_like(offset, -float("inf")))
