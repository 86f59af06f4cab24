"""The "torch" backend: the PyTorch twins of the Triton kernels (same signatures, same fp32 math).

The default for CPU tensors (see ``backends.py`` for the switch). The chunk loop in ``chunked.py`` is the
same for both backends; only these per-chunk steps differ. See the kernel files in ``kernels/`` for the math.
"""
from __future__ import annotations

import torch

from .exp_epilogue import LN2, LOG2E, ExpStats, exp_matmul_reference
from .loss_terms import LossTerms, loss_from_stats
from .transform import LogitTransform

name = "torch"


def supports_stats_in_matmul(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """No fused matmul here: a forward without gradients computes its logits chunk and ``row_losses``."""
    return False


def supports_exp_epilogue(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """The exp epilogue is a GPU GEMM's (exp_epilogue.py); its PyTorch twin runs only where a test asks for it."""
    return False


def exp_matmul(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, e_out: torch.Tensor) -> ExpStats:
    """E and the row statistics of the Hopper path's logits GEMM (``exp_epilogue.exp_matmul_reference``)."""
    return exp_matmul_reference(hidden, weight, target, e_out)


def grad_from_exp(e: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, stats: ExpStats, *, terms: LossTerms,
                  grad_scale: float, row_scale: torch.Tensor | None) -> torch.Tensor:
    """E in place as G up to one factor per row, and those factors (kernels/grad_from_exp.py): every tile moved to
    the row's largest k (an exact power of two), the target column G / f from the fp32 target logit."""
    rows, vocab = e.shape
    k_top = stats.k.amax(1)
    scale = torch.full_like(lse, grad_scale) if row_scale is None else grad_scale * row_scale
    z_factor = 1.0 + 2.0 * terms.z_loss * lse
    folded = z_factor != 0  # (where it is 0 only the target's G is left: f leaves it out, E's other columns 0)
    base = torch.exp2(k_top - lse * LOG2E) * scale
    factor = torch.where(folded, base * z_factor, base)
    if rows:
        move = torch.exp2(stats.k - k_top[:, None]) * folded[:, None]
        e.view(rows, -1, stats.tile_n).mul_(move[:, :, None])
    has = torch.nonzero(target >= 0).squeeze(1)
    grad_target = (torch.exp(stats.target_logit - lse) * z_factor - 1.0) * scale
    nonzero = factor != 0
    e_target = torch.where(nonzero, grad_target / torch.where(nonzero, factor, 1.0), 0.0)
    e[has, target[has]] = e_target[has].to(e.dtype)
    return factor


def merge_exp_stats(stats: ExpStats, loss_out: torch.Tensor, lse_out: torch.Tensor, *, terms: LossTerms) -> None:
    """Per-row loss and lse from the epilogue's per-tile k and sums (kernels/row_stats.py ``merge_exp_stats``): the
    tiles merged at the row's largest k, every other tile's sum moved by an exact power of two."""
    k_max = stats.k.amax(1)
    sum_exp = (torch.exp2(stats.k - k_max[:, None]) * stats.sum_exp).sum(1)
    loss, lse = loss_from_stats(k_max * LN2, sum_exp, stats.target_logit, torch.zeros_like(k_max), terms)
    loss_out.copy_(loss)
    lse_out.copy_(lse)


def matmul_partials(*args, **kwargs):
    raise NotImplementedError("the torch backend has no matmul with a statistics epilogue")


merge_partials = matmul_partial_bytes_per_row = matmul_partials


def select_rows(labels: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions, targets, summary = (count, min, max) of the labels that carry a loss); see
    kernels/select_rows.py."""
    # Compared as int64, as the kernel does: a narrower tensor compared with a Python int would wrap the int
    # into its dtype (uint8 labels != -100 is False for the label 156; int32 labels != 2**40 for 0).
    labels = labels.long()
    positions = torch.nonzero(labels != ignore_index).squeeze(1)
    targets = labels[positions]
    if positions.numel() == 0:
        return positions, targets, torch.zeros(3, dtype=torch.int64, device=labels.device)
    lowest, highest = torch.aminmax(targets)
    return positions, targets, torch.stack([torch.tensor(positions.numel(), device=labels.device), lowest, highest])


def row_stats(
    logits: torch.Tensor, target: torch.Tensor, *, transform: LogitTransform, terms: LossTerms
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, sum-exp, target logit, logit sum) per row; the sum (only when ``terms.smooths``) is weighted by the
    class weights when given, sum_j w_j z_j with w_j z_j = 0 where w_j = 0 (a class of weight 0 adds nothing, even
    at a -inf logit; F.cross_entropy's smoothing term gives NaN there, 0 * -inf, though its gradient is finite)."""
    z, _ = transform.apply(logits)
    row_max = z.amax(dim=1)
    # A row of -inf only: exponents relative to 0, not to its -inf max (-inf - -inf = NaN), so sum-exp 0 and
    # lse = -inf, as torch.logsumexp (and as the kernels: a vocab shard that is all -inf merges as nothing).
    shift = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
    row_sumexp = torch.exp(z - shift[:, None]).sum(dim=1)
    has_target = target >= 0
    target_logit = z.gather(1, target.clamp(min=0)[:, None]).squeeze(1)
    target_logit = torch.where(has_target, target_logit, torch.zeros_like(target_logit))
    weight = terms.class_weight
    if not terms.smooths:
        logit_sum = torch.zeros_like(row_max)
    else:
        logit_sum = (z if weight is None else torch.where(weight != 0, z * weight, 0.0)).sum(dim=1)
    return row_max, row_sumexp, target_logit, logit_sum


def row_losses(
    logits: torch.Tensor,
    target: torch.Tensor,
    loss_out: torch.Tensor,
    lse_out: torch.Tensor,
    *,
    transform: LogitTransform,
    terms: LossTerms,
) -> None:
    """Per-row loss and lse of a chunk holding the whole vocabulary (``loss_terms.loss_from_stats``)."""
    stats = row_stats(logits, target, transform=transform, terms=terms)
    weight = terms.class_weight
    # w_t = 0 for a target on another shard (-1), as the kernel: weight[-1] would be the last class's
    weights = {} if weight is None else dict(
        target_weight=torch.where(target >= 0, weight[target.clamp(min=0)], 0.0), weight_sum=weight.sum())
    loss, lse = loss_from_stats(*stats, terms, **weights)
    loss_out.copy_(loss)
    lse_out.copy_(lse)


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
    """d(loss)/d(logits) (kernels/grad_logits.py); with class weights w (see ``loss_terms``)::

        dz_j = p_j ((1 - eps) w_t + eps W / V + 2 z_loss lse) - (1 - eps) w_t [j = t] - (eps / V) w_j
    """
    z, capped = transform.apply(logits)
    p = torch.exp(z - lse[:, None])
    rows = torch.nonzero(target >= 0).squeeze(1)
    eps, weight = terms.label_smoothing, terms.class_weight
    if weight is None:
        grad = p * (1.0 + 2.0 * terms.z_loss * lse)[:, None] - terms.smoothing_per_class
        grad[rows, target[rows]] -= 1.0 - eps
    else:
        w_t = torch.where(target >= 0, weight[target.clamp(min=0)], torch.zeros_like(lse))
        coefficient = (1.0 - eps) * w_t + eps * weight.sum() / terms.vocab_size
        grad = p * (coefficient + 2.0 * terms.z_loss * lse)[:, None] - terms.smoothing_per_class * weight
        grad[rows, target[rows]] -= (1.0 - eps) * w_t[rows]
    transform.chain(grad, capped, grad_scale, row_scale)
    out.copy_(grad)
    if out_lo is not None:
        out_lo.copy_(grad - out.float())


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
    """Per row of a chunk that holds the whole vocabulary, with z the loss-space logits and p = softmax(z)::

        lse = log sum_j exp(z_j)      logprob = z_t - lse      entropy = lse - sum_j p_j z_j      argmax = first argmax_j z_j
        mean_logit = sum_j z_j / V    log_sum_sq_probs = log sum_j p_j^2

    into the (rows,) fp32 outputs (argmax int64, the last two when given; skipped when None). p_j z_j is 0 where p_j is 0 (a -inf logit
    carries no probability), as ``torch.distributions.Categorical(logits=z).entropy()`` has it.

    As the kernel, relative to the row maximum m (kernels/token_stats.py): entropy = log s - sum_j p_j (z_j - m) and
    logprob = (z_t - m) - log s, so that neither cancels lse against a logit (lse - E[z] loses the entropy at
    large logits: all of it past |z| ~ 1e7).
    """
    z, _ = transform.apply(logits)
    row_max = z.amax(dim=1)
    shift = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
    centered = z - shift[:, None]
    e = torch.exp(centered)
    sumexp = e.sum(dim=1)
    log_sumexp = torch.log(sumexp)
    p = e / sumexp[:, None]
    expected_centered = torch.where(p > 0, p * centered, torch.zeros_like(p)).sum(dim=1)
    lse_out.copy_(shift + log_sumexp)
    logprob_out.copy_(centered.gather(1, target[:, None]).squeeze(1) - log_sumexp)
    entropy_out.copy_(log_sumexp - expected_centered)
    if argmax_out is not None:
        argmax_out.copy_(z.argmax(dim=1))
    if mean_logit_out is not None:
        mean_logit_out.copy_(z.mean(dim=1))
    if log_sum_sq_out is not None:  # log sum e^2 - 2 log s, e relative to the max (no overflow, no p rounding)
        log_sum_sq_out.copy_(torch.log((e * e).sum(dim=1)) - 2.0 * torch.log(sumexp))


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
    """d(sum_i a_i logprob_i + b_i entropy_i) / d(raw logits) of a chunk or a tile of its columns (see
    ``token_stats``; target -1 where the label is elsewhere), a = grad_logprob, b = grad_entropy ((rows,) fp32,
    or None: no such term), E = lse - entropy::

        dz_j = a (delta_jt - p_j) + b p_j (E - z_j)        (p_j (E - z_j) = 0 where p_j = 0)

    then the chain rule to the raw logits (``transform.chain``); into ``out`` (may be ``logits``)."""
    z, capped = transform.apply(logits)
    p = torch.exp(z - lse[:, None])
    grad = torch.zeros_like(z)
    if grad_logprob is not None:
        grad -= p * grad_logprob[:, None]
        rows = torch.nonzero(target >= 0).squeeze(1)  # -1: the label is in another tile / shard of the vocabulary
        grad[rows, target[rows]] += grad_logprob[rows]
    if grad_entropy is not None:
        expected_z = lse - entropy
        grad += grad_entropy[:, None] * torch.where(p > 0, p * (expected_z[:, None] - z), torch.zeros_like(p))
    out.copy_(transform.chain(grad, capped))


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
    """Per row of two (rows, V) chunks holding the whole vocabulary (raw logits x_s, x_t; p_s = softmax(z_s),
    p_t = softmax(z_t) of the loss-space logits of each side's transform): the divergence into
    ``divergence_out`` (fp32), the student's entropy into ``entropy_out`` (when given), and into ``grad_out`` (may
    be ``student_logits`` itself; its dtype) ``row_weight[i]`` (1 when None) times d divergence_i / d x_s::

        beta = 0:  KL(p_t || p_s) = sum_j p_t (log p_t - log p_s)          d/dz_s = p_s - p_t
        beta = 1:  KL(p_s || p_t) = sum_j p_s (log p_s - log p_t)          d/dz_s = p_s (log p_s - log p_t - KL)
        else:      beta KL(p_t || m) + (1 - beta) KL(p_s || m),  m = beta p_t + (1 - beta) p_s
                                                                 d/dz_s = (1 - beta) p_s (log p_s - log m - KL(p_s || m))

    p log p is 0 where p is 0 (a -inf logit carries nothing), as ``torch.special.xlogy``; a NaN stays NaN.
    """
    z_s, capped = student.apply(student_logits)
    z_t, _ = teacher.apply(teacher_logits)
    log_ps, log_pt = torch.log_softmax(z_s, dim=1), torch.log_softmax(z_t, dim=1)
    p_s, p_t = log_ps.exp(), log_pt.exp()

    def kl(p, log_p, log_q):  # sum_j p (log p - log q), 0 where p = 0 (p == 0, not p > 0: a NaN row stays NaN)
        return torch.where(p == 0, 0.0, p * (log_p - log_q)).sum(dim=1)

    if beta == 0.0:
        value = kl(p_t, log_pt, log_ps)
        grad_z = p_s - p_t if grad_out is not None else None
    else:
        if beta == 1.0:
            log_m, weight = log_pt, 1.0
            value = aux = kl(p_s, log_ps, log_pt)
        else:
            log_m = torch.logaddexp(log_pt + torch.log(torch.tensor(beta)), log_ps + torch.log1p(torch.tensor(-beta)))
            aux = kl(p_s, log_ps, log_m)
            value, weight = beta * kl(p_t, log_pt, log_m) + (1.0 - beta) * aux, 1.0 - beta
        grad_z = None
        if grad_out is not None:
            grad_z = torch.where(p_s == 0, 0.0, weight * p_s * (log_ps - log_m - aux[:, None]))
    divergence_out.copy_(value)
    if entropy_out is not None:
        entropy_out.copy_(-torch.where(p_s == 0, 0.0, p_s * log_ps).sum(dim=1))
    if grad_out is not None:
        grad_out.copy_(student.chain(grad_z, capped, row_scale=row_weight))


def scale_grad(x: torch.Tensor, factor: torch.Tensor, out: torch.Tensor) -> None:
    """out = x * factor (``out`` may be ``x``; in place nothing happens at a factor of exactly 1): reading the factor
    costs no sync on the CPU (on a GPU this twin syncs, where kernels/scale_grad.py does not)."""
    value = float(factor)
    if out is x and value == 1.0:
        return
    torch.mul(x, value, out=out)
