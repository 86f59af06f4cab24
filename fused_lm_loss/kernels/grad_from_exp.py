"""Triton kernel: d(loss)/d(logits) of a chunk as one factor per row times the epilogue's E (the Hopper path).

With E_ij = 2^(log2e z_ij - k_it) (bf16) for column j in tile t = j // tile_n, lse_i the row's log-sum-exp, zl the
z-loss coefficient and s_i the row's gradient scale (grad_scale, times row_scale), the gradient of
loss_i = lse_i - z_i,target + zl lse_i^2 is::

    G_ij = s_i (p_ij (1 + 2 zl lse_i) - [j == target_i]),    p_ij = E_ij 2^(k_it - log2e lse_i)

Each row is brought to one offset K_i = max_t k_it, so that G_i = f_i E_i with one fp32 factor per row::

    f_i = 2^(K_i - log2e lse_i) (1 + 2 zl lse_i) s_i                       (returned; without the z-loss term
                                                                              where it is 0, E's other columns 0)
    E_ij <- E_ij 2^(k_it - K_i)                                             (exact: a power of two; only rows whose
                                                                              tiles differ, rare: kernels/exp_gemm.py)
    E_i,target <- G_i,target / f_i                                          (0 where f_i is 0)

G_i,target from the accumulator's fp32 z_i,target (exp(z - lse)), so that p - 1 does not cancel E's rounding; E's
other elements are not rewritten, and the gradient GEMMs take E with f on their rows-sized side (chunked.py):
dX = f (E @ W), dW = E^T (f h). No pass over the chunk: one program per row reads its k and writes one element,
except where the row's tiles took different offsets (each element then read and written by the same thread:
tests/kernels/test_in_place.py).
"""
import torch
import triton
import triton.language as tl

from ..exp_epilogue import ExpStats
from ..loss_terms import LossTerms
from .args import check_target, check_vector
from .online import LOG2E


@triton.jit
def _grad_from_exp_kernel(
    e_ptr,
    e_row_stride,
    factor_ptr,
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
    BLOCK_TILES: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    grad_scale = tl.cast(grad_scale, tl.float32)
    z_loss = tl.cast(z_loss, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    tiles = tl.arange(0, BLOCK_TILES)
    k = tl.load(k_ptr + row * n_tiles + tiles, mask=tiles < n_tiles, other=-float("inf"))
    k_top = tl.max(k, axis=0)
    k_low = tl.min(tl.where(tiles < n_tiles, k, float("inf")), axis=0)
    lse = tl.load(lse_ptr + row)
    scale = grad_scale
    if PER_ROW_SCALE:
        scale = scale * tl.load(row_scale_ptr + row)
    z_factor = 1.0 + 2.0 * z_loss * lse
    # where 1 + 2 zl lse is 0 only the target column's G is left: f leaves that factor out, and E's other columns
    # become 0 (with it in f, f would be 0 and could not carry the target's -s)
    folded = z_factor != 0.0
    base = tl.exp2(k_top - lse * LOG2E) * scale
    factor = tl.where(folded, base * z_factor, base)
    tl.store(factor_ptr + row, factor)
    target = tl.load(target_ptr + row)
    p_target = tl.exp2((tl.load(target_logit_ptr + row) - lse) * LOG2E)
    nonzero = factor != 0.0
    e_target = tl.where(nonzero, (p_target * z_factor - 1.0) * scale / tl.where(nonzero, factor, 1.0), 0.0)
    if (k_low < k_top) | (z_factor == 0.0):  # tiles with offsets of their own: moved to k_top, in whole sub-tiles
        keep = tl.where(folded, 1.0, 0.0)
        for start in range(0, n_cols, BLOCK_V):
            sub_start = start + tl.arange(0, BLOCK_V // SUB_N) * SUB_N
            cols = sub_start[:, None] + tl.arange(0, SUB_N)[None, :]
            mask = cols < n_cols
            e = tl.load(e_ptr + row * e_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
            k_tile = tl.load(k_ptr + row * n_tiles + sub_start // TILE_N, mask=sub_start < n_cols, other=0.0)
            e = tl.where(cols == target, e_target, e * (tl.exp2(k_tile - k_top) * keep)[:, None])
            tl.store(e_ptr + row * e_row_stride + cols, e.to(e_ptr.dtype.element_ty), mask=mask)
    elif target >= 0:
        tl.store(e_ptr + row * e_row_stride + target, e_target.to(e_ptr.dtype.element_ty))


def grad_from_exp(
    e: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    stats: ExpStats,
    *,
    terms: LossTerms,
    grad_scale: float,
    row_scale: torch.Tensor | None,
) -> torch.Tensor:
    """Make the epilogue's E of a (rows, V) chunk, in place, the gradient d(loss)/d(logits) up to one factor per row,
    times ``grad_scale`` (and ``row_scale``): returns the (rows,) fp32 factors f, G = f[:, None] * E (see the
    module)."""
    rows, n_cols = e.shape
    check_target(target, rows, e.device, "grad_from_exp")
    check_vector(lse, rows, e.device, "grad_from_exp", "lse")
    check_vector(row_scale, rows, e.device, "grad_from_exp", "row_scale")
    check_vector(stats.target_logit, rows, e.device, "grad_from_exp", "stats.target_logit")
    assert terms.class_weight is None and not terms.smooths, "the exp epilogue serves the plain loss (plan.py)"
    assert stats.k.shape == (rows, n_cols // stats.tile_n) and stats.k.is_contiguous() and n_cols % stats.tile_n == 0
    factor = torch.empty(rows, dtype=torch.float32, device=e.device)
    if rows == 0:
        return factor
    assert e.stride(1) == 1
    block_v = min(triton.next_power_of_2(n_cols), 2048)
    _grad_from_exp_kernel[(rows,)](
        e,
        e.stride(0),
        factor,
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
        BLOCK_TILES=triton.next_power_of_2(stats.k.shape[1]),
        BLOCK_V=block_v,
        num_warps=8 if block_v >= 2048 else 4,
    )
    return factor
