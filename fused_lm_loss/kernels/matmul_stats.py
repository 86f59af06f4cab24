"""Triton kernel: the logits matmul with the row statistics in its epilogue (no logits in memory).

For a forward pass without gradients the logits are only needed for their row statistics, so each
program computes one (BLOCK_M x BLOCK_N) tile of x = h @ W.T (+ b) in fp32 registers, rounds it to the
matmul dtype exactly as the cuBLAS path stores it (unless fp32 logits were asked for), and reduces the
tile to the per-row partials that ``row_stats`` computes per column segment::

    m_it = max_j z_ij     s_it = sum_j exp(z_ij - m_it)     t_it = z_i,target (0 outside the tile)     sum_it = sum_j z_ij

(z: the loss-space logits, see ``row_stats``). The merge kernel of ``row_stats`` then combines a row's
tiles like its segments. This removes the write and the read of the logits chunk: at H = 896 a separate
stats pass costs ~24% of the matmul (benchmarks/RESULTS.md).

Tiles are visited in groups of GROUP_M row tiles per sweep over the vocabulary, so a W tile is read from
HBM once per group rather than once per row tile.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .row_stats import merge_partials
from .softcap import apply_softcap


@triton.jit
def _matmul_stats_kernel(
    h_ptr,
    w_ptr,
    bias_ptr,
    target_ptr,
    partial_ptr,
    n_rows,
    n_cols,
    hidden,
    h_row_stride,
    w_row_stride,
    logit_scale,
    softcap,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    ROUND_LOGITS: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(n_rows, BLOCK_M)
    tiles_n = tl.cdiv(n_cols, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % (GROUP_M * tiles_n)) % group_rows
    tile_n = (pid % (GROUP_M * tiles_n)) // group_rows

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    a_ptrs = h_ptr + rows[:, None].to(tl.int64) * h_row_stride + ks[None, :]
    b_ptrs = w_ptr + cols[:, None].to(tl.int64) * w_row_stride + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        k_ok = (k + ks) < hidden
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if INTERPRETED:  # exact fp32 copies: the CPU interpreter mis-multiplies bf16 dot operands (triton 3.9)
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if ROUND_LOGITS:  # the value the cuBLAS path would store in the matmul dtype
        if INTERPRETED and h_ptr.dtype.element_ty == tl.bfloat16:  # its fp32 -> bf16 is not round-to-nearest
            bits = acc.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            acc = bits.to(tl.float32, bitcast=True)
        else:
            acc = acc.to(h_ptr.dtype.element_ty).to(tl.float32)
    z = acc * logit_scale
    if HAS_SOFTCAP:
        z = apply_softcap(z, softcap)

    z_valid = tl.where(col_ok[None, :], z, float("-inf"))
    tile_max = tl.max(z_valid, axis=1)
    tile_sumexp = tl.sum(tl.exp(z_valid - tile_max[:, None]), axis=1)
    tile_sum = tl.sum(tl.where(col_ok[None, :], z, 0.0), axis=1)
    target = tl.load(target_ptr + rows, mask=row_ok, other=-1)
    z_target = tl.sum(tl.where(cols[None, :] == target[:, None], z, 0.0), axis=1)

    out = partial_ptr + tile_n * n_rows + rows
    stride = tiles_n * n_rows
    tl.store(out, tile_max, mask=row_ok)
    tl.store(out + stride, tile_sumexp, mask=row_ok)
    tl.store(out + 2 * stride, z_target, mask=row_ok)
    tl.store(out + 3 * stride, tile_sum, mask=row_ok)


#: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) on a GPU; the interpreter uses small tiles.
MATMUL_CONFIG = (128, 256, 64, 8, 8, 3)


def _config(hidden: int) -> tuple:
    block_m, block_n, block_k, group_m, warps, stages = MATMUL_CONFIG
    return block_m, block_n, max(16, min(block_k, triton.next_power_of_2(hidden))), group_m, warps, stages


def partial_bytes_per_row(n_cols: int) -> int:
    """Memory per token row: the four fp32 partials of each vocabulary tile."""
    return 16 * triton.cdiv(n_cols, MATMUL_CONFIG[1])


def matmul_partials(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    *,
    logit_scale: float,
    softcap: float | None,
    round_logits: bool,
) -> torch.Tensor:
    """Per-(row, vocab tile) partials (4, tiles, rows) of z = softcap(scale * (hidden @ weight.T + bias))."""
    rows, h = hidden.shape
    n_cols = weight.shape[0]
    assert hidden.stride(1) == 1 and weight.stride(1) == 1 and hidden.dtype == weight.dtype
    block_m, block_n, block_k, group_m, warps, stages = _config(h)
    tiles_n = triton.cdiv(n_cols, block_n)
    partial = torch.empty((4, tiles_n, rows), dtype=torch.float32, device=hidden.device)
    _matmul_stats_kernel[(triton.cdiv(rows, block_m) * tiles_n,)](
        hidden,
        weight,
        bias if bias is not None else weight,
        target,
        partial,
        rows,
        n_cols,
        h,
        hidden.stride(0),
        weight.stride(0),
        float(logit_scale),
        float(softcap or 1.0),
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=softcap is not None,
        ROUND_LOGITS=round_logits,
        INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=group_m,
        num_warps=warps,
        num_stages=stages,
    )
    return partial


def matmul_row_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    *,
    logit_scale: float,
    softcap: float | None,
    need_sum: bool,
    round_logits: bool = True,
) -> tuple[torch.Tensor, ...]:
    """(max, sumexp, target_logit, logit_sum) of each row of hidden @ weight.T (+ bias), as ``row_stats``."""
    if hidden.shape[0] == 0:
        return torch.empty((4, 0), dtype=torch.float32, device=hidden.device).unbind(0)
    partial = matmul_partials(
        hidden, weight, bias, target, logit_scale=logit_scale, softcap=softcap, round_logits=round_logits
    )
    return merge_partials(partial)


def matmul_row_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    loss_out: torch.Tensor,
    lse_out: torch.Tensor,
    *,
    logit_scale: float,
    softcap: float | None,
    label_smoothing: float,
    z_loss: float,
    vocab_size: int,
    round_logits: bool = True,
) -> None:
    """Per-row loss and lse of hidden @ weight.T (+ bias), never storing the logits (see ``row_losses``)."""
    if hidden.shape[0] == 0:
        return
    partial = matmul_partials(
        hidden, weight, bias, target, logit_scale=logit_scale, softcap=softcap, round_logits=round_logits
    )
    merge_partials(
        partial, loss_out=loss_out, lse_out=lse_out, label_smoothing=label_smoothing, z_loss=z_loss, vocab_size=vocab_size
    )
