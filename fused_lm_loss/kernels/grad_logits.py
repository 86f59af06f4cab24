"""Triton kernel: d(loss)/d(raw logits) for one chunk, in fp32, stored in the matmul dtype.

With z the loss-space logits of row i (see ``row_stats``), lse_i its log-sum-exp over the whole
(possibly vocab-parallel) vocabulary of size V, p_ij = exp(z_ij - lse_i), eps the label smoothing,
zl the z-loss coefficient and t_i the row's target column (-1: not in this shard)::

    loss_i = (1 - eps) * (lse_i - z_i,t) + eps * (lse_i - mean_j z_ij) + zl * lse_i**2

    dloss_i / dz_ij = p_ij * (1 + 2 * zl * lse_i) - eps / V - (1 - eps) * [j == t_i]

and the chain rule back to the raw matmul output x_ij through the logit transform (kernels/transform.py:
dz/dx = factor * (1 - tanh^2) with a softcap, factor = scale / temperature).

With class weights w (HAS_CLASS_WEIGHT; F.cross_entropy's weight=, combined with smoothing as PyTorch does,
loss in ``torch_backend.loss_from_stats``), w_t = w[t_i] (0 for t_i < 0) and W = sum_j w_j::

    dloss_i / dz_ij = p_ij * ((1 - eps) w_t + eps W / V + 2 * zl * lse_i) - (1 - eps) w_t [j == t_i] - (eps / V) w_j

w_t is loaded per row, W from a 1-element device tensor (the launcher sums the weights on the device), and
w_j beside the logits only with smoothing (SMOOTH_WEIGHTS). No w_j z_j product appears, so a class of weight
0 at a -inf logit is safe as any other (p = 0).

Each element is finally multiplied by the row's gradient scale (1/num_items for "mean", times the
GradScaler scale; or the per-token grad_output for reduction="none"). With a second output (``out_lo``,
used with fp32 logits) the fp32 gradient is stored as an unevaluated pair hi + lo of the matmul dtype,
hi = round(g), lo = round(g - hi): ~16 significant bits, so the backward matmuls (one per term, fp32
accumulation) see G almost as exactly as fp32, at tensor-core speed. The output may alias the input
(in-place: each element is read, then written, by the same program), which is how the chunk loop
reuses the logits buffer for the gradient. Grid: (rows, cdiv(V, BLOCK_V)); row offsets are int64. Both
kernels here begin alike (``grad_prologue``: the block's logits, z, p).

-inf logits need no special case here: p = exp(-inf - lse) = 0, and with softcap tanh(-inf) = -1 exactly,
so dz/dx = 0, as autograd gives. A row whose lse is -inf (all its logits -inf) gets NaN, as in PyTorch.
Float scalars are cast to fp32 first (torch.compile passes Python floats as fp64).

``token_grad_logits`` is the same kind of kernel for the per-token outputs of ``token_stats`` (log-probability
of the label and entropy, with per-row weights a and b): dz_j = a (delta_jt - p_j) + b p_j (E - z_j), with
E = lse - entropy the mean logit; formula and -inf handling in its docstring.
"""
import torch
import triton
import triton.language as tl

from ..loss_terms import LossTerms
from ..transform import LogitTransform
from .args import check_class_weight, check_like, check_target, check_vector
from .online import LOG2E
from .transform import chain_rule, loss_space, transform_scalars
# token_grad_logits: logits more than 2^64 below the mean logit are raised to it (their p is 0 either way)
CLAMP_BELOW_MEAN = tl.constexpr(1.8446744073709552e19)


@triton.jit
def grad_prologue(logits_ptr, logits_row_stride, lse_ptr, n_cols, factor, u_per_x, cap, HAS_SOFTCAP: tl.constexpr,
                  HAS_FACTOR: tl.constexpr, BLOCK_V: tl.constexpr):
    """This program's (row, columns, mask), and of its logits block the loss-space z, the tanh t of the transform
    (for ``chain_rule``), the row's lse and p = exp(z - lse)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < n_cols
    x = tl.load(logits_ptr + row * logits_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    z, t = loss_space(x, factor, u_per_x, cap, HAS_SOFTCAP, HAS_FACTOR)
    lse = tl.load(lse_ptr + row)
    return row, cols, mask, z, t, lse, tl.exp2((z - lse) * LOG2E)


@triton.jit
def store_grad(grad_ptr, grad_lo_ptr, offsets, grad, mask, SPLIT: tl.constexpr):
    """Store fp32 ``grad`` rounded to the output dtype; with SPLIT also the rounding residual in ``grad_lo``."""
    hi = grad.to(grad_ptr.dtype.element_ty)
    tl.store(grad_ptr + offsets, hi, mask=mask)
    if SPLIT:
        tl.store(grad_lo_ptr + offsets, (grad - hi.to(tl.float32)).to(grad_lo_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grad_logits_kernel(
    logits_ptr,
    logits_row_stride,
    grad_ptr,
    grad_lo_ptr,
    grad_row_stride,
    target_ptr,
    lse_ptr,
    row_scale_ptr,
    class_weight_ptr,
    weight_sum_ptr,
    n_cols,
    grad_scale,
    factor,
    u_per_x,
    cap,
    smoothing_per_class,
    target_weight,
    z_loss,
    HAS_SOFTCAP: tl.constexpr,
    HAS_FACTOR: tl.constexpr,
    PER_ROW_SCALE: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_CLASS_WEIGHT: tl.constexpr,
    SMOOTH_WEIGHTS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    grad_scale = tl.cast(grad_scale, tl.float32)
    factor, u_per_x, cap = transform_scalars(factor, u_per_x, cap)
    smoothing_per_class = tl.cast(smoothing_per_class, tl.float32)
    target_weight = tl.cast(target_weight, tl.float32)
    z_loss = tl.cast(z_loss, tl.float32)
    row, cols, mask, z, t, lse, p = grad_prologue(
        logits_ptr, logits_row_stride, lse_ptr, n_cols, factor, u_per_x, cap, HAS_SOFTCAP, HAS_FACTOR, BLOCK_V
    )
    scale = grad_scale
    if PER_ROW_SCALE:
        scale = scale * tl.load(row_scale_ptr + row)
    if HAS_CLASS_WEIGHT:
        target = tl.load(target_ptr + row)
        has_target = target >= 0
        # (1 - eps) w_t, 0 for a target in another vocab shard (target_weight = 1 - eps)
        w_t = tl.load(class_weight_ptr + tl.where(has_target, target, 0))
        target_term = tl.where(has_target, target_weight * w_t, 0.0)
        coefficient = target_term + 2.0 * z_loss * lse
        if SMOOTH_WEIGHTS:  # eps > 0: (eps / V) W in every p's coefficient, (eps / V) w_j per column
            coefficient += smoothing_per_class * tl.load(weight_sum_ptr)
            w = tl.load(class_weight_ptr + cols, mask=mask, other=0.0)
            grad = p * coefficient - smoothing_per_class * w
        else:
            grad = p * coefficient
        grad = tl.where(cols == target, grad - target_term, grad)
    else:
        grad = p * (1.0 + 2.0 * z_loss * lse) - smoothing_per_class
        grad = tl.where(cols == tl.load(target_ptr + row), grad - target_weight, grad)
    grad = chain_rule(grad, t, scale * factor, HAS_SOFTCAP)
    store_grad(grad_ptr, grad_lo_ptr, row * grad_row_stride + cols, grad, mask, SPLIT)


def grad_logits(
    logits: torch.Tensor,
    out: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    *,
    transform: LogitTransform,
    terms: LossTerms,
    grad_scale: float,
    row_scale: torch.Tensor | None,
    out_lo: torch.Tensor | None = None,
) -> None:
    """Write d(loss)/d(logits) of a (rows, V) chunk into ``out`` (which may be ``logits`` itself), times
    ``grad_scale`` (and ``row_scale`` per row), and the rounding residual into ``out_lo`` when given; with class
    weights in ``terms`` the gradient of the class-weighted loss."""
    rows, n_cols = logits.shape
    class_weight = terms.class_weight
    check_target(target, rows, logits.device, "grad_logits")
    check_class_weight(class_weight, n_cols, logits.device, "grad_logits")
    check_vector(lse, rows, logits.device, "grad_logits", "lse")
    check_vector(row_scale, rows, logits.device, "grad_logits", "row_scale")
    check_like(out, logits, "grad_logits", "out")
    check_like(out_lo, logits, "grad_logits", "out_lo")
    if rows == 0:
        return
    assert logits.stride(1) == 1
    assert out_lo is None or out_lo.stride() == out.stride()
    block_v = min(triton.next_power_of_2(n_cols), 2048)
    weighted = class_weight is not None
    smooth_weights = weighted and terms.smooths
    # W on the device, no host sync: one tiny reduction per call
    weight_sum = class_weight.sum().reshape(1) if smooth_weights else None
    _grad_logits_kernel[(rows, triton.cdiv(n_cols, block_v))](
        logits,
        logits.stride(0),
        out,
        out if out_lo is None else out_lo,
        out.stride(0),
        target,
        lse,
        row_scale if row_scale is not None else lse,
        class_weight if weighted else lse,
        weight_sum if smooth_weights else lse,
        n_cols,
        float(grad_scale),
        *transform.kernel_args(),
        terms.smoothing_per_class,
        1.0 - float(terms.label_smoothing),
        float(terms.z_loss),
        **transform.kernel_flags(),
        PER_ROW_SCALE=row_scale is not None,
        SPLIT=out_lo is not None,
        HAS_CLASS_WEIGHT=weighted,
        SMOOTH_WEIGHTS=smooth_weights,
        BLOCK_V=block_v,
        num_warps=4 if transform.has_softcap or block_v < 2048 else 8,  # softcap: 4 warps 10% faster (NOTES.md)
    )


@triton.jit
def _token_grad_kernel(
    logits_ptr,
    logits_row_stride,
    grad_ptr,
    grad_row_stride,
    target_ptr,
    lse_ptr,
    entropy_ptr,
    grad_logprob_ptr,
    grad_entropy_ptr,
    n_cols,
    factor,
    u_per_x,
    cap,
    HAS_SOFTCAP: tl.constexpr,
    HAS_FACTOR: tl.constexpr,
    HAS_LOGPROB: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """See ``token_grad_logits``; one program per (row, BLOCK_V columns)."""
    factor, u_per_x, cap = transform_scalars(factor, u_per_x, cap)
    row, cols, mask, z, t, lse, p = grad_prologue(
        logits_ptr, logits_row_stride, lse_ptr, n_cols, factor, u_per_x, cap, HAS_SOFTCAP, HAS_FACTOR, BLOCK_V
    )
    if HAS_LOGPROB:
        a = tl.load(grad_logprob_ptr + row)
        if HAS_ENTROPY:
            mean_z = lse - tl.load(entropy_ptr + row)  # E_p[z] = lse - entropy
            # p (b (E - z) - a): z raised to E - 2^64 first, so that a -inf logit gives p * finite = 0, not
            # 0 * inf (any z that low has p = exp(z - lse) = 0 already, lse >= E); p NaN (a row of -inf only)
            # gives NaN, as -a p does in the twin
            clamped = tl.maximum(z, mean_z - CLAMP_BELOW_MEAN)
            grad = p * tl.fma(tl.load(grad_entropy_ptr + row), mean_z - clamped, -a)
        else:
            grad = p * -a
        # compared as int32 (a column < V < 2^31): one compare per element instead of a 64-bit one
        grad = tl.where(cols == tl.load(target_ptr + row).to(tl.int32), grad + a, grad)
    elif HAS_ENTROPY:
        mean_z = lse - tl.load(entropy_ptr + row)
        # b p (E - z), 0 where p is not positive: at a -inf logit (0 * inf), and in a row of -inf only (p NaN)
        grad = tl.where(p > 0.0, (tl.load(grad_entropy_ptr + row) * p) * (mean_z - z), 0.0)
    else:
        grad = tl.zeros((BLOCK_V,), dtype=tl.float32)
    grad = chain_rule(grad, t, factor, HAS_SOFTCAP)
    store_grad(grad_ptr, grad_ptr, row * grad_row_stride + cols, grad, mask, False)


def token_grad_logits(
    logits: torch.Tensor,
    out: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    *,
    transform: LogitTransform,
) -> None:
    """d(sum_i a_i logprob_i + b_i entropy_i) / d(raw logits) of a (rows, V) chunk (``token_stats``; any
    columns of the vocabulary: lse and entropy are the whole row's, target -1 where the label is elsewhere),
    a = grad_logprob, b = grad_entropy ((rows,) fp32, or None: no such term), into ``out`` (which may be
    ``logits`` itself), in out's dtype. With p = exp(z - lse) and E = lse - entropy = E_p[z]::

        dz_j = a (delta_jt - p_j) + b p_j (E - z_j)        (b p_j (E - z_j) = 0 where p_j = 0)

    then dz/dx as in ``grad_logits`` (the transform's chain rule). A row that is all -inf
    (lse -inf, p NaN) gets NaN from the a term, and 0 from the b term alone, as the PyTorch twin."""
    rows, n_cols = logits.shape
    check_target(target, rows, logits.device, "token_grad_logits")
    if rows == 0:
        return
    assert logits.stride(1) == 1 and out.stride(1) == 1
    for per_row in (lse, entropy, grad_logprob, grad_entropy):
        assert per_row is None or (per_row.shape == (rows,) and (rows == 1 or per_row.stride(0) == 1))
    block_v = min(triton.next_power_of_2(n_cols), 2048)
    _token_grad_kernel[(rows, triton.cdiv(n_cols, block_v))](
        logits,
        logits.stride(0),
        out,
        out.stride(0),
        target,
        lse,
        entropy,
        grad_logprob if grad_logprob is not None else lse,
        grad_entropy if grad_entropy is not None else lse,
        n_cols,
        *transform.kernel_args(),
        **transform.kernel_flags(),
        HAS_LOGPROB=grad_logprob is not None,
        HAS_ENTROPY=grad_entropy is not None,
        BLOCK_V=block_v,
        num_warps=4 if transform.has_softcap or block_v < 2048 else 8,  # as grad_logits (not measured here)
    )
