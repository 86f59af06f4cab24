"""Triton kernel: the teacher-student divergence of one pair of logits chunks, the student's entropy, and
d divergence / d (the student's raw logits); the PyTorch twin is ``torch_backend.divergence_rows``.

For row i of two (rows, V) chunks holding the whole vocabulary, with z_s, z_t the fp32 loss-space logits of each
side's transform (kernels/transform.py), p_s = softmax(z_s), p_t = softmax(z_t), d_j = (z_t,j - r_t) - (z_s,j - r_s)
and D = (lse_t - r_t) - (lse_s - r_s) (so that log p_t,j - log p_s,j = d_j - D), where r_s, r_t are each side's
maximum over the row's first block (0 if it is all -inf)::

    beta = 0:  KL(p_t || p_s) = E_pt[d] - D                         d/dz_s,j = p_s,j - p_t,j
    beta = 1:  KL(p_s || p_t) = D - E_ps[d]                         d/dz_s,j = p_s,j (E_ps[d] - d_j)
    else:      JSD = beta KL(p_t || m) + (1 - beta) KL(p_s || m),   m = beta p_t + (1 - beta) p_s
    entropy  = -sum_j p_s,j log p_s,j = log s_s - w_s / s_s         (as ``token_stats``)

(the KL gradient d/dz_s = p_s (log p_s - log p_t - KL) is p_s (E_ps[d] - d_j) since KL = D - E_ps[d]). The
expectations are differences of logits, so a divergence between close distributions is not the small difference
of two large log-probabilities: E_pt[d] and D are both of the size of d, not of z. The references keep d of the
size of the logits' spread within a row: two models' logits often differ by an offset c, and z_t - z_s would round
every d by ulp(c) (a KL of 5e-3 was 5% off at c = 3000, 7e-4 at c = 30; the references take it to fp32 round-off).

The JSD is taken per column through q_j = log((1 - beta) p_s,j / (beta p_t,j)) = (D - d_j) + log(1 - beta) -
log(beta) and sp(q) = log(1 + e^q) = max(q, 0) + log(1 + e^-|q|)::

    m_j = beta p_t,j (1 + e^q_j) = (1 - beta) p_s,j (1 + e^-q_j)
    u_t,j = log m_j - log p_t,j = log(beta) + sp(q_j)        u_s,j = log m_j - log p_s,j = log(1 - beta) + sp(-q_j)
    KL(p_s || m) = -sum_j p_s,j u_s,j        JSD = -(beta sum_j p_t,j u_t,j + (1 - beta) sum_j p_s,j u_s,j)
    d/dz_s,j = (1 - beta) p_s,j (-u_s,j - KL(p_s || m))

so that log m never cancels against a large log p (an error of q in column j moves the column's two terms by
opposite amounts, to first order).

One program per row, over blocks of BLOCK_V columns:

1. (m, s) of both sides online, as ``token_stats`` (base 2 relative to c = fl(m LOG2E), moved to base e relative to
   m at the end), and with them the cross sum of the KL (beta = 0: sum_j e_t,j d_j, beta = 1: sum_j e_s,j d_j:
   relative to the same reference as s, so E[d] = cross / s whatever the reference), and the student's entropy sum
   w_s = sum_j e_s,j (z_s,j - m_s) (only with ``entropy_out``). Then log s of each side and D = (m_t - m_s) +
   (log s_t - log s_s). A KL is done here.
2. JSD only: the sums sum_j p_t u_t and sum_j p_s u_s, log p = (z - m) - log s.
3. Only with ``grad_out``: the gradient times the row weight, the student's chain rule (kernels/transform.py),
   stored in grad_out's dtype. grad_out may share the student's memory: the logits themselves (in place), or,
   for a 2-byte G over fp32 logits, the first half of each row (divergence.py), where G's column j lands on
   logit j // 2, which another thread of the program reads. So each block is read (both sides) by every thread
   before any thread writes its gradient: a barrier between the block's loads and its store (Triton orders
   neither a block's global accesses across threads nor its loads and stores; earlier blocks were all read
   in earlier iterations, and G's block b covers logits of block b // 2 only).

Each side's logits are read once (KL), twice (KL with the gradient, JSD) or three times (JSD with the gradient).

-inf logits: a term p log p with p = 0 is 0, a column's products that would be 0 * inf are selected to 0 (e = 0 or
p = 0). A teacher -inf where the student is finite gives beta = 0 and the JSD finite values, and beta = 1 the
value +inf and a NaN gradient, as the twin (KL(p_s || p_t) is infinite); likewise a student -inf where the
teacher is finite gives beta = 1 and the JSD finite values, and beta = 0 the value +inf with the finite gradient
p_s - p_t; a student -inf where the teacher is -inf too carries nothing (gradient 0). Exponents are clamped to
-FLT_MAX as in ``token_stats`` (``online.floor_exponent``). (A row that is all -inf on either side gives NaN, and
so does a NaN logit on either side: its row's divergence, entropy and gradient, as eager's softmax.)

Float scalars are cast to fp32 at the top of the kernel (torch.compile passes Python floats as fp64); row offsets
are int64.
"""
import math

import torch
import triton
import triton.language as tl

from ..transform import LogitTransform
from .args import shares_memory
from .online import LN2, LOG2E, rebase, residual
from .transform import chain_rule, loss_space, transform_scalars

FORWARD_KL, REVERSE_KL, JSD = 0, 1, 2


@triton.jit
def _block_logits(student_row, teacher_row, cols, mask, s_factor, s_u_per_x, s_cap, t_factor, t_u_per_x, t_cap,
                  ref_s, ref_t, S_HAS_SOFTCAP: tl.constexpr, S_HAS_FACTOR: tl.constexpr,
                  T_HAS_SOFTCAP: tl.constexpr, T_HAS_FACTOR: tl.constexpr):
    """(z_s, z_t, d, t) of one block of a row: the loss-space logits (-inf past the end of the row), d = (z_t - r_t)
    - (z_s - r_s) with each side's reference r (module docstring; of the logits read as 0 past the end: finite
    there, no -inf - -inf) and the student's t for ``chain_rule``."""
    x_s = tl.load(student_row + cols, mask=mask, other=0.0).to(tl.float32)
    x_t = tl.load(teacher_row + cols, mask=mask, other=0.0).to(tl.float32)
    z_s, t = loss_space(x_s, s_factor, s_u_per_x, s_cap, S_HAS_SOFTCAP, S_HAS_FACTOR)
    z_t, _ = loss_space(x_t, t_factor, t_u_per_x, t_cap, T_HAS_SOFTCAP, T_HAS_FACTOR)
    d = (z_t - ref_t) - (z_s - ref_s)
    return tl.where(mask, z_s, float("-inf")), tl.where(mask, z_t, float("-inf")), d, t


@triton.jit
def _online_step(z, running_max, running_ref, running_offset):
    """(new max, new base-2 reference (c, offset), e = 2^(z LOG2E - c - offset), its exponent, the old reference
    minus the new) of one block (``online.rebase``)."""
    new_max = tl.maximum(running_max, tl.max(z, axis=0))
    new_ref, new_offset, t, delta = rebase(z, new_max, running_ref, running_offset)
    return new_max, new_ref, new_offset, tl.exp2(t), t, delta


@triton.jit
def _log_probs(z, row_max, log_sumexp):
    """(log p, p) of a block: log p = (z - m) - log s (z - m exact near the maximum: no rounding through lse)."""
    log_p = (z - row_max) - log_sumexp
    return log_p, tl.exp2(log_p * LOG2E)


@triton.jit
def _jsd_terms(d, q_offset, log_beta, log_one_minus_beta):
    """(u_t, u_s) of a block (module docstring): q = q_offset - d, q_offset = D + log(1 - beta) - log(beta)."""
    q = q_offset - d
    softplus_tail = tl.log(1.0 + tl.exp2(-tl.abs(q) * LOG2E))  # log(1 + e^-|q|)
    u_t = log_beta + (tl.maximum(q, 0.0) + softplus_tail)
    u_s = log_one_minus_beta + (tl.maximum(-q, 0.0) + softplus_tail)
    return u_t, u_s


@triton.jit
def _divergence_kernel(
    student_ptr,
    student_row_stride,
    teacher_ptr,
    teacher_row_stride,
    divergence_ptr,
    entropy_ptr,
    grad_ptr,
    grad_row_stride,
    row_weight_ptr,
    n_cols,
    s_factor,
    s_u_per_x,
    s_cap,
    t_factor,
    t_u_per_x,
    t_cap,
    beta,
    log_beta,
    log_one_minus_beta,
    S_HAS_SOFTCAP: tl.constexpr,
    S_HAS_FACTOR: tl.constexpr,
    T_HAS_SOFTCAP: tl.constexpr,
    T_HAS_FACTOR: tl.constexpr,
    MODE: tl.constexpr,
    NEED_ENTROPY: tl.constexpr,
    NEED_GRAD: tl.constexpr,
    HAS_ROW_WEIGHT: tl.constexpr,
    GRAD_OVER_STUDENT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One row: divergence_ptr[row], entropy_ptr[row] (NEED_ENTROPY), grad_ptr's row (NEED_GRAD); MODE 0: KL(p_t ||
    p_s), 1: KL(p_s || p_t), 2: the JSD of mixture weight beta (module docstring)."""
    s_factor, s_u_per_x, s_cap = transform_scalars(s_factor, s_u_per_x, s_cap)
    t_factor, t_u_per_x, t_cap = transform_scalars(t_factor, t_u_per_x, t_cap)
    beta = tl.cast(beta, tl.float32)
    log_beta = tl.cast(log_beta, tl.float32)
    log_one_minus_beta = tl.cast(log_one_minus_beta, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    student_row = student_ptr + row * student_row_stride
    teacher_row = teacher_ptr + row * teacher_row_stride
    offsets = tl.arange(0, BLOCK_V)

    # each side's logit reference r: the first block's maximum (0 where that block is all -inf)
    z_s, z_t, _, _ = _block_logits(student_row, teacher_row, offsets, offsets < n_cols, s_factor, s_u_per_x, s_cap,
                                   t_factor, t_u_per_x, t_cap, 0.0, 0.0, S_HAS_SOFTCAP, S_HAS_FACTOR, T_HAS_SOFTCAP,
                                   T_HAS_FACTOR)
    ref_s_logit = tl.max(z_s, axis=0)
    ref_s_logit = tl.where(ref_s_logit == float("-inf"), 0.0, ref_s_logit)
    ref_t_logit = tl.max(z_t, axis=0)
    ref_t_logit = tl.where(ref_t_logit == float("-inf"), 0.0, ref_t_logit)

    # ---- pass 1: (m, s) of both sides, the KL's cross sum, the entropy's w ----
    max_s = float("-inf")
    ref_s = 0.0  # base-2 reference of the student's sums: fl(m_s LOG2E), 0 while all -inf
    offset_s = 0.0  # its integer correction (online.base2_reference)
    sumexp_s = 0.0
    wsum_s = 0.0
    max_t = float("-inf")
    ref_t = 0.0
    offset_t = 0.0
    sumexp_t = 0.0
    cross = 0.0  # sum_j e_j d_j, e of the teacher (MODE 0) or of the student (MODE 1), base 2 as that side's s
    for start in range(0, n_cols, BLOCK_V):
        cols = start + offsets
        mask = cols < n_cols
        z_s, z_t, d, _ = _block_logits(student_row, teacher_row, cols, mask, s_factor, s_u_per_x, s_cap, t_factor,
                                       t_u_per_x, t_cap, ref_s_logit, ref_t_logit, S_HAS_SOFTCAP, S_HAS_FACTOR,
                                       T_HAS_SOFTCAP, T_HAS_FACTOR)
        max_s, ref_s, offset_s, e_s, exponent_s, delta_s = _online_step(z_s, max_s, ref_s, offset_s)
        max_t, ref_t, offset_t, e_t, _, delta_t = _online_step(z_t, max_t, ref_t, offset_t)
        rescale_s = tl.exp2(delta_s)
        rescale_t = tl.exp2(delta_t)
        if NEED_ENTROPY:  # w in base 2 relative to c (token_stats): w' = 2^delta (w + delta s)
            wsum_s = rescale_s * (wsum_s + delta_s * sumexp_s) + tl.sum(e_s * exponent_s, axis=0)
        # d only where the weight is not 0: no 0 * inf at a -inf logit (past the row's end e = 0, d finite)
        if MODE == 0:
            cross = cross * rescale_t + tl.sum(tl.where(e_t == 0.0, 0.0, e_t * d), axis=0)
        elif MODE == 1:
            cross = cross * rescale_s + tl.sum(tl.where(e_s == 0.0, 0.0, e_s * d), axis=0)
        sumexp_s = sumexp_s * rescale_s + tl.sum(e_s, axis=0)
        sumexp_t = sumexp_t * rescale_t + tl.sum(e_t, axis=0)
    # base e relative to m itself: s <- 2^-r s, w <- 2^-r (w - r s) ln 2, r = m LOG2E - c - offset (token_stats)
    residual_s = residual(max_s, ref_s, offset_s)
    residual_t = residual(max_t, ref_t, offset_t)
    log_sumexp_s = tl.log(sumexp_s) - residual_s * LN2
    log_sumexp_t = tl.log(sumexp_t) - residual_t * LN2
    # D = lse_t - lse_s relative to the references, as d
    lse_gap = ((max_t - ref_t_logit) - (max_s - ref_s_logit)) + (log_sumexp_t - log_sumexp_s)
    if NEED_ENTROPY:  # log s - w / s, both relative to m: the 2^-r of s and w cancel in w / s
        tl.store(entropy_ptr + row, log_sumexp_s - ((wsum_s - residual_s * sumexp_s) * LN2) / sumexp_s)

    mean_gap = 0.0  # E_ps[d] (MODE 1)
    q_offset = 0.0  # D + log(1 - beta) - log(beta) (MODE 2)
    ps_us = 0.0  # sum_j p_s u_s = -KL(p_s || m) (MODE 2)
    if MODE == 0:
        value = cross / sumexp_t - lse_gap
    elif MODE == 1:
        mean_gap = cross / sumexp_s
        value = lse_gap - mean_gap
    else:
        # ---- pass 2 (JSD): sum_j p_t u_t and sum_j p_s u_s ----
        q_offset = lse_gap + (log_one_minus_beta - log_beta)
        pt_ut = 0.0
        for start in range(0, n_cols, BLOCK_V):
            cols = start + offsets
            mask = cols < n_cols
            z_s, z_t, d, _ = _block_logits(student_row, teacher_row, cols, mask, s_factor, s_u_per_x, s_cap,
                                           t_factor, t_u_per_x, t_cap, ref_s_logit, ref_t_logit, S_HAS_SOFTCAP,
                                           S_HAS_FACTOR, T_HAS_SOFTCAP, T_HAS_FACTOR)
            _, p_s = _log_probs(z_s, max_s, log_sumexp_s)
            _, p_t = _log_probs(z_t, max_t, log_sumexp_t)
            u_t, u_s = _jsd_terms(d, q_offset, log_beta, log_one_minus_beta)
            # p u = 0 where p = 0 (u may be inf there, or NaN where both logits are -inf)
            pt_ut += tl.sum(tl.where(p_t == 0.0, 0.0, p_t * u_t), axis=0)
            ps_us += tl.sum(tl.where(p_s == 0.0, 0.0, p_s * u_s), axis=0)
        value = -(beta * pt_ut + (1.0 - beta) * ps_us)
    tl.store(divergence_ptr + row, value)

    # ---- last pass: row_weight * d divergence / d x_s ----
    if NEED_GRAD:
        scale = s_factor
        if HAS_ROW_WEIGHT:
            scale = scale * tl.load(row_weight_ptr + row).to(tl.float32)
        grad_row = grad_ptr + row * grad_row_stride
        for start in range(0, n_cols, BLOCK_V):
            cols = start + offsets
            mask = cols < n_cols
            # both sides of the block are read before its gradient is written (grad_out may be the student's logits)
            z_s, z_t, d, t = _block_logits(student_row, teacher_row, cols, mask, s_factor, s_u_per_x, s_cap,
                                           t_factor, t_u_per_x, t_cap, ref_s_logit, ref_t_logit, S_HAS_SOFTCAP,
                                           S_HAS_FACTOR, T_HAS_SOFTCAP, T_HAS_FACTOR)
            _, p_s = _log_probs(z_s, max_s, log_sumexp_s)
            if MODE == 0:
                _, p_t = _log_probs(z_t, max_t, log_sumexp_t)
                grad = p_s - p_t
            elif MODE == 1:
                grad = tl.where(p_s == 0.0, 0.0, p_s * (mean_gap - d))
            else:
                _, u_s = _jsd_terms(d, q_offset, log_beta, log_one_minus_beta)
                # (1 - beta) p_s (log p_s - log m - KL(p_s || m)) = (1 - beta) p_s (sum p_s u_s - u_s)
                grad = tl.where(p_s == 0.0, 0.0, ((1.0 - beta) * p_s) * (ps_us - u_s))
            grad = chain_rule(grad, t, scale, S_HAS_SOFTCAP)
            if GRAD_OVER_STUDENT:  # no thread writes before every thread has read this block (see the docstring)
                tl.debug_barrier()
            tl.store(grad_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"divergence_rows: {message}")


def divergence_rows(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    divergence_out: torch.Tensor,
    entropy_out: torch.Tensor | None,
    grad_out: torch.Tensor | None,
    row_weight: torch.Tensor | None,
    *,
    student: LogitTransform,
    teacher: LogitTransform,
    beta: float,
) -> None:
    """Per row of two (rows, V) chunks holding the whole vocabulary (raw logits x_s, x_t, unit column stride, any
    row stride): the divergence into ``divergence_out`` ((rows,) fp32; ``beta`` 0: KL(p_t || p_s), 1: KL(p_s ||
    p_t), between: the generalized JSD), the student's entropy into ``entropy_out`` (when given), and into
    ``grad_out`` (when given; (rows, V), may be ``student_logits`` itself; its dtype) ``row_weight[i]`` ((rows,),
    1 when None) times d divergence_i / d x_s. Formulas in the module docstring."""
    _check(student_logits.dim() == 2, f"student_logits must be 2-d, got shape {tuple(student_logits.shape)}")
    rows, n_cols = student_logits.shape
    _check(teacher_logits.shape == student_logits.shape,
           f"teacher_logits {tuple(teacher_logits.shape)} and student_logits {tuple(student_logits.shape)} differ")
    beta = float(beta)
    _check(0.0 <= beta <= 1.0, f"beta must be in [0, 1], got {beta}")
    device = student_logits.device
    for name, out in (("divergence_out", divergence_out), ("entropy_out", entropy_out)):
        _check(out is None or (out.shape == (rows,) and out.dtype == torch.float32 and out.device == device),
               f"{name} must be a (rows,) = ({rows},) fp32 tensor on {device}, got "
               f"{None if out is None else (tuple(out.shape), out.dtype, out.device)}")
    _check(row_weight is None or (row_weight.shape == (rows,) and row_weight.is_floating_point()
                                  and row_weight.device == device),
           f"row_weight must be a (rows,) = ({rows},) float tensor on {device}, got "
           f"{None if row_weight is None else (tuple(row_weight.shape), row_weight.dtype, row_weight.device)}")
    _check(grad_out is None or (grad_out.shape == student_logits.shape and grad_out.device == device),
           f"grad_out must be a ({rows}, {n_cols}) tensor on {device}, got "
           f"{None if grad_out is None else (tuple(grad_out.shape), grad_out.device)}")
    _check(teacher_logits.device == device, f"teacher_logits on {teacher_logits.device}, student_logits on {device}")
    if rows == 0:
        return
    for name, t in (("student_logits", student_logits), ("teacher_logits", teacher_logits), ("grad_out", grad_out)):
        if t is not None:
            _check(n_cols <= 1 or t.stride(1) == 1, f"{name} needs a unit column stride, got strides {t.stride()}")
    for name, t in (("divergence_out", divergence_out), ("entropy_out", entropy_out), ("row_weight", row_weight)):
        if t is not None:
            _check(rows == 1 or t.stride(0) == 1, f"{name} must be contiguous, got stride {t.stride()}")
    mode = 0 if beta == 0.0 else 1 if beta == 1.0 else 2
    # log(beta), log(1 - beta) in float64 on the host (used by the JSD only)
    log_beta = math.log(beta) if mode == 2 else 0.0
    log_one_minus_beta = math.log1p(-beta) if mode == 2 else 0.0
    s_flags, t_flags = student.kernel_flags(), teacher.kernel_flags()
    block_v = min(triton.next_power_of_2(max(n_cols, 1)), 2048)
    _divergence_kernel[(rows,)](
        student_logits,
        student_logits.stride(0),
        teacher_logits,
        teacher_logits.stride(0),
        divergence_out,
        entropy_out if entropy_out is not None else divergence_out,
        grad_out if grad_out is not None else student_logits,
        grad_out.stride(0) if grad_out is not None else 0,
        row_weight if row_weight is not None else divergence_out,
        n_cols,
        *student.kernel_args(),
        *teacher.kernel_args(),
        beta,
        log_beta,
        log_one_minus_beta,
        S_HAS_SOFTCAP=s_flags["HAS_SOFTCAP"],
        S_HAS_FACTOR=s_flags["HAS_FACTOR"],
        T_HAS_SOFTCAP=t_flags["HAS_SOFTCAP"],
        T_HAS_FACTOR=t_flags["HAS_FACTOR"],
        MODE=mode,
        NEED_ENTROPY=entropy_out is not None,
        NEED_GRAD=grad_out is not None,
        HAS_ROW_WEIGHT=row_weight is not None,
        GRAD_OVER_STUDENT=grad_out is not None and shares_memory(grad_out, student_logits),
        BLOCK_V=block_v,
        # H200, 512 rows x 151936 fp32 columns, student softcap, bf16 gradient: 8 warps 0.25 / 0.51 / 0.70 ms (KL /
        # JSD / JSD with the gradient, 2.4-2.9 TB/s of logits), 4 warps 0.28 / 0.63 / 0.78, 16 slower; no spills
        # (48 registers at 8 warps); measured before the gradient's barrier (GRAD_OVER_STUDENT), not since
        num_warps=8,
    )
