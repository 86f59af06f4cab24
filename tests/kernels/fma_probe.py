"""A one-element ``tl.fma`` (conftest.interpreter_rounds_fma_twice). Its own module: Triton 3.1's interpreter
needs ``triton.language`` among the kernel's globals."""
import torch
import triton
import triton.language as tl


@triton.jit
def _fma_kernel(xyz_ptr, out_ptr):
    tl.store(out_ptr, tl.fma(tl.load(xyz_ptr), tl.load(xyz_ptr + 1), tl.load(xyz_ptr + 2)))


def fma_of(x: float, y: float, z: float) -> float:
    """fl(x * y + z) as ``tl.fma`` computes it in fp32 (x, y, z rounded to fp32 first)."""
    out = torch.empty(1)
    _fma_kernel[(1,)](torch.tensor([x, y, z], dtype=torch.float32), out)
    return float(out)
