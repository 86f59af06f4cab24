"""Triton kernel: a gradient made in forward times backward's factor, read from device memory (no host sync).

Backward of the mean / sum loss multiplies the saved gradients by f = grad_output / scaling. Reading f on the host
would wait for the whole forward to finish and leave the GPU idle while the host queues what follows (0.3-0.8 ms
per step at small hidden sizes, benchmarks/NOTES.md). Here f stays on the device::

    out = x * f                 fp32 math (fp64 for fp64 x), rounded once to out's dtype (to nearest even)
    out is x and f == 1:        nothing is read or written: the saved gradient is returned as it is

``f`` is a float64 scalar tensor (grad_output / scaling in float64, as the host path computes it); the product uses
fp32(f), as ``torch.mul`` by a Python float does. A grid of at most ``MAX_PROGRAMS`` programs walks x BLOCK
elements at a time, with int64 offsets (an lm_head gradient can pass 2**31 elements).
"""
import torch
import triton
import triton.language as tl

BLOCK = 4096
MAX_PROGRAMS = 1024


@triton.jit
def _scale_grad_kernel(x_ptr, out_ptr, factor_ptr, n, IN_PLACE: tl.constexpr, WIDE: tl.constexpr,
                       TO_BF16: tl.constexpr, BLOCK: tl.constexpr):
    factor64 = tl.load(factor_ptr)
    if (not IN_PLACE) or (factor64 != 1.0):
        factor = factor64 if WIDE else factor64.to(tl.float32)
        pid = tl.program_id(0).to(tl.int64)
        stride = tl.num_programs(0).to(tl.int64) * BLOCK
        offsets = tl.arange(0, BLOCK).to(tl.int64)
        for it in range(0, tl.cdiv(n - pid * BLOCK, stride)):
            idx = pid * BLOCK + it * stride + offsets
            in_range = idx < n
            x = tl.load(x_ptr + idx, mask=in_range, other=0.0)
            x = x.to(tl.float64) if WIDE else x.to(tl.float32)
            y = x * factor
            if TO_BF16:
                tl.store(out_ptr + idx, _bf16_nearest_even(y), mask=in_range)
            else:
                tl.store(out_ptr + idx, y.to(out_ptr.dtype.element_ty), mask=in_range)


@triton.jit
def _bf16_nearest_even(y):
    """fp32 -> bf16 rounded to nearest, ties to even, in integer arithmetic: what the GPU's conversion does, and
    what the Triton interpreter's (a truncation) does not, so the CPU tests see the GPU's rounding."""
    bits = y.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    rounded = tl.where(y != y, (bits >> 16) | 0x40, rounded)  # NaN stays a (quiet) NaN
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


def scale_grad(x: torch.Tensor, factor: torch.Tensor, out: torch.Tensor) -> None:
    """out = x * factor (``out`` may be ``x``: in place, skipped when factor == 1); x and out contiguous, of one
    shape and device; factor a float64 scalar tensor there."""
    if not (x.is_contiguous() and out.is_contiguous() and out.shape == x.shape and out.device == x.device):
        raise ValueError(f"scale_grad: x and out must be contiguous tensors of one shape and device, got "
                         f"{tuple(x.shape)} {x.device} and {tuple(out.shape)} {out.device}")
    if not (factor.dtype == torch.float64 and factor.numel() == 1 and factor.device == x.device):
        raise ValueError(f"scale_grad: factor must be a float64 scalar tensor on {x.device}, got "
                         f"{factor.dtype} {tuple(factor.shape)} {factor.device}")
    n = x.numel()
    if n == 0:
        return
    grid = (min(triton.cdiv(n, BLOCK), MAX_PROGRAMS),)
    _scale_grad_kernel[grid](x, out, factor, n, IN_PLACE=out.data_ptr() == x.data_ptr(),
                             WIDE=x.dtype == torch.float64 or out.dtype == torch.float64,
                             TO_BF16=out.dtype == torch.bfloat16 and x.dtype != torch.float64, BLOCK=BLOCK, num_warps=4)
