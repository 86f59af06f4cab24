"""Triton helpers of the online softmax shared by the statistics kernels (``row_stats.py``, ``token_stats.py``,
``divergence.py``).

A row's sum-exp is kept relative to its running maximum m. Moving it to a new maximum m' >= m multiplies it by
exp(m - m'); a state that is all -inf (m = -inf, sum-exp 0) is taken relative to 0 instead (-inf - -inf would
be NaN) and merges as nothing. The merge kernels fold a row's segment partials (max, sum-exp, ...) into it
BLOCK_SEGMENTS segments at a time with ``segment_block`` and ``merge_segments``.
"""
import triton
import triton.language as tl

# exp(d) as exp2(d * LOG2E): what tl.exp computes, less its fix-up of denormal results (ex2.approx.ftz on NVIDIA)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
NEG_FLT_MAX = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def floor_exponent(t):
    """max(t, -FLT_MAX): 2^t * t is then 0 (not NaN) at t = -inf. A NaN stays NaN (a max that drops it, as the
    GPU's does by default, would turn a NaN logit into a zero probability and its row's outputs finite)."""
    return tl.maximum(t, NEG_FLT_MAX, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def base2_reference(row_max):
    """(c, offset): the base-2 reference of a running maximum m that is exactly m LOG2E minus a residual in [-1/2, 1/2].

    c = fl(m LOG2E) (0 while the row is all -inf) is what an element's exponent subtracts in one FFMA; fl rounds m LOG2E
    by up to half an ulp, which is < 1/2 only below 2^24 (|m| < ~1.2e7). Above, the residual r = fma(m, LOG2E, -c)
    (exact) is up to 2^(e - 24) and 2^r would overflow fp32 at r >= 128 (|m| > ~1.5e9), so its integer part,
    offset = floor(r + 1/2), is taken out of every exponent too: t = fma(z, LOG2E, -c) - offset (``rebase``), and the
    residual left (``residual``) is in [-1/2, 1/2]. Below 2^24 the offset is 0 and t is the FFMA's own result."""
    ref = tl.where(row_max == float("-inf"), 0.0, row_max * LOG2E)
    offset = tl.where(row_max == float("-inf"), 0.0, tl.floor(tl.fma(row_max, LOG2E, -ref) + 0.5))
    return ref, offset


@triton.jit
def rebase(z, new_max, old_ref, old_offset):
    """One block of an online loop in base 2: (c, offset) of the new running maximum (``base2_reference``), each z's
    exponent t = z LOG2E - (c + offset), and delta = the old reference minus the new (<= 0), by which 2^delta moves
    the sums kept so far. t is clamped to -FLT_MAX (``floor_exponent``): at a -inf logit 2^t = 0 and 2^t t = 0, not
    0 * -inf = NaN. The reference only grows, but from the all -inf state (sums 0, reference 0) it may fall: the min
    keeps 2^delta finite there."""
    ref, offset = base2_reference(new_max)
    t = floor_exponent(tl.fma(z, LOG2E, -ref) - offset)
    delta = tl.minimum((old_ref - ref) + (old_offset - offset), 0.0)
    return ref, offset, t, delta


@triton.jit
def residual(row_max, ref, offset):
    """m LOG2E - (c + offset), in [-1/2, 1/2] (0 while all -inf): sums relative to the reference times 2^-residual
    are relative to m itself."""
    return tl.where(row_max == float("-inf"), 0.0, tl.fma(row_max, LOG2E, -ref) - offset)


@triton.jit
def segment_block(first, rows, row_mask, segment_stride, row_stride, n_segments, BLOCK_SEGMENTS: tl.constexpr):
    """(offsets, mask) of segments [first, first + BLOCK_SEGMENTS) x ``rows`` in a partial whose element (segment,
    row) is at segment * segment_stride + row * row_stride."""
    segments = first + tl.arange(0, BLOCK_SEGMENTS)
    offsets = segments[:, None] * segment_stride + rows[None, :] * row_stride
    mask = (segments[:, None] < n_segments) & row_mask[None, :]
    return offsets, mask


@triton.jit
def merge_segments(row_max, row_sumexp, seg_max, seg_sumexp, BASE2: tl.constexpr = False):
    """Fold a (segments, rows) block of partials into the running (max, sum-exp) of each row.

    Returns (max, sum-exp, shift, row_rescale, seg_rescale): the new state, its reference (the new max, 0 while
    all -inf) and the factors exp(m - shift) that moved the old state and each segment to it, for the callers
    that carry more sums relative to the maximum (``token_stats``). BASE2: the maxima are base-2 exponents (sums
    relative to 2^m), moved by 2^(m - shift): exact powers of two where the maxima are integers (the Hopper
    epilogue's k)."""
    new_max = tl.maximum(row_max, tl.max(seg_max, axis=0))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # all -inf so far: no -inf - -inf
    if BASE2:
        row_rescale = tl.exp2(row_max - shift)
        seg_rescale = tl.exp2(seg_max - shift[None, :])
    else:
        row_rescale = tl.exp(row_max - shift)
        seg_rescale = tl.exp(seg_max - shift[None, :])
    new_sumexp = row_sumexp * row_rescale + tl.sum(seg_sumexp * seg_rescale, axis=0)
    return new_max, new_sumexp, shift, row_rescale, seg_rescale
