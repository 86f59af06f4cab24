"""CuTe DSL GEMM epilogue (quack-kernels' epilogue frontend): E = exp(z - k) with one offset per row where it can.

Imported only where the ``[hopper]`` extra is installed (exp_epilogue.py). Per row i and tile t of ``tile_n``
columns of the fp32 accumulator z, given the row's offset c_i (kernels/row_offset.py)::

    m_it = roundeven(log2e * max_{j in t} z_ij)            the tile's own exponent (a prepass over the accumulator)
    k_it = max(c_i, m_it - HEADROOM)                        so E <= 2^(HEADROOM + 1/2): never overflows
    E_ij = bf16(2^(log2e z_ij - k_it))   s_it = sum_{j in t} 2^(log2e z_ij - k_it)   z_i,target (fp32)

and m_it is written out (``k``), from which the host forms k_it the same way. Where every tile of a row takes c_i
(no tile's max is more than HEADROOM above it: a target logit within ~44 nats of the row's max) the row's E share
one offset, so G = f_i E_i with one factor per row and the gradient GEMMs read E itself (grad_from_exp.py).
"""
import cutlass.cute as cute
from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.math import pexp2
from quack.epilogue.ops import ColVecLoad, ColVecReduce, ColVecSelect
from quack.epilogue.scaled_exp import MaxLog2

from ..exp_epilogue import HEADROOM, LOG2E

_tile_max = MaxLog2("max_log2")
_target = ColVecLoad("target")


def _prepass(acc):
    return {"max_log2": acc}


@gemm_epilogue(
    ops={"max_log2": _tile_max, "row_k": ColVecLoad("row_k")},
    prepass=_prepass,
    prepass_outs=("max_log2",),
    reduces={"sum_exp": ColVecReduce("sum_exp")},
    outs={"target_logit": ColVecSelect("target_logit", idx_op=_target)},
    extra_ops=(_tile_max.out("max_log2_out"), _target),
)
def shared_offset_exp(acc, max_log2, row_k):
    k = cute.arch.fmax(max_log2 - HEADROOM, row_k)
    e = pexp2(acc * LOG2E - k)
    return {"D": e, "sum_exp": e, "target_logit": acc}
