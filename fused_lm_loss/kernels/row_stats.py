"""Triton kernel: per-row softmax statistics of one logits chunk.

For each row ``i`` of the raw logits chunk ``x`` (the matmul output, any float dtype) the kernel
forms the loss-space logits z in fp32 (the logit transform: scale, softcap, temperature; kernels/transform.py)
and, in one pass over the row with an online softmax, writes four fp32 numbers::

    row_max[i]      = m_i   = max_j z_ij
    row_sumexp[i]   = s_i   = sum_j exp(z_ij - m_i)          (so lse_i = m_i + log s_i)
    target_logit[i] = z_i,t  with t = target[i]  (0 when t < 0: target outside this vocab shard)
    logit_sum[i]    = sum_j z_ij                 (only when NEED_SUM: label smoothing needs mean z; terms.smooths)
                      sum_j w_j z_ij             (with class weights w: HAS_CLASS_WEIGHT; w_j z_ij = 0 where w_j = 0)

The four are returned separately (not as lse) so that vocab-parallel shards can merge them:
max by all-reduce(MAX), then s_i * exp(m_i - M_i), target and sum by all-reduce(SUM).

A chunk holds only a few hundred rows, too few programs to keep HBM busy if each read a whole row, so
each row is split into segments of SEGMENT_COLS columns: one program per (row, segment) writes partial
(m, s, sum), and a second, tiny kernel merges a row's segments the same way vocab shards are merged::

    M_i = max_k m_ik        s_i = sum_k s_ik * exp(m_ik - M_i)        sum_i = sum_k sum_ik

When one chunk holds the whole vocabulary (no vocab-parallel merge to come), ``row_losses`` has that
merge kernel write the row's loss and lse directly (``loss_terms.loss_from_stats``), instead of the four
statistics. ``matmul_stats.py`` writes the same partials from the logits matmul's epilogue.

-inf logits (a masked vocabulary range, a -inf bias) give what PyTorch gives: a segment, or a block of the
online loop, that is all -inf has max -inf and sum-exp 0 (it subtracts 0 instead of its -inf max, so no
-inf - -inf = NaN), and merges as nothing; a row that is all -inf has lse = -inf and loss NaN, as
F.cross_entropy; a -inf target logit gives loss +inf, and label smoothing over any -inf logit +inf.
With class weights a class of weight 0 adds nothing to the smoothing sum, even at a -inf logit (a select on
w != 0, where F.cross_entropy(weight=...) computes 0 * -inf = NaN in its forward, though its gradient is
finite); a class of positive weight at a -inf logit gives +inf, as without weights.

Float scalars are cast to fp32 at the top of each kernel: torch.compile passes Python floats as fp64,
and all math must stay fp32 (and loop-carried types fixed) however they arrive.

Row offsets are int64 because rows x V passes 2**31.
"""
from dataclasses import replace

import torch
import triton
import triton.language as tl

from ..exp_epilogue import ExpStats
from ..loss_terms import LossTerms
from ..transform import LogitTransform
from .args import check_class_weight, check_target, check_vector
from .online import LN2, LOG2E, merge_segments, segment_block
from .transform import loss_space, transform_scalars


@triton.jit
def online_row_stats(
    row_ptr,
    n_cols,
    factor,
    u_per_x,
    cap,
    HAS_SOFTCAP: tl.constexpr,
    HAS_FACTOR: tl.constexpr,
    NEED_SUM: tl.constexpr,
    BLOCK_V: tl.constexpr,
    weight_ptr,
    HAS_CLASS_WEIGHT: tl.constexpr,
):
    """(max, sum-exp relative to max, sum) of one row's loss-space logits, one read of the row; with
    HAS_CLASS_WEIGHT the sum is sum_j w_j z_j, w read from ``weight_ptr`` (the segment's first class).
    All -inf so far: max -inf, sum-exp 0."""
    offsets = tl.arange(0, BLOCK_V)
    running_max = float("-inf")
    running_sumexp = 0.0
    running_sum = 0.0
    for start in range(0, n_cols, BLOCK_V):
        cols = start + offsets
        mask = cols < n_cols
        x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        z, _ = loss_space(x, factor, u_per_x, cap, HAS_SOFTCAP, HAS_FACTOR)
        if NEED_SUM:
            if HAS_CLASS_WEIGHT:
                # w_j z_j, 0 where w_j = 0: no 0 * -inf = NaN at a -inf logit; masked columns load w = 0
                w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
                running_sum += tl.sum(w * tl.where(w != 0.0, z, 0.0), axis=0)
            else:
                running_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
        z = tl.where(mask, z, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        # While the row is all -inf, exponents are taken relative to 0, not to the -inf max (-inf - -inf = NaN):
        # the sum stays 0. A scalar select per block, nothing per element.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sumexp = running_sumexp * tl.exp(running_max - shift) + tl.sum(tl.exp2((z - shift) * LOG2E), axis=0)
        running_max = new_max
    return running_max, running_sumexp, running_sum


@triton.jit
def target_logit(row_ptr, target, factor, u_per_x, cap, HAS_SOFTCAP: tl.constexpr, HAS_FACTOR: tl.constexpr):
    """z_i,t of the row (0 when target < 0, i.e. the class lives in another vocab shard)."""
    has_target = target >= 0
    x = tl.load(row_ptr + tl.where(has_target, target, 0)).to(tl.float32)
    z, _ = loss_space(x, factor, u_per_x, cap, HAS_SOFTCAP, HAS_FACTOR)
    return tl.where(has_target, z, 0.0)


#: Columns per program; 16384 bf16 values = 32 KiB per row segment.
SEGMENT_COLS = 16384


@triton.jit
def _segment_stats_kernel(
    logits_ptr,
    logits_row_stride,
    target_ptr,
    partial_ptr,
    class_weight_ptr,
    n_rows,
    n_cols,
    factor,
    u_per_x,
    cap,
    HAS_SOFTCAP: tl.constexpr,
    HAS_FACTOR: tl.constexpr,
    NEED_SUM: tl.constexpr,
    HAS_CLASS_WEIGHT: tl.constexpr,
    SEGMENT_COLS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """partial[k, segment, row] for k = (max, sum-exp, target logit, sum), like ``stats`` with a segment
    axis (so that with one segment it is ``stats``); only segment 0 writes the target logit. With
    HAS_CLASS_WEIGHT (and NEED_SUM) the sum is weighted by the (V,) fp32 ``class_weight``."""
    factor, u_per_x, cap = transform_scalars(factor, u_per_x, cap)
    row = tl.program_id(0).to(tl.int64)
    segment = tl.program_id(1)
    n_segments = tl.num_programs(1)
    row_ptr = logits_ptr + row * logits_row_stride
    first_col = segment * SEGMENT_COLS
    seg_max, seg_sumexp, seg_sum = online_row_stats(
        row_ptr + first_col,
        tl.minimum(n_cols - first_col, SEGMENT_COLS),
        factor,
        u_per_x,
        cap,
        HAS_SOFTCAP,
        HAS_FACTOR,
        NEED_SUM,
        BLOCK_V,
        class_weight_ptr + first_col,
        HAS_CLASS_WEIGHT,
    )
    out = partial_ptr + segment * n_rows + row
    tl.store(out, seg_max)
    tl.store(out + n_segments * n_rows, seg_sumexp)
    tl.store(out + 3 * n_segments * n_rows, seg_sum)
    if segment == 0:
        z_target = target_logit(row_ptr, tl.load(target_ptr + row), factor, u_per_x, cap, HAS_SOFTCAP, HAS_FACTOR)
        tl.store(out + 2 * n_segments * n_rows, z_target)


@triton.jit
def _merge_segments_kernel(
    max_ptr,
    sumexp_ptr,
    sum_ptr,
    segment_stride,
    row_stride,
    target_logit_ptr,
    stats_ptr,
    loss_ptr,
    lse_ptr,
    target_ptr,
    class_weight_ptr,
    weight_sum_ptr,
    n_rows,
    n_segments,
    smoothing_per_class,
    target_weight,
    z_loss,
    HAS_SUM: tl.constexpr,
    WRITE_LOSS: tl.constexpr,
    HAS_CLASS_WEIGHT: tl.constexpr,
    BASE2: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_SEGMENTS: tl.constexpr,
):
    """stats[k, row] for k = (max, sum-exp, target logit, sum) from the rows' segment partials (max, sum-exp and sum
    of (segment, row) at segment * segment_stride + row * row_stride; the target logit one per row); with WRITE_LOSS
    instead the row's loss and lse (``loss_terms.loss_from_stats``). Segments are merged BLOCK_SEGMENTS at a time,
    online. Segments that are all -inf (max -inf, sum-exp 0) add nothing; a row of only such segments gets max -inf,
    sum-exp 0, lse -inf. HAS_CLASS_WEIGHT (with WRITE_LOSS): the weighted loss, w_t = class_weight[target]
    (0 for a target < 0) and W = weight_sum[0]. BASE2 (with WRITE_LOSS): the maxima are base-2 exponents, sums
    relative to 2^max (the Hopper epilogue's k and sums, ``merge_exp_stats``)."""
    smoothing_per_class = tl.cast(smoothing_per_class, tl.float32)
    target_weight = tl.cast(target_weight, tl.float32)
    z_loss = tl.cast(z_loss, tl.float32)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    row_max = tl.full((BLOCK_ROWS,), float("-inf"), dtype=tl.float32)
    row_sumexp = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    for first in range(0, n_segments, BLOCK_SEGMENTS):
        offsets, mask = segment_block(first, rows, row_mask, segment_stride, row_stride, n_segments, BLOCK_SEGMENTS)
        seg_max = tl.load(max_ptr + offsets, mask=mask, other=float("-inf"))
        seg_sumexp = tl.load(sumexp_ptr + offsets, mask=mask, other=0.0)
        row_max, row_sumexp, _, _, _ = merge_segments(row_max, row_sumexp, seg_max, seg_sumexp, BASE2)
        if HAS_SUM:
            row_sum += tl.sum(tl.load(sum_ptr + offsets, mask=mask, other=0.0), axis=0)
    row_max = tl.where(row_mask, row_max, 0.0)
    z_target = tl.load(target_logit_ptr + rows, mask=row_mask, other=0.0)
    if WRITE_LOSS:
        if BASE2:
            row_max = row_max * LN2
        lse = row_max + tl.log(tl.where(row_mask, row_sumexp, 1.0))
        if HAS_CLASS_WEIGHT:
            # (1 - eps) w_t (lse - z_t) + (eps / V) (W lse - sum_j w_j z_j) + z_loss lse^2 (target_weight = 1 - eps)
            target = tl.load(target_ptr + rows, mask=row_mask, other=-1)
            has_target = target >= 0
            w_t = tl.load(class_weight_ptr + tl.where(has_target, target, 0), mask=has_target, other=0.0)
            loss = (target_weight * w_t) * (lse - z_target)
            if HAS_SUM:
                loss += smoothing_per_class * (tl.load(weight_sum_ptr) * lse - row_sum)
            loss += z_loss * lse * lse
        else:
            loss = lse - target_weight * z_target - smoothing_per_class * row_sum + z_loss * lse * lse
        tl.store(loss_ptr + rows, loss, mask=row_mask)
        tl.store(lse_ptr + rows, lse, mask=row_mask)
    else:
        tl.store(stats_ptr + rows, row_max, mask=row_mask)
        tl.store(stats_ptr + n_rows + rows, row_sumexp, mask=row_mask)
        tl.store(stats_ptr + 2 * n_rows + rows, z_target, mask=row_mask)
        tl.store(stats_ptr + 3 * n_rows + rows, row_sum, mask=row_mask)


def _segment_partials(
    logits: torch.Tensor, target: torch.Tensor, out: torch.Tensor, transform: LogitTransform, terms: LossTerms
) -> None:
    """out[k, segment, row] for k = (max, sum-exp, target logit, sum); ``out`` is (4, n_segments, rows).
    The sum (``terms.smooths``) is weighted by the class weights when given."""
    rows, n_cols = logits.shape
    assert logits.stride(1) == 1
    weighted = terms.smooths and terms.class_weight is not None  # (only the sum reads the class weights)
    _segment_stats_kernel[(rows, out.shape[1])](
        logits,
        logits.stride(0),
        target,
        out,
        terms.class_weight if weighted else out,
        rows,
        n_cols,
        *transform.kernel_args(),
        **transform.kernel_flags(),
        NEED_SUM=terms.smooths,
        HAS_CLASS_WEIGHT=weighted,
        SEGMENT_COLS=SEGMENT_COLS,
        BLOCK_V=min(triton.next_power_of_2(n_cols), 2048),
        # 2048 x 2 warps: ~5% faster than 4 warps on the H200; with softcap (more ALU work and registers per
        # element) 4 warps: 9% faster than 2 (benchmarks/NOTES.md)
        num_warps=4 if transform.has_softcap else 2,
    )


def row_stats(
    logits: torch.Tensor, target: torch.Tensor, *, transform: LogitTransform, terms: LossTerms
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the stats kernels on a (rows, V) logits chunk; returns (max, sumexp, target_logit, logit_sum), fp32.
    The logit sum only when ``terms.smooths`` (sum_j w_j z_j with class weights; 0 where w_j = 0)."""
    rows, n_cols = logits.shape
    check_target(target, rows, logits.device, "row_stats")
    check_class_weight(terms.class_weight, n_cols, logits.device, "row_stats")
    n_segments = triton.cdiv(n_cols, SEGMENT_COLS)
    stats = torch.empty((4, rows), dtype=torch.float32, device=logits.device)
    if rows == 0:
        return stats[0], stats[1], stats[2], stats[3]
    # With one segment the partials are the statistics: write them in place.
    partial = stats if n_segments == 1 else torch.empty((4, n_segments, rows), dtype=torch.float32, device=logits.device)
    _segment_partials(logits, target, partial.view(4, n_segments, rows), transform, terms)
    if n_segments > 1:
        # the partial sums are already weighted; merging them needs no class weights
        return merge_partials(partial, terms=replace(terms, class_weight=None))
    return stats[0], stats[1], stats[2], stats[3]


def row_losses(
    logits: torch.Tensor,
    target: torch.Tensor,
    loss_out: torch.Tensor,
    lse_out: torch.Tensor,
    *,
    transform: LogitTransform,
    terms: LossTerms,
) -> None:
    """Per-row loss and lse (fp32, into ``loss_out`` / ``lse_out``) of a chunk that holds the whole vocabulary:
    the segment partials, then ``merge_partials``."""
    rows, n_cols = logits.shape
    check_target(target, rows, logits.device, "row_losses")
    check_class_weight(terms.class_weight, n_cols, logits.device, "row_losses")
    check_vector(loss_out, rows, logits.device, "row_losses", "loss_out")
    check_vector(lse_out, rows, logits.device, "row_losses", "lse_out")
    if rows == 0:
        return
    n_segments = triton.cdiv(n_cols, SEGMENT_COLS)
    partial = torch.empty((4, n_segments, rows), dtype=torch.float32, device=logits.device)
    _segment_partials(logits, target, partial, transform, terms)
    merge_partials(partial, terms=terms, loss_out=loss_out, lse_out=lse_out, target=target)


def merge_partials(
    partial: torch.Tensor,
    *,
    terms: LossTerms,
    loss_out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    target: torch.Tensor | None = None,
):
    """Merge a (4, segments, rows) partial buffer (target logit in segment 0's slot).

    Without outputs: returns the rows' (max, sumexp, target_logit, logit_sum), fp32, for a vocab-parallel
    merge. With ``loss_out`` / ``lse_out`` (the partials cover the whole vocabulary) the merge kernel writes each
    row's loss and lse instead (``loss_terms.loss_from_stats``); with class weights (the partials' sum weighted
    by them, as ``row_losses`` makes them) it reads the rows' ``target`` for w_t, and W = sum_j w_j is summed
    here, on the device.
    """
    _, n_segments, rows = partial.shape
    assert partial.is_contiguous()
    write_loss = loss_out is not None
    class_weight = terms.class_weight
    weighted = class_weight is not None
    assert not weighted or (write_loss and target is not None and target.shape == (rows,) and target.is_contiguous())
    # W on the device, no host sync: one tiny reduction per call, read by the merge kernel only with smoothing
    weight_sum = class_weight.sum().reshape(1) if weighted and terms.smooths else None
    stats = partial if write_loss else torch.empty((4, rows), dtype=torch.float32, device=partial.device)
    if rows:
        assert not write_loss or (loss_out.stride(0) == 1 and lse_out.stride(0) == 1)
        block_rows = 32
        _merge_segments_kernel[(triton.cdiv(rows, block_rows),)](
            max_ptr=partial[0],
            sumexp_ptr=partial[1],
            sum_ptr=partial[3],
            segment_stride=rows,
            row_stride=1,
            target_logit_ptr=partial[2, 0],  # (in segment 0's slot)
            stats_ptr=stats,
            loss_ptr=loss_out if write_loss else stats,
            lse_ptr=lse_out if write_loss else stats,
            target_ptr=target if weighted else stats,
            class_weight_ptr=class_weight if weighted else stats,
            weight_sum_ptr=weight_sum if weight_sum is not None else stats,
            n_rows=rows,
            n_segments=n_segments,
            smoothing_per_class=terms.smoothing_per_class,
            target_weight=1.0 - float(terms.label_smoothing),
            z_loss=float(terms.z_loss),
            HAS_SUM=terms.smooths,
            WRITE_LOSS=write_loss,
            HAS_CLASS_WEIGHT=weighted,
            BASE2=False,
            BLOCK_ROWS=block_rows,
            BLOCK_SEGMENTS=min(triton.next_power_of_2(n_segments), 64),
        )
    if write_loss:
        return None
    return stats[0], stats[1], stats[2], stats[3]


def merge_exp_stats(stats: ExpStats, loss_out: torch.Tensor, lse_out: torch.Tensor, *, terms: LossTerms) -> None:
    """Per-row loss and lse (fp32, into ``loss_out`` / ``lse_out``) of the plain loss from the Hopper epilogue's
    per-(row, tile) k and sums (exp_epilogue.py): the tiles merged at the row's largest k, each other tile's sum moved
    by an exact power of two, in one launch (no (rows, tiles) temporary)."""
    rows, n_tiles = stats.k.shape
    device = stats.k.device
    assert terms.class_weight is None and not terms.smooths, "the exp epilogue serves the plain loss (plan.py)"
    assert stats.k.is_contiguous() and stats.sum_exp.shape == stats.k.shape and stats.sum_exp.is_contiguous()
    check_vector(stats.target_logit, rows, device, "merge_exp_stats", "stats.target_logit")
    check_vector(loss_out, rows, device, "merge_exp_stats", "loss_out")
    check_vector(lse_out, rows, device, "merge_exp_stats", "lse_out")
    if rows == 0:
        return
    # a few rows per program: a chunk's rows x ~1000 tiles, read along the tiles (a row's k are contiguous)
    block_rows = 4
    unused = loss_out  # (pointers the kernel does not read without a sum, class weights or the four statistics)
    _merge_segments_kernel[(triton.cdiv(rows, block_rows),)](
        max_ptr=stats.k,
        sumexp_ptr=stats.sum_exp,
        sum_ptr=unused,
        segment_stride=1,
        row_stride=n_tiles,
        target_logit_ptr=stats.target_logit,
        stats_ptr=unused,
        loss_ptr=loss_out,
        lse_ptr=lse_out,
        target_ptr=unused,
        class_weight_ptr=unused,
        weight_sum_ptr=unused,
        n_rows=rows,
        n_segments=n_tiles,
        smoothing_per_class=0.0,
        target_weight=1.0,
        z_loss=float(terms.z_loss),
        HAS_SUM=False,
        WRITE_LOSS=True,
        HAS_CLASS_WEIGHT=False,
        BASE2=True,
        BLOCK_ROWS=block_rows,
        BLOCK_SEGMENTS=min(triton.next_power_of_2(n_tiles), 256),
    )
