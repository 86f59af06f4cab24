"""Triton helper shared by the kernels: the softcap transform z -> c * tanh(z / c).

tanh is written with exp so that it works on every Triton version and in the interpreter:
tanh(u) = 1 - 2 / (exp(2u) + 1), exact at both saturations (exp -> inf gives 1, exp -> 0 gives -1).
Its absolute error near u = 0 is ~1e-7, i.e. ~c * 1e-7 on the capped logit, far below bf16 logit rounding.
"""
import triton
import triton.language as tl


@triton.jit
def tanh(u):
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


@triton.jit
def apply_softcap(z, softcap):
    return softcap * tanh(z / softcap)
