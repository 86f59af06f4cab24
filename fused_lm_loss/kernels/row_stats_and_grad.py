"""Triton kernel: row statistics and d(loss)/d(logits) of one chunk in a single launch.

The same math as ``row_stats`` followed by ``grad_logits`` (see their docstrings), for the common
single-device training step, where nothing has to happen between the two (vocab-parallel shards must
merge their statistics first, and use the two kernels).

Persistent grid: about one program per SM, each walking rows pid, pid + P, pid + 2P, ... A program
reads its row once for the online softmax, then again to write the gradient in place. Because only
~#SM rows are in flight (132 x 256 KiB = 33 MiB for a 128k bf16 vocabulary; the H200's L2 holds
60 MiB) the second read is served from L2: HBM sees one read and one write of the chunk instead of
two reads and a write.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .grad_logits import grad_block, store_grad
from .row_stats import online_row_stats, target_logit

#: Launch shape; the benchmark sweeps these (see benchmarks/NOTES.md).
TUNING = {"block_v": 4096, "num_warps": 16, "programs_per_sm": 1}


@triton.jit
def _row_stats_and_grad_kernel(
    logits_ptr,
    logits_row_stride,
    grad_ptr,
    grad_lo_ptr,
    grad_row_stride,
    target_ptr,
    stats_ptr,
    n_rows,
    n_cols,
    grad_scale,
    logit_scale,
    softcap,
    smoothing_per_class,
    target_weight,
    z_loss,
    HAS_SOFTCAP: tl.constexpr,
    NEED_SUM: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    offsets = tl.arange(0, BLOCK_V)
    # int64 rows: row * stride passes 2**31 on large chunks
    for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
        row_ptr = logits_ptr + row * logits_row_stride
        row_max, row_sumexp, row_sum = online_row_stats(
            row_ptr, n_cols, logit_scale, softcap, HAS_SOFTCAP, NEED_SUM, BLOCK_V
        )
        target = tl.load(target_ptr + row)
        tl.store(stats_ptr + row, row_max)
        tl.store(stats_ptr + n_rows + row, row_sumexp)
        tl.store(stats_ptr + 2 * n_rows + row, target_logit(row_ptr, target, logit_scale, softcap, HAS_SOFTCAP))
        tl.store(stats_ptr + 3 * n_rows + row, row_sum)

        lse = row_max + tl.log(row_sumexp)
        for start in range(0, n_cols, BLOCK_V):
            cols = start + offsets
            mask = cols < n_cols
            x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            grad = grad_block(
                x,
                cols,
                target,
                lse,
                grad_scale,
                logit_scale,
                softcap,
                smoothing_per_class,
                target_weight,
                z_loss,
                HAS_SOFTCAP,
            )
            store_grad(grad_ptr, grad_lo_ptr, row * grad_row_stride + cols, grad, mask, SPLIT)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter: a few programs, so the persistent row loop is exercised


def row_stats_and_grad(
    logits: torch.Tensor,
    out: torch.Tensor,
    target: torch.Tensor,
    *,
    grad_scale: float,
    logit_scale: float,
    softcap: float | None,
    label_smoothing: float,
    vocab_size: int,
    z_loss: float,
    out_lo: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stats of a (rows, V) chunk, as ``row_stats`` returns them, and its gradient written into ``out``
    (plus the rounding residual into ``out_lo`` when given, see ``grad_logits``)."""
    rows, n_cols = logits.shape
    assert logits.stride(1) == 1 and out.stride(1) == 1
    assert out_lo is None or out_lo.stride() == out.stride()
    stats = torch.empty((4, rows), dtype=torch.float32, device=logits.device)
    if rows > 0:
        block_v = min(triton.next_power_of_2(n_cols), TUNING["block_v"])
        grid = min(rows, _num_sms(logits.device) * TUNING["programs_per_sm"])
        _row_stats_and_grad_kernel[(grid,)](
            logits,
            logits.stride(0),
            out,
            out if out_lo is None else out_lo,
            out.stride(0),
            target,
            stats,
            rows,
            n_cols,
            float(grad_scale),
            float(logit_scale),
            float(softcap or 1.0),
            float(label_smoothing) / vocab_size,
            1.0 - float(label_smoothing),
            float(z_loss),
            HAS_SOFTCAP=softcap is not None,
            NEED_SUM=label_smoothing > 0,
            SPLIT=out_lo is not None,
            BLOCK_V=block_v,
            num_warps=TUNING["num_warps"] if block_v >= 2048 else 4,
        )
    return stats[0], stats[1], stats[2], stats[3]
