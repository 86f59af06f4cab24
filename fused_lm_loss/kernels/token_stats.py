"""Triton kernels: per-token log-probability of the label, entropy, lse and argmax of one logits chunk.

For a (rows, V) chunk that holds the whole vocabulary, with z the fp32 loss-space logits of row i (the logit
transform, kernels/transform.py), p = softmax(z) and t = target[i] (>= 0)::

    lse     = log sum_j exp(z_j)
    logprob = z_t - lse
    entropy = lse - sum_j p_j z_j            (p_j z_j = 0 where p_j = 0: a -inf logit carries nothing)
    argmax  = the first j with z_j = max_k z_k  (ties: the lowest column, as torch.argmax)
    mean_logit       = sum_j z_j / V                                  (optional: DPO's / KTO's logit metrics)
    log_sum_sq_probs = log sum_j p_j^2 = log sum_j e_j^2 - 2 log s    (optional: DPO's WPO weights)

Relative to the row maximum m, with e_j = exp(z_j - m), s = sum_j e_j and w = sum_j e_j (z_j - m) (<= 0)::

    lse = m + log s        logprob = (z_t - m) - log s        entropy = log s - w / s

so that entropy is a sum of two non-negative terms (no cancellation of lse against the mean logit), and
logprob does not round through lse. The optional sums are q = sum_j e_j^2 (relative to m, moved as s is, by
k^2) and the plain sum of z.

As ``row_stats``, one program per (row, SEGMENT_COLS-column segment) reads its segment once, online over
blocks of BLOCK_V columns (``online_token_stats``), and writes the partials (m, s, w) and the segment's first
argmax; a second, small kernel merges a row's segments, BLOCK_SEGMENTS at a time (``online.merge_segments``),
and writes the four outputs.
Moving the reference of (s, w) from m to m' >= m::

    s' = k s        w' = k (w + (m - m') s)        with k = exp(m - m')

is how blocks are merged inside a segment and segments in the merge. The argmax of a block is the lowest
column holding the block's maximum, looked for only in a block whose maximum is strictly larger than the
running one (so ties keep the earlier column); segments are merged the same way.

Partials: a (5 * segments + 1, rows) fp32 buffer, m, s, w, q, sum z, each (segments, rows) (q and sum z only
when asked for), then the row's target logit (written by segment 0); the segments' argmax (int32 columns) in a
(segments, rows) buffer of its own.

-inf logits give what PyTorch gives. A block or a segment that is all -inf has m = -inf, s = w = 0 (the
reference is 0 instead of -inf, as in ``row_stats``) and merges as nothing; a -inf logit's weighted term
e_j (z_j - m) is 0, not 0 * inf = NaN (its exponent is clamped to -FLT_MAX: e_j = 0 times a finite number), and
the rebase of an empty state likewise (its (m - m') s is clamped, or its exponent difference capped at 0). A row
that is all -inf but its target has lse = z_t, logprob 0 and entropy 0 (to fp32 round-off, ~6e-8: the kernel's
s of the one element is 2^r 2^-r, r the residual of ``online_token_stats``); a row that is all -inf has lse
-inf, logprob NaN, entropy -inf (lse - 0: no p is positive) and argmax 0; a -inf target logit gives logprob
-inf. (NaN logits give NaN statistics; their argmax, which torch puts at the first NaN, is some column of the
row here.)

Float scalars are cast to fp32 at the top of each kernel (torch.compile passes Python floats as fp64); row
offsets are int64.
"""
import torch
import triton
import triton.language as tl

from ..transform import LogitTransform
from .args import check_target
from .online import floor_exponent, merge_segments, rebase, residual, segment_block
from .row_stats import target_logit
from .transform import loss_space, transform_scalars

#: Columns per program, as ``row_stats.SEGMENT_COLS`` (16384 bf16 values = 32 KiB per row segment).
SEGMENT_COLS = 16384
INT32_MAX = tl.constexpr(2147483647)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def online_token_stats(
    row_ptr,
    n_cols,
    factor,
    u_per_x,
    cap,
    HAS_SOFTCAP: tl.constexpr,
    HAS_FACTOR: tl.constexpr,
    NEED_ARGMAX: tl.constexpr,
    NEED_SQUARES: tl.constexpr,
    NEED_SUM: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """(m, s, w, first argmax, q, sum z) of one row segment's loss-space logits (see the module docstring), one
    read; q and sum z are 0 unless NEED_SQUARES / NEED_SUM. All -inf: m = -inf, s = w = q = 0, argmax 0.

    Inside the loop s and w are kept in base 2, relative to c = fl(m * LOG2E), so that each element's exponent
    is one FFMA, t = fma(z, LOG2E, -c), and serves as its own weight: s = sum 2^t, w = sum 2^t t. With the
    exact rounding residual r = m * LOG2E - c = fma(m, LOG2E, -c) the segment's s and w are then moved to
    base e relative to m itself (s <- 2^-r s, w <- 2^-r (w - r s) ln 2), so c rounds nothing away. (Beyond
    |m| ~ 1.2e7 the integer part of r is taken out of t as well, so that 2^t and 2^-r stay finite:
    ``online.base2_reference``.)"""
    offsets = tl.arange(0, BLOCK_V)
    running_max = float("-inf")
    running_ref = 0.0  # c, base-2 reference of s and w: fl(m * LOG2E), 0 while all -inf
    running_offset = 0.0  # its integer correction, 0 below |m| ~ 1.2e7 (online.base2_reference)
    running_sumexp = 0.0
    running_wsum = 0.0
    running_arg = 0
    running_squares = 0.0  # q, base 2 relative to c as s: sum 2^(2t)
    running_sum = 0.0
    for start in range(0, n_cols, BLOCK_V):
        cols = start + offsets
        mask = cols < n_cols
        x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        z, _ = loss_space(x, factor, u_per_x, cap, HAS_SOFTCAP, HAS_FACTOR)
        if NEED_SUM:
            running_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
        z = tl.where(mask, z, float("-inf"))
        block_max = tl.max(z, axis=0)
        new_max = tl.maximum(running_max, block_max)
        new_ref, new_offset, t, delta = rebase(z, new_max, running_ref, running_offset)
        e = tl.exp2(t)
        block_sumexp = tl.sum(e, axis=0)
        block_wsum = tl.sum(e * t, axis=0)
        rescale = tl.exp2(delta)
        running_wsum = rescale * (running_wsum + delta * running_sumexp) + block_wsum
        running_sumexp = running_sumexp * rescale + block_sumexp
        if NEED_SQUARES:
            running_squares = running_squares * (rescale * rescale) + tl.sum(e * e, axis=0)
        if NEED_ARGMAX:
            # Only a block with a strictly larger maximum moves the argmax (ties keep the earlier column), and only
            # then is its first column holding the maximum looked for (a uniform branch: scalar condition).
            if block_max > running_max:
                running_arg = tl.min(tl.where(z == block_max, cols, INT32_MAX), axis=0)
        running_max = new_max
        running_ref = new_ref
        running_offset = new_offset
    r = residual(running_max, running_ref, running_offset)
    rescale = tl.exp2(-r)
    wsum = (rescale * (running_wsum - r * running_sumexp)) * LN2
    return running_max, running_sumexp * rescale, wsum, running_arg, running_squares * (rescale * rescale), running_sum


@triton.jit
def _token_segment_kernel(
    logits_ptr,
    logits_row_stride,
    target_ptr,
    partial_ptr,
    arg_ptr,
    n_rows,
    n_cols,
    factor,
    u_per_x,
    cap,
    HAS_SOFTCAP: tl.constexpr,
    HAS_FACTOR: tl.constexpr,
    NEED_ARGMAX: tl.constexpr,
    NEED_SQUARES: tl.constexpr,
    NEED_SUM: tl.constexpr,
    SEGMENT_COLS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """partial[k * segments + segment, row] for k = (m, s, w, q, sum z), partial[5 * segments, row] = z_t
    (segment 0), arg[segment, row] = the segment's first argmax column (NEED_ARGMAX)."""
    factor, u_per_x, cap = transform_scalars(factor, u_per_x, cap)
    row = tl.program_id(0).to(tl.int64)
    segment = tl.program_id(1)
    n_segments = tl.num_programs(1)
    row_ptr = logits_ptr + row * logits_row_stride
    first_col = segment * SEGMENT_COLS
    seg_max, seg_sumexp, seg_wsum, seg_arg, seg_squares, seg_sum = online_token_stats(
        row_ptr + first_col,
        tl.minimum(n_cols - first_col, SEGMENT_COLS),
        factor,
        u_per_x,
        cap,
        HAS_SOFTCAP,
        HAS_FACTOR,
        NEED_ARGMAX,
        NEED_SQUARES,
        NEED_SUM,
        BLOCK_V,
    )
    stat_stride = n_segments * n_rows
    out = partial_ptr + segment * n_rows + row
    tl.store(out, seg_max)
    tl.store(out + stat_stride, seg_sumexp)
    tl.store(out + 2 * stat_stride, seg_wsum)
    if NEED_SQUARES:
        tl.store(out + 3 * stat_stride, seg_squares)
    if NEED_SUM:
        tl.store(out + 4 * stat_stride, seg_sum)
    if NEED_ARGMAX:
        tl.store(arg_ptr + segment * n_rows + row, first_col + seg_arg)
    if segment == 0:
        z_target = target_logit(row_ptr, tl.load(target_ptr + row), factor, u_per_x, cap, HAS_SOFTCAP, HAS_FACTOR)
        tl.store(partial_ptr + 5 * stat_stride + row, z_target)


@triton.jit
def _token_merge_kernel(
    partial_ptr,
    arg_ptr,
    logprob_ptr,
    entropy_ptr,
    lse_ptr,
    argmax_ptr,
    mean_logit_ptr,
    log_sum_sq_ptr,
    n_rows,
    n_segments,
    n_cols,
    NEED_ARGMAX: tl.constexpr,
    NEED_SQUARES: tl.constexpr,
    NEED_SUM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_SEGMENTS: tl.constexpr,
):
    """The outputs of BLOCK_ROWS rows from their segments' partials, merged BLOCK_SEGMENTS at a time, online
    (formulas in the module docstring). Segments that are all -inf (m = -inf, s = w = q = 0) add nothing."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    stat_stride = n_segments * n_rows
    row_max = tl.full((BLOCK_ROWS,), float("-inf"), dtype=tl.float32)
    row_sumexp = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    row_wsum = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    row_arg = tl.zeros((BLOCK_ROWS,), dtype=tl.int32)
    row_squares = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    for first in range(0, n_segments, BLOCK_SEGMENTS):
        offsets, mask = segment_block(first, rows, row_mask, n_rows, 1, n_segments, BLOCK_SEGMENTS)
        seg_max = tl.load(partial_ptr + offsets, mask=mask, other=float("-inf"))
        seg_sumexp = tl.load(partial_ptr + stat_stride + offsets, mask=mask, other=0.0)
        seg_wsum = tl.load(partial_ptr + 2 * stat_stride + offsets, mask=mask, other=0.0)
        block_max = tl.max(seg_max, axis=0)
        old_max, old_sumexp = row_max, row_sumexp
        row_max, row_sumexp, shift, rescale, seg_rescale = merge_segments(row_max, row_sumexp, seg_max, seg_sumexp)
        # w moves with s (module docstring): w' = k (w + (m - m') s), the (m - m') s of an empty state clamped
        seg_wsum = seg_rescale * (seg_wsum + floor_exponent(seg_max - shift[None, :]) * seg_sumexp)
        row_wsum = rescale * (row_wsum + floor_exponent(old_max - shift) * old_sumexp)
        row_wsum += tl.sum(seg_wsum, axis=0)
        if NEED_SQUARES:  # q moves as s does, squared: q' = k^2 q
            seg_squares = tl.load(partial_ptr + 3 * stat_stride + offsets, mask=mask, other=0.0)
            row_squares = row_squares * (rescale * rescale) + tl.sum(seg_squares * (seg_rescale * seg_rescale), axis=0)
        if NEED_SUM:
            row_sum += tl.sum(tl.load(partial_ptr + 4 * stat_stride + offsets, mask=mask, other=0.0), axis=0)
        if NEED_ARGMAX:
            seg_arg = tl.load(arg_ptr + offsets, mask=mask, other=INT32_MAX)
            block_arg = tl.min(tl.where(seg_max == block_max[None, :], seg_arg, INT32_MAX), axis=0)
            row_arg = tl.where(block_max > old_max, block_arg, row_arg)  # ties keep the earlier segment
    # rows past the end: s = 1 keeps log() quiet (nothing is stored)
    row_sumexp = tl.where(row_mask, row_sumexp, 1.0)
    log_sumexp = tl.log(row_sumexp)
    z_target = tl.load(partial_ptr + 5 * stat_stride + rows, mask=row_mask, other=0.0)
    tl.store(lse_ptr + rows, row_max + log_sumexp, mask=row_mask)
    tl.store(logprob_ptr + rows, (z_target - row_max) - log_sumexp, mask=row_mask)
    # s = 0 only for an all -inf row (w = 0 too): entropy = log 0 - 0 = -inf, as lse - 0
    tl.store(entropy_ptr + rows, log_sumexp - row_wsum / tl.where(row_sumexp > 0.0, row_sumexp, 1.0), mask=row_mask)
    if NEED_ARGMAX:
        tl.store(argmax_ptr + rows, row_arg.to(tl.int64), mask=row_mask)
    if NEED_SQUARES:  # log q - 2 log s: -inf - -inf = NaN for an all -inf row, as TRL's and eager's 0/0
        row_squares = tl.where(row_mask, row_squares, 1.0)
        tl.store(log_sum_sq_ptr + rows, tl.log(row_squares) - 2.0 * log_sumexp, mask=row_mask)
    if NEED_SUM:
        tl.store(mean_logit_ptr + rows, row_sum / n_cols, mask=row_mask)


def token_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    logprob_out: torch.Tensor,
    entropy_out: torch.Tensor,
    lse_out: torch.Tensor,
    argmax_out: torch.Tensor | None,
    *,
    transform: LogitTransform,
    mean_logit_out: torch.Tensor | None = None,
    log_sum_sq_out: torch.Tensor | None = None,
) -> None:
    """Per row of a (rows, V) chunk holding the whole vocabulary: log p(target), entropy, lse into the (rows,)
    fp32 outputs and the first argmax into ``argmax_out`` (int64; skipped when None); the mean logit and
    log sum p^2 into the fp32 ``mean_logit_out`` / ``log_sum_sq_out`` when given. ``target`` >= 0."""
    rows, n_cols = logits.shape
    check_target(target, rows, logits.device, "token_stats")
    if rows == 0:
        return
    assert logits.stride(1) == 1
    optional = (argmax_out, mean_logit_out, log_sum_sq_out)
    outputs = (logprob_out, entropy_out, lse_out) + tuple(out for out in optional if out is not None)
    assert all(out.shape == (rows,) and out.stride(0) == 1 for out in outputs)
    need_argmax, need_sum, need_squares = (out is not None for out in optional)
    n_segments = triton.cdiv(n_cols, SEGMENT_COLS)
    partial = torch.empty((5 * n_segments + 1, rows), dtype=torch.float32, device=logits.device)
    arg = torch.empty((n_segments, rows), dtype=torch.int32, device=logits.device) if need_argmax else partial
    _token_segment_kernel[(rows, n_segments)](
        logits,
        logits.stride(0),
        target,
        partial,
        arg,
        rows,
        n_cols,
        *transform.kernel_args(),
        **transform.kernel_flags(),
        NEED_ARGMAX=need_argmax,
        NEED_SQUARES=need_squares,
        NEED_SUM=need_sum,
        SEGMENT_COLS=SEGMENT_COLS,
        BLOCK_V=min(triton.next_power_of_2(n_cols), 2048),
        # As row_stats (not measured for this kernel): 2 warps, 4 with softcap. No spills in an sm90 compile (triton
        # 3.9): 55 registers at 2 warps, 72 with the argmax; 48 with softcap at 4 warps
        num_warps=4 if transform.has_softcap else 2,
    )
    block_rows = 32
    _token_merge_kernel[(triton.cdiv(rows, block_rows),)](
        partial,
        arg,
        logprob_out,
        entropy_out,
        lse_out,
        argmax_out if need_argmax else lse_out,
        mean_logit_out if need_sum else lse_out,
        log_sum_sq_out if need_squares else lse_out,
        rows,
        n_segments,
        n_cols,
        NEED_ARGMAX=need_argmax,
        NEED_SQUARES=need_squares,
        NEED_SUM=need_sum,
        BLOCK_ROWS=block_rows,
        BLOCK_SEGMENTS=min(triton.next_power_of_2(n_segments), 64),
    )
