"""Triton kernel: a chunk's row losses and its logits gradient in one launch, each logit read once from HBM.

The same math as ``row_losses`` followed by ``grad_logits`` (see their files), for a chunk that holds the
whole vocabulary. Done as two launches, the gradient pass reads the chunk from HBM a second time: at
H = 896 that read is ~0.1x of the two-matmul floor (benchmarks/RESULTS.md). Here the gradient of a row
segment is computed shortly after its statistics, while the segment is still in L2.

Work items, in this order for each group of ROWS_PER_GROUP rows (S = segments of SEGMENT_COLS columns)::

    stats(row, segment)   for the group's rows x S        partials of the segment (``row_stats``)
    grad(row, segment)    for the group's rows x S        G of the segment, in place (``grad_logits``)

The stats item that finishes a group last (a per-group arrival counter) merges the group's partials into
its rows' loss and lse and raises the group's ready flag; the group's grad items wait for that flag. A
program takes its item from a global counter (not from its program id), so every item before it has a
running or finished program: the waits cannot deadlock, whatever order the GPU starts programs in, and under
TRITON_INTERPRET=1, where programs run one after another, no item ever waits. In flight are only the items
of a few groups (a few MB), which stay in L2 between the stats read and the gradient read.

Synchronization: partials (and loss / lse) are plain stores, made visible by a CTA barrier and a release
atomic, and read after an acquire with loads that bypass L1 (.cg). ``sync`` is an int32 buffer of
1 + 2 * groups zeros per launch: the item counter, the arrival counters, the ready flags.
"""
from __future__ import annotations

import importlib

import torch
import triton
import triton.language as tl

from .grad_logits import grad_of_logits, store_grad
from .row_stats import merge_segments, store_loss_and_lse, store_segment_partials

# the module (its SEGMENT_COLS, read at each call), not the package's ``row_stats`` function
_row_stats_module = importlib.import_module(".row_stats", __package__)

#: Rows per group: a group's items are 2 x ROWS_PER_GROUP x S, its logits ROWS_PER_GROUP x V x 2 bytes.
ROWS_PER_GROUP = 8


@triton.jit
def _losses_and_grad_kernel(
    logits_ptr,
    logits_row_stride,
    grad_ptr,
    grad_lo_ptr,
    target_ptr,
    partial_ptr,
    loss_ptr,
    lse_ptr,
    sync_ptr,
    n_rows,
    n_cols,
    n_segments,
    grad_scale,
    logit_scale,
    softcap,
    smoothing_per_class,
    target_weight,
    z_loss,
    HAS_SOFTCAP: tl.constexpr,
    NEED_SUM: tl.constexpr,
    SPLIT: tl.constexpr,
    SEGMENT_COLS: tl.constexpr,
    GRAD_COLS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ROWS_PER_GROUP: tl.constexpr,
    BLOCK_SEGMENTS: tl.constexpr,
    STATS_EVICTION: tl.constexpr,
    GRAD_EVICTION: tl.constexpr,
):
    n_groups = tl.cdiv(n_rows, ROWS_PER_GROUP)
    item = tl.atomic_add(sync_ptr, 1)
    n_grad_items = tl.cdiv(n_cols, GRAD_COLS)  # per row
    stats_items = ROWS_PER_GROUP * n_segments  # per group
    group = item // (stats_items + ROWS_PER_GROUP * n_grad_items)
    within = item % (stats_items + ROWS_PER_GROUP * n_grad_items)
    is_stats = within < stats_items
    if is_stats:
        row = group * ROWS_PER_GROUP + within // n_segments
        segment = within % n_segments
    else:
        row = group * ROWS_PER_GROUP + (within - stats_items) // n_grad_items
        segment = (within - stats_items) % n_grad_items  # here: the grad item's column block
    arrivals_ptr = sync_ptr + 1 + group
    ready_ptr = sync_ptr + 1 + n_groups + group
    if row < n_rows:
        row64 = row.to(tl.int64)
        if is_stats:
            store_segment_partials(
                logits_ptr, logits_row_stride, target_ptr, partial_ptr, row64, segment, n_segments, n_rows,
                n_cols, logit_scale, softcap, HAS_SOFTCAP, NEED_SUM, SEGMENT_COLS, BLOCK_V, STATS_EVICTION,
            )
            tl.debug_barrier()  # every thread's partial stores come before the release below
            arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel")
            group_items = tl.minimum(ROWS_PER_GROUP, n_rows - group * ROWS_PER_GROUP) * n_segments
            if arrived == group_items - 1:  # the group's last stats item: merge, then release the grad items
                rows = group * ROWS_PER_GROUP + tl.arange(0, ROWS_PER_GROUP)
                row_mask = rows < n_rows
                row_max, row_sumexp, z_target, row_sum = merge_segments(
                    partial_ptr, rows, row_mask, n_rows, n_segments, NEED_SUM, BLOCK_SEGMENTS
                )
                store_loss_and_lse(
                    loss_ptr, lse_ptr, rows, row_mask, row_max, row_sumexp, z_target, row_sum,
                    smoothing_per_class, target_weight, z_loss,
                )
                tl.debug_barrier()
                tl.atomic_xchg(ready_ptr, 1, sem="release")
        else:
            while tl.atomic_add(ready_ptr, 0, sem="acquire") == 0:
                pass
            lse = tl.load(lse_ptr + row64, cache_modifier=".cg")
            target = tl.load(target_ptr + row64)
            row_offset = row64 * logits_row_stride
            first_col = segment * GRAD_COLS
            end_col = tl.minimum(first_col + GRAD_COLS, n_cols)  # only these columns: G overwrites the logits
            for start in range(first_col, end_col, BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                mask = cols < end_col
                x = tl.load(logits_ptr + row_offset + cols, mask=mask, other=0.0, eviction_policy=GRAD_EVICTION)
                x = x.to(tl.float32)
                grad = grad_of_logits(
                    x, cols, target, lse, grad_scale, logit_scale, softcap, smoothing_per_class, target_weight,
                    z_loss, HAS_SOFTCAP,
                )
                store_grad(grad_ptr, grad_lo_ptr, row_offset + cols, grad, mask, SPLIT)


def losses_and_grad(
    logits: torch.Tensor,
    out: torch.Tensor,
    target: torch.Tensor,
    loss_out: torch.Tensor,
    lse_out: torch.Tensor,
    *,
    grad_scale: float,
    logit_scale: float,
    softcap: float | None,
    label_smoothing: float,
    vocab_size: int,
    z_loss: float,
    out_lo: torch.Tensor | None = None,
    rows_per_group: int = ROWS_PER_GROUP,
    num_warps: int = 4,
    block_v: int = 2048,
    grad_cols: int | None = None,
    keep_in_l2: bool = False,
) -> None:
    """``row_losses`` (into ``loss_out`` / ``lse_out``) and ``grad_logits`` (into ``out``, which may be
    ``logits``; the residual into ``out_lo``) of a (rows, V) chunk holding the whole vocabulary, in one launch.
    ``rows_per_group``, ``num_warps``, ``block_v``: launch shape (benchmarks/profile_chunk.py --fused-grad)."""
    rows, n_cols = logits.shape
    if rows == 0:
        return
    assert logits.stride(1) == 1 and out.stride() == logits.stride()
    assert out_lo is None or out_lo.stride() == out.stride()
    assert loss_out.stride(0) == 1 and lse_out.stride(0) == 1
    segment_cols = _row_stats_module.SEGMENT_COLS
    n_segments = triton.cdiv(n_cols, segment_cols)
    n_groups = triton.cdiv(rows, rows_per_group)
    grad_cols = min(grad_cols or segment_cols, segment_cols)
    block_v = min(triton.next_power_of_2(n_cols), block_v, grad_cols)
    partial = torch.empty((4, n_segments, rows), dtype=torch.float32, device=logits.device)
    sync = torch.zeros(1 + 2 * n_groups, dtype=torch.int32, device=logits.device)
    _losses_and_grad_kernel[(n_groups * rows_per_group * (n_segments + triton.cdiv(n_cols, grad_cols)),)](
        logits,
        logits.stride(0),
        out,
        out if out_lo is None else out_lo,
        target,
        partial,
        loss_out,
        lse_out,
        sync,
        rows,
        n_cols,
        n_segments,
        float(grad_scale),
        float(logit_scale),
        float(softcap or 1.0),
        float(label_smoothing) / vocab_size,
        1.0 - float(label_smoothing),
        float(z_loss),
        HAS_SOFTCAP=softcap is not None,
        NEED_SUM=label_smoothing > 0,
        SPLIT=out_lo is not None,
        SEGMENT_COLS=segment_cols,
        GRAD_COLS=grad_cols,
        BLOCK_V=block_v,
        ROWS_PER_GROUP=rows_per_group,
        BLOCK_SEGMENTS=min(triton.next_power_of_2(n_segments), 64),
        STATS_EVICTION="evict_last" if keep_in_l2 else "",
        GRAD_EVICTION="evict_first" if keep_in_l2 else "",
        num_warps=num_warps,
    )
