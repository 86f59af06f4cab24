"""Triton kernel: d(loss)/d(logits) of a chunk from the epilogue's E = exp(z - k) (the Hopper path, exp_epilogue.py).

With E_ij = 2^(log2e z_ij - k_it) (bf16) for column j in tile t = j // tile_n, lse_i the row's log-sum-exp and
zl the z-loss coefficient, the softmax and the gradient of loss_i = lse_i - z_i,target + zl lse_i^2 are::

    p_ij = E_ij * 2^(k_it - log2e lse_i)
    dloss_i / dz_ij = p_ij (1 + 2 zl lse_i) - [j == target_i]

the target column's p from the accumulator's fp32 z_i,target instead (exp(z - lse)), so that p - 1 does not
cancel E's rounding into a large relative error where p is near 1. Times the row's gradient scale (grad_scale,
and row_scale per row), rounded once to the output dtype. The output may alias E (each element is read, then
written, by the same thread: tests/kernels/test_in_place.py). Grid: (rows, cdiv(V, BLOCK_V)); row offsets int64.
A block holds whole sub-tiles of SUB_N columns, so the factor 2^(k - log2e lse) (times the z-loss term and the
scale) is one exp2 per sub-tile, not one per element, and E's elements cost a multiply each.
"""
import torch
import triton
import triton.language as tl

from ..exp_epilogue import ExpStats
from ..loss_terms import LossTerms
from .args import check_like, check_target, check_vector
from .online import LOG2E


@triton.jit
def _grad_from_exp_kernel(
    e_ptr,
    e_row_stride,
    grad_ptr,
    grad_row_stride,
    k_ptr,
    target_logit_ptr,
    target_ptr,
    lse_ptr,
    row_scale_ptr,
    n_cols,
    n_tiles,
    grad_scale,
    z_loss,
    TILE_N: tl.constexpr,
    SUB_N: tl.constexpr,
    PER_ROW_SCALE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # The block is (BLOCK_V / SUB_N) sub-rows of SUB_N columns, SUB_N a power of two that divides TILE_N: each
    # sub-row lies in one tile, so its factor 2^(k - log2e lse) is one exp2 and one load per SUB_N elements.
    grad_scale = tl.cast(grad_scale, tl.float32)
    z_loss = tl.cast(z_loss, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    sub_start = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V // SUB_N) * SUB_N
    cols = sub_start[:, None] + tl.arange(0, SUB_N)[None, :]
    mask = cols < n_cols
    e = tl.load(e_ptr + row * e_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row)
    k = tl.load(k_ptr + row * n_tiles + sub_start // TILE_N, mask=sub_start < n_cols, other=0.0)
    scale = grad_scale
    if PER_ROW_SCALE:
        scale = scale * tl.load(row_scale_ptr + row)
    z_factor = 1.0 + 2.0 * z_loss * lse
    grad = e * (tl.exp2(k - lse * LOG2E) * (z_factor * scale))[:, None]
    target = tl.load(target_ptr + row)
    p_target = tl.exp2((tl.load(target_logit_ptr + row) - lse) * LOG2E)
    grad = tl.where(cols == target, (p_target * z_factor - 1.0) * scale, grad)
    tl.store(grad_ptr + row * grad_row_stride + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)


def grad_from_exp(
    e: torch.Tensor,
    out: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    stats: ExpStats,
    *,
    terms: LossTerms,
    grad_scale: float,
    row_scale: torch.Tensor | None,
) -> None:
    """Write d(loss)/d(logits) of a (rows, V) chunk, given as the epilogue's E and ``stats``, into ``out`` (which
    may be ``e`` itself), times ``grad_scale`` (and ``row_scale``)."""
    rows, n_cols = e.shape
    check_target(target, rows, e.device, "grad_from_exp")
    check_vector(lse, rows, e.device, "grad_from_exp", "lse")
    check_vector(row_scale, rows, e.device, "grad_from_exp", "row_scale")
    check_vector(stats.target_logit, rows, e.device, "grad_from_exp", "stats.target_logit")
    check_like(out, e, "grad_from_exp", "out")
    assert terms.class_weight is None and not terms.smooths, "the exp epilogue serves the plain loss (plan.py)"
    assert stats.k.shape == (rows, n_cols // stats.tile_n) and stats.k.is_contiguous() and n_cols % stats.tile_n == 0
    if rows == 0:
        return
    assert e.stride(1) == 1
    block_v = min(triton.next_power_of_2(n_cols), 2048)
    _grad_from_exp_kernel[(rows, triton.cdiv(n_cols, block_v))](
        e,
        e.stride(0),
        out,
        out.stride(0),
        stats.k,
        stats.target_logit,
        target,
        lse,
        row_scale if row_scale is not None else lse,
        n_cols,
        stats.k.shape[1],
        float(grad_scale),
        float(terms.z_loss),
        TILE_N=stats.tile_n,
        SUB_N=stats.tile_n & -stats.tile_n,  # (the largest power of two dividing it: 128 of 128, 64 of 192)
        PER_ROW_SCALE=row_scale is not None,
        BLOCK_V=block_v,
        num_warps=8 if block_v >= 2048 else 4,
    )
