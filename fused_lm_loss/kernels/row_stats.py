"""Triton kernel: per-row softmax statistics of one logits chunk.

For each row ``i`` of the raw logits chunk ``x`` (the matmul output, any float dtype) the kernel
forms the loss-space logits in fp32::

    z_ij = logit_scale * x_ij                                  (no softcap)
    z_ij = softcap * tanh(logit_scale * x_ij / softcap)         (softcap)

and, in one pass over the row with an online softmax, writes four fp32 numbers::

    row_max[i]      = m_i   = max_j z_ij
    row_sumexp[i]   = s_i   = sum_j exp(z_ij - m_i)          (so lse_i = m_i + log s_i)
    target_logit[i] = z_i,t  with t = target[i]  (0 when t < 0: target outside this vocab shard)
    logit_sum[i]    = sum_j z_ij                 (only when NEED_SUM: label smoothing needs mean z)

The four are returned separately (not as lse) so that vocab-parallel shards can merge them:
max by all-reduce(MAX), then s_i * exp(m_i - M_i), target and sum by all-reduce(SUM).
One program handles one row; row offsets are int64 because rows x V passes 2**31.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .softcap import apply_softcap


@triton.jit
def online_row_stats(
    row_ptr, n_cols, logit_scale, softcap, HAS_SOFTCAP: tl.constexpr, NEED_SUM: tl.constexpr, BLOCK_V: tl.constexpr
):
    """(max, sum-exp relative to max, sum) of one row's loss-space logits, one read of the row."""
    offsets = tl.arange(0, BLOCK_V)
    running_max = float("-inf")
    running_sumexp = 0.0
    running_sum = 0.0
    for start in range(0, n_cols, BLOCK_V):
        cols = start + offsets
        mask = cols < n_cols
        z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32) * logit_scale
        if HAS_SOFTCAP:
            z = apply_softcap(z, softcap)
        if NEED_SUM:
            running_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
        z = tl.where(mask, z, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        running_sumexp = running_sumexp * tl.exp(running_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
        running_max = new_max
    return running_max, running_sumexp, running_sum


@triton.jit
def target_logit(row_ptr, target, logit_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """z_i,t of the row (0 when target < 0, i.e. the class lives in another vocab shard)."""
    has_target = target >= 0
    z = tl.load(row_ptr + tl.where(has_target, target, 0)).to(tl.float32) * logit_scale
    if HAS_SOFTCAP:
        z = apply_softcap(z, softcap)
    return tl.where(has_target, z, 0.0)


@triton.jit
def _row_stats_kernel(
    logits_ptr,
    logits_row_stride,
    target_ptr,
    stats_ptr,
    n_rows,
    n_cols,
    logit_scale,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    NEED_SUM: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    row_max, row_sumexp, row_sum = online_row_stats(
        row_ptr, n_cols, logit_scale, softcap, HAS_SOFTCAP, NEED_SUM, BLOCK_V
    )
    z_target = target_logit(row_ptr, tl.load(target_ptr + row), logit_scale, softcap, HAS_SOFTCAP)
    tl.store(stats_ptr + row, row_max)
    tl.store(stats_ptr + n_rows + row, row_sumexp)
    tl.store(stats_ptr + 2 * n_rows + row, z_target)
    tl.store(stats_ptr + 3 * n_rows + row, row_sum)


def row_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    logit_scale: float,
    softcap: float | None,
    need_sum: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the stats kernel on a (rows, V) logits chunk; returns (max, sumexp, target_logit, logit_sum), fp32."""
    rows, n_cols = logits.shape
    assert logits.stride(1) == 1
    stats = torch.empty((4, rows), dtype=torch.float32, device=logits.device)
    if rows > 0:
        block_v = min(triton.next_power_of_2(n_cols), 4096)
        _row_stats_kernel[(rows,)](
            logits,
            logits.stride(0),
            target,
            stats,
            rows,
            n_cols,
            float(logit_scale),
            float(softcap or 1.0),
            HAS_SOFTCAP=softcap is not None,
            NEED_SUM=need_sum,
            BLOCK_V=block_v,
            num_warps=8 if block_v >= 2048 else 4,
        )
    return stats[0], stats[1], stats[2], stats[3]
