"""Teacher-student divergence of two LM heads, without either N x V logits (knowledge distillation).

For each selected token i, with x_s = h_s W_s^T (+ b_s) and x_t = h_t W_t^T (+ b_t) the two heads' raw logits,
z = softcap(scale * x) / temperature each side's loss-space logits (``transform.py``), p_s = softmax(z_s) and
p_t = softmax(z_t)::

    kind="forward_kl"   KL(p_t || p_s) = sum_j p_t (log p_t - log p_s)                 (TRL: beta = 0)
    kind="reverse_kl"   KL(p_s || p_t)                                                   (TRL: beta = 1)
    kind="jsd"          beta KL(p_t || m) + (1 - beta) KL(p_s || m),  m = beta p_t + (1 - beta) p_s

and optionally the student's entropy. Only the student gets gradients (hidden states, weight, bias); the teacher's
matmul runs once. Per chunk of selected rows: both logits chunks by cuBLAS, one backend step
(``divergence_rows``: the Triton kernel in ``kernels/divergence.py`` on CUDA, its PyTorch twin in
``torch_backend.py`` otherwise) writes the divergence and, in place of the student's logits, d div_i / d x_s with
weight 1 per row; then dX rows = G @ W_s and dW_s += G^T h_s. Backward weights dX per row (exact for any
grad_output); dW_s and db_s are rescaled when grad_output is one value over the selected rows (mean, sum) and
recomputed with the per-row weights otherwise (``reduction="none"`` with per-token weights).

Precision: both logits chunks in fp32, straight from the matmul's fp32 accumulator (cuBLAS ``out_dtype`` on CUDA):
a divergence between close distributions is a small difference of log-probabilities, which logits rounded to bf16
(about +-0.03 at |z| ~ 8) would swamp; softmax, divergence and gradient math in fp32; the chunk's gradient G in
the student's matmul dtype (the operand of the dX and dW matmuls; a 2-byte G is written over the first half of
each row of the student's fp32 chunk, so a chunk costs 8 bytes per logit); dX (N x H) and dW (V x H) kept in fp32
until backward (one rounding whatever grad_output is); outputs fp32.

Example::

    loss = fused_divergence(student_h, student.lm_head.weight, teacher_h, teacher.lm_head.weight, labels,
                            kind="jsd", beta=0.5, temperature=2.0)
    loss.backward()                        # student gradients only
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor, nn

from .backends import get_backend
from .chunked import logits_into, matmul_accumulate, label_ids
from .inputs import check_gathered_for_backward, check_labels, grad_needs, matmul_inputs, check_dense
from .ops_common import apply_factor, refuse_double_backward, shapes_only
from .options import MATMUL_DTYPES, check_fp32_safe, check_ignore_index, check_real, check_transform_products
from .plan import LOGITS_BUDGET_BYTES, rows_within, split_rows
from .transform import LogitTransform

KINDS = ("forward_kl", "reverse_kl", "jsd")
REDUCTIONS = ("mean", "sum", "none")
F32 = torch.float32


@dataclass(frozen=True)
class DivergenceOptions:
    """The options of a divergence, validated once where they are made."""

    kind: str = "forward_kl"
    beta: Optional[float] = None  # the mixture weight of the teacher: kind="jsd" only (None there: 0.5)
    temperature: float = 1.0
    student_logit_scale: float = 1.0
    student_softcap: Optional[float] = None
    teacher_logit_scale: float = 1.0
    teacher_softcap: Optional[float] = None
    ignore_index: int = -100
    reduction: str = "mean"
    chunk_size: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if self.beta is not None and self.kind != "jsd":  # (TRL's beta would be silently ignored)
            raise ValueError(f"beta is the mixture weight of kind='jsd'; kind={self.kind!r} takes none (TRL's beta 0 "
                             "and 1 are kind='forward_kl' and 'reverse_kl': DivergenceOptions.from_beta translates)")
        for name in ("beta", "temperature", "student_logit_scale", "teacher_logit_scale", "student_softcap",
                     "teacher_softcap"):
            value = getattr(self, name)
            if value is None and name in ("beta", "student_softcap", "teacher_softcap"):
                continue
            check_real(name, value)
            if name == "beta":
                if self.kind == "jsd" and not 0.0 < value < 1.0:
                    raise ValueError(f"beta must be in (0, 1) for kind='jsd' (0 and 1 are the two KLs), got {value}")
            elif value <= 0.0:
                raise ValueError(f"{name} must be > 0, got {value}")
            else:
                check_fp32_safe(name, value)
        for side in ("student", "teacher"):
            check_transform_products(getattr(self, side), f"{side}_logit_scale", f"{side}_softcap")
        object.__setattr__(self, "ignore_index", check_ignore_index(self.ignore_index))  # (a numpy int: an int)
        if self.chunk_size is not None and (isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int)
                                            or self.chunk_size < 1):
            raise ValueError(f"chunk_size must be a positive int or None, got {self.chunk_size!r}")

    @property
    def mixture_beta(self) -> float:
        """The teacher's weight in the mixture: 0 for the forward KL, 1 for the reverse KL (as TRL's beta)."""
        return {"forward_kl": 0.0, "reverse_kl": 1.0}.get(self.kind, 0.5 if self.beta is None else float(self.beta))

    @property
    def student(self) -> LogitTransform:
        return LogitTransform(self.student_logit_scale, self.student_softcap, self.temperature)

    @property
    def teacher(self) -> LogitTransform:
        return LogitTransform(self.teacher_logit_scale, self.teacher_softcap, self.temperature)

    @classmethod
    def from_beta(cls, beta: float, **options) -> "DivergenceOptions":
        """TRL's spelling: beta 0 is the forward KL, 1 the reverse KL, anything between the generalized JSD."""
        kind = "forward_kl" if beta == 0.0 else "reverse_kl" if beta == 1.0 else "jsd"
        return cls(kind=kind, beta=float(beta) if kind == "jsd" else None, **options)


class DivergenceOutput(NamedTuple):
    divergence: Tensor  # reduced as asked; differentiable w.r.t. the student
    entropy: Tensor  # the student's entropy per token (0 at ignored positions), fp32, detached


# ---- the chunk loop ---------------------------------------------------------------------------------------------


#: A chunk's buffers may take this much, or the loss's budget plus the returned dW's bytes if more (below). Each
#: logit costs 8 bytes here (two fp32 chunks; G is written over the student's), 2 in the loss: within the loss's
#: 240 MiB a chunk would be ~200 rows at V = 152k, under one wave of the kernel's one program per row, with short
#: matmuls and, with a trainable head, one pass over the fp32 dW accumulator per chunk (H200, Qwen2.5-0.5B
#: reverse KL: 45 chunks, the kernel at half its bandwidth; benchmarks/NOTES.md).
BUDGET_BYTES = 4 * LOGITS_BUDGET_BYTES


def _chunk_rows(opts: DivergenceOptions, count: int, student_hidden: Tensor, teacher_hidden: Tensor,
                student_weight: Tensor, need_weight: bool) -> int:
    """Rows per chunk: both fp32 logits chunks within ``BUDGET_BYTES`` or, with a trainable head, within the loss's
    budget plus the returned dW's bytes where that is more: that dW exists only in backward, after the chunks are
    freed, beside the fp32 accumulator saved for it, so the peak stays that of backward (fewer chunks: fewer passes
    over the accumulator)."""
    vocab = student_weight.shape[0]
    per_row = vocab * (4 + 4) + student_hidden.shape[1] * (student_hidden.element_size() + 4)
    per_row += teacher_hidden.shape[1] * teacher_hidden.element_size()
    result = student_weight.numel() * student_weight.element_size() if need_weight else 0
    if opts.chunk_size is not None:
        return split_rows(count, opts.chunk_size)
    return split_rows(count, rows_within(per_row, max(BUDGET_BYTES, LOGITS_BUDGET_BYTES + result)))


def _run(opts: DivergenceOptions, student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
         teacher_bias, positions: Tensor, n_tokens: int, *, row_weight: Tensor | None, need_hidden: bool,
         need_weight: bool, need_bias: bool, need_entropy: bool):
    """(divergence, entropy or None) of the selected rows (``positions``: int64 indices), and the gradients of
    sum_i row_weight_i div_i (row weights 1 when None) that are asked for: dX (n_tokens, H) fp32 (zero rows
    elsewhere), dW and db fp32."""
    backend = get_backend(student_hidden.device)
    device, count, vocab = student_hidden.device, positions.numel(), student_weight.shape[0]
    rows = _chunk_rows(opts, count, student_hidden, teacher_hidden, student_weight, need_weight)
    divergence = torch.empty(count, dtype=F32, device=device)
    entropy = torch.empty(count, dtype=F32, device=device) if need_entropy else None
    d_hidden = torch.zeros(n_tokens, student_hidden.shape[1], dtype=F32, device=device) if need_hidden else None
    d_weight = torch.zeros(student_weight.shape, dtype=F32, device=device) if need_weight else None
    d_bias = torch.zeros(vocab, dtype=F32, device=device) if need_bias else None
    grads = need_hidden or need_weight or need_bias
    mm_dtype = student_hidden.dtype
    student_buffer, teacher_buffer = (torch.empty(rows * vocab, dtype=F32, device=device) for _ in range(2))
    for start in range(0, count, rows):
        end = min(start + rows, count)
        index = positions[start:end]
        h_s, h_t = student_hidden.index_select(0, index), teacher_hidden.index_select(0, index)
        x_s, x_t = (buffer[: (end - start) * vocab].view(end - start, vocab) for buffer in (student_buffer,
                                                                                            teacher_buffer))
        logits_into(x_s, h_s, student_weight, student_bias)
        logits_into(x_t, h_t, teacher_weight, teacher_bias)
        g = None if not grads else x_s if mm_dtype == F32 else _over_first_half(x_s, mm_dtype)
        backend.divergence_rows(
            x_s, x_t, divergence[start:end], None if entropy is None else entropy[start:end], g,
            None if row_weight is None else row_weight[start:end], student=opts.student, teacher=opts.teacher,
            beta=opts.mixture_beta,
        )
        if need_hidden:
            dx = torch.empty(end - start, student_hidden.shape[1], dtype=F32, device=device)
            matmul_accumulate(dx, g, student_weight, first=True)
            d_hidden.index_copy_(0, index, dx)
        if need_weight:
            matmul_accumulate(d_weight, g.t(), h_s, first=False)
        if need_bias:
            d_bias += g.sum(dim=0, dtype=F32)
    return divergence, entropy, d_hidden, d_weight, d_bias


def _over_first_half(logits: Tensor, dtype: torch.dtype) -> Tensor:
    """G (rows, V) in a 2-byte ``dtype`` over the first half of each fp32 logits row (row stride 2V): the kernel
    writes each block of G after all its threads have read that block (a barrier: G's column j lands on another
    thread's logit j // 2), and the block's G covers only columns already read, so no logit is overwritten before
    its last read (kernels/divergence.py); the matmuls take the row stride as their leading dimension."""
    return logits.view(dtype)[:, : logits.shape[1]]


def _scatter(values: Tensor, positions: Tensor, n_tokens: int) -> Tensor:
    return values.new_zeros(n_tokens).index_copy_(0, positions, values)


# ---- the operators ----------------------------------------------------------------------------------------------


def _options(beta: float, temperature: float, student_scale: float, student_softcap: Optional[float],
             teacher_scale: float, teacher_softcap: Optional[float], chunk_size: Optional[int]) -> DivergenceOptions:
    return DivergenceOptions.from_beta(beta, temperature=temperature, student_logit_scale=student_scale,
                                       student_softcap=student_softcap, teacher_logit_scale=teacher_scale,
                                       teacher_softcap=teacher_softcap, chunk_size=chunk_size)


def _absent(device) -> Tensor:
    return torch.empty(0, dtype=F32, device=device)


@torch.library.custom_op("fused_lm_loss::linear_divergence", mutates_args=())
def linear_divergence(
    student_hidden: Tensor, student_weight: Tensor, student_bias: Optional[Tensor], teacher_hidden: Tensor,
    teacher_weight: Tensor, teacher_bias: Optional[Tensor], selected: Tensor, needs: Sequence[bool],
    need_entropy: bool, *, beta: float, temperature: float, student_scale: float, student_softcap: Optional[float],
    teacher_scale: float, teacher_softcap: Optional[float], chunk_size: Optional[int],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(divergence (N,), entropy (N,) or (0,), then the gradients of sum_i div_i w.r.t. the student's hidden
    states (N, H), weight (V, H) and bias (V,) in fp32, each (0,) unless ``needs`` asks for it). ``selected``
    (N,) bool marks the rows with a divergence; the others give 0 and no gradient."""
    opts = _options(beta, temperature, student_scale, student_softcap, teacher_scale, teacher_softcap, chunk_size)
    positions = selected.nonzero().view(-1)
    n = selected.numel()
    divergence, entropy, *grads = _run(opts, student_hidden, student_weight, student_bias, teacher_hidden,
                                       teacher_weight, teacher_bias, positions, n, row_weight=None,
                                       need_hidden=needs[0], need_weight=needs[1], need_bias=needs[2],
                                       need_entropy=need_entropy)
    device = student_hidden.device
    return (_scatter(divergence, positions, n), _absent(device) if entropy is None else _scatter(entropy, positions, n),
            *(_absent(device) if g is None else g for g in grads))


@linear_divergence.register_fake
def _(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, selected, needs,
      need_entropy, **options):
    n, device = selected.numel(), student_hidden.device
    shapes = ((n, student_hidden.shape[1]), tuple(student_weight.shape), (student_weight.shape[0],))
    return (torch.empty(n, dtype=F32, device=device), torch.empty(n if need_entropy else 0, dtype=F32, device=device),
            *(torch.empty(shape if need else (0,), dtype=F32, device=device) for shape, need in zip(shapes, needs)))


@torch.library.custom_op("fused_lm_loss::linear_divergence_backward", mutates_args=())
def linear_divergence_backward(
    student_hidden: Tensor, student_weight: Tensor, student_bias: Optional[Tensor], teacher_hidden: Tensor,
    teacher_weight: Tensor, teacher_bias: Optional[Tensor], selected: Tensor, grad_divergence: Tensor,
    d_hidden: Tensor, d_weight: Tensor, d_bias: Tensor, needs: Sequence[bool], *, beta: float, temperature: float,
    student_scale: float, student_softcap: Optional[float], teacher_scale: float, teacher_softcap: Optional[float],
    chunk_size: Optional[int],
) -> tuple[Tensor, Tensor, Tensor]:
    """The student's gradients of sum_i g_i div_i (g = ``grad_divergence``), in the inputs' dtypes ((0,) where not
    needed): dX rows weighted by g; dW and db rescaled when g is one value over the selected rows, else recomputed
    with the per-row weights."""
    g = torch.where(selected, grad_divergence.float(), 0.0)
    out = [_absent(student_hidden.device) for _ in range(3)]
    # (outputs contiguous, as the fake implementation gives them: empty_like would keep a transposed input's strides)
    if needs[0]:
        out[0] = torch.mul(d_hidden, g[:, None], out=_contiguous_like(student_hidden))
    if needs[1] or needs[2]:
        positions = selected.nonzero().view(-1)
        weights = g.index_select(0, positions)
        factor = _uniform(weights)
        if factor is None:  # per-row weights: both heads' logits again
            # (the teacher, detached in divergence_with, is saved as an alias that keeps the data it was called
            # with; the student's weight is the parameter itself)
            check_gathered_for_backward(student_weight)
            opts = _options(beta, temperature, student_scale, student_softcap, teacher_scale, teacher_softcap,
                            chunk_size)
            *_, d_weight, d_bias = _run(opts, student_hidden, student_weight, student_bias, teacher_hidden,
                                        teacher_weight, teacher_bias, positions, selected.numel(), row_weight=weights,
                                        need_hidden=False, need_weight=needs[1], need_bias=needs[2],
                                        need_entropy=False)
            factor = 1.0
        # (rounded once into the input's dtype: no fp32 V x H temporary beside the saved accumulator)
        if needs[1]:
            out[1] = torch.mul(d_weight, factor, out=_contiguous_like(student_weight))
        if needs[2]:
            out[2] = torch.mul(d_bias, factor, out=_contiguous_like(student_bias))
    return tuple(out)


def _contiguous_like(x: Tensor) -> Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@linear_divergence_backward.register_fake
def _(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, selected,
      grad_divergence, d_hidden, d_weight, d_bias, needs, **options):
    inputs = (student_hidden, student_weight, student_bias)
    return tuple(torch.empty(x.shape if need else (0,), dtype=x.dtype if need else F32, device=student_hidden.device)
                 for x, need in zip(inputs, needs))


def _uniform(weights: Tensor) -> float | None:
    """The one value of the selected rows' weights (0 without rows), or None; one host sync."""
    if weights.numel() == 0:
        return 0.0
    low, high = torch.stack([weights.amin(), weights.amax()]).tolist()
    return low if low == high else None


_OPTION_NAMES = ("beta", "temperature", "student_scale", "student_softcap", "teacher_scale", "teacher_softcap",
                 "chunk_size")


def _setup(ctx, inputs, keyword_only_inputs, output):
    *tensors, selected, needs, _ = inputs
    _, _, d_hidden, d_weight, d_bias = output
    ctx.needs, ctx.options = tuple(needs), dict(keyword_only_inputs)
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(*tensors, selected, d_hidden, d_weight, d_bias)


def _backward(ctx, grad_divergence, *unused):
    refuse_double_backward(grad_divergence)
    none = (None,) * 6  # teacher tensors, selected, needs, need_entropy: no gradient
    if grad_divergence is None or not any(ctx.needs):
        return (None,) * 3 + none
    *tensors, selected, d_hidden, d_weight, d_bias = ctx.saved_tensors
    if not shapes_only(grad_divergence) and not ctx.needs[0]:
        # eager, frozen hidden states: a uniform weight rescales the vocabulary side here, with no new op call
        factor = _uniform(torch.where(selected, grad_divergence.float(), 0.0)[selected])
        if factor is not None:
            made = [(g, x.dtype) for g, x, need in zip((d_weight, d_bias), tensors[1:3], ctx.needs[1:]) if need]
            scaled = iter(apply_factor([g for g, _ in made], [dtype for _, dtype in made], factor))
            return (None, *(next(scaled) if need else None for need in ctx.needs[1:]), *none)
    grads = linear_divergence_backward(*tensors, selected, grad_divergence, d_hidden, d_weight, d_bias,
                                       list(ctx.needs), **ctx.options)
    return (*(g if need else None for g, need in zip(grads, ctx.needs)), *none)


linear_divergence.register_autograd(_backward, setup_context=_setup)


# ---- the API ----------------------------------------------------------------------------------------------------


def divergence_with(opts: DivergenceOptions, student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor,
                    teacher_weight: Tensor, labels: Tensor | None = None, *, student_bias: Tensor | None = None,
                    teacher_bias: Tensor | None = None, mask: Tensor | None = None,
                    return_entropy: bool = False) -> Tensor | DivergenceOutput:
    """``fused_divergence`` with options made elsewhere (``DivergenceOptions``)."""
    _check_flag("return_entropy", return_entropy)
    for name, t in (("student_hidden", student_hidden), ("student_weight", student_weight),
                    ("teacher_hidden", teacher_hidden), ("teacher_weight", teacher_weight)):
        check_dense(name, t)
        if not isinstance(t, Tensor) or t.dtype not in MATMUL_DTYPES:  # (G is written in the matmul dtype)
            raise ValueError(f"{name} must be a float32, bfloat16 or float16 tensor, got "
                             f"{t.dtype if isinstance(t, Tensor) else t!r}")
    if student_weight.dim() != 2 or teacher_weight.dim() != 2:
        raise ValueError(f"the weights must be (V, H), got {tuple(student_weight.shape)} and "
                         f"{tuple(teacher_weight.shape)}")
    if student_weight.shape[0] == 0:
        raise ValueError("the heads must have at least one class (the weights are (0, H))")
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"the student's and the teacher's vocabularies differ: {student_weight.shape[0]} and "
                         f"{teacher_weight.shape[0]} classes")
    batch = tuple(student_hidden.shape[:-1])
    if tuple(teacher_hidden.shape[:-1]) != batch:
        raise ValueError(f"student_hidden {tuple(student_hidden.shape)} and teacher_hidden "
                         f"{tuple(teacher_hidden.shape)} must have the same leading (token) dimensions")
    for name, hidden, weight in (("student", student_hidden, student_weight), ("teacher", teacher_hidden,
                                                                               teacher_weight)):
        if hidden.shape[-1] != weight.shape[1]:
            raise ValueError(f"{name}_hidden has {hidden.shape[-1]} features but {name}_weight expects "
                             f"{weight.shape[1]}")
    for name, bias, weight in (("student_bias", student_bias, student_weight), ("teacher_bias", teacher_bias,
                                                                                 teacher_weight)):
        if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (weight.shape[0],)):
            raise ValueError(f"{name} must be a ({weight.shape[0]},) tensor, got "
                             f"{tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__}")
    if labels is not None and mask is not None:
        raise ValueError("give labels (positions equal to ignore_index are left out) or mask, not both")
    if mask is not None and opts.ignore_index != DivergenceOptions.ignore_index:
        raise ValueError(f"ignore_index={opts.ignore_index} applies to labels, and a mask was given: leave it unset")
    n = math.prod(batch)
    if labels is not None:
        check_labels(labels, torch.Size(batch), student_hidden.device)
        selected = label_ids(labels) != opts.ignore_index
    elif mask is not None:
        if mask.dtype != torch.bool or tuple(mask.shape) != batch:
            raise ValueError(f"mask must be a bool tensor of shape {batch}, got {mask.dtype} {tuple(mask.shape)}")
        selected = mask.reshape(-1)
    else:
        selected = torch.ones(n, dtype=torch.bool, device=student_hidden.device)
    device = student_hidden.device
    if any(t is not None and t.device != device for t in (student_weight, teacher_hidden, teacher_weight, student_bias,
                                                           teacher_bias, selected)):
        raise ValueError("every tensor of a divergence must be on the student's hidden states' device")
    student = matmul_inputs(student_hidden, student_weight, student_bias, side="student")[:3]
    teacher = matmul_inputs(teacher_hidden.detach(), teacher_weight.detach(),
                            None if teacher_bias is None else teacher_bias.detach(), side="teacher")[:3]
    needs = grad_needs(student)
    div, entropy, *_ = linear_divergence(
        student[0].reshape(n, student[0].shape[-1]), student[1], student[2], teacher[0].reshape(n, teacher[0].shape[-1]),
        teacher[1], teacher[2],
        selected.contiguous(), needs, return_entropy, beta=opts.mixture_beta, temperature=float(opts.temperature),
        student_scale=float(opts.student_logit_scale),
        student_softcap=None if opts.student_softcap is None else float(opts.student_softcap),
        teacher_scale=float(opts.teacher_logit_scale),
        teacher_softcap=None if opts.teacher_softcap is None else float(opts.teacher_softcap),
        chunk_size=opts.chunk_size,
    )
    if opts.reduction == "none":
        value = div.view(batch)
    elif opts.reduction == "sum":
        value = div.sum()
    else:  # the mean over the selected positions (NaN without any, as F.cross_entropy's mean)
        value = div.sum() / selected.sum()
    return DivergenceOutput(value, entropy.view(batch)) if return_entropy else value


def _check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def fused_divergence(student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor, teacher_weight: Tensor,
                     labels: Tensor | None = None, *, student_bias: Tensor | None = None,
                     teacher_bias: Tensor | None = None, mask: Tensor | None = None, kind: str = "forward_kl",
                     beta: float | None = None, temperature: float = 1.0, student_logit_scale: float = 1.0,
                     student_softcap: float | None = None, teacher_logit_scale: float = 1.0,
                     teacher_softcap: float | None = None, ignore_index: int = -100, reduction: str = "mean",
                     chunk_size: int | None = None, return_entropy: bool = False) -> Tensor | DivergenceOutput:
    """The divergence between a student's and a teacher's next-token distributions (module docstring).

    Args:
        student_hidden (..., H_s), student_weight (V, H_s), teacher_hidden (..., H_t), teacher_weight (V, H_t):
            the two heads' inputs (already shifted); hidden sizes may differ, vocabularies match.
        labels: positions whose label is ``ignore_index`` are left out (0, no gradient), every other position
            counts (the divergence compares whole distributions: a label's value is never read as a class, so
            none is out of range); or ``mask`` (bool, shaped like the positions, True where the divergence
            counts); neither: every position.
        student_bias, teacher_bias: each head's (V,) bias, or None.
        kind: "forward_kl" (KL(teacher || student)), "reverse_kl" (KL(student || teacher)) or "jsd" (the
            generalized Jensen-Shannon divergence with the teacher's mixture weight ``beta``, 0.5 by default;
            beta with another kind is an error).
        temperature: divides both sides' logits; each side's ``logit_scale`` / ``softcap`` are its model's.
        ignore_index: the label of the positions left out (with ``labels``).
        reduction: "mean" over the selected positions (NaN when none is selected, as F.cross_entropy's mean),
            "sum", or "none" (shaped like the positions).
        chunk_size: at most this many rows per chunk (default: by memory: both fp32 logits chunks within 960 MiB,
            four times the loss's budget, or, with a trainable head, the loss's 240 MiB plus the returned dW's bytes
            where that is more).
        return_entropy: also return the student's per-token entropy (detached): ``DivergenceOutput``.

    Example::

        loss = fused_divergence(hs, student.lm_head.weight, ht, teacher.lm_head.weight, labels, kind="reverse_kl")
    """
    opts = DivergenceOptions(kind=kind, beta=beta, temperature=temperature, student_logit_scale=student_logit_scale,
                             student_softcap=student_softcap, teacher_logit_scale=teacher_logit_scale,
                             teacher_softcap=teacher_softcap, ignore_index=ignore_index, reduction=reduction,
                             chunk_size=chunk_size)
    return divergence_with(opts, student_hidden, student_weight, teacher_hidden, teacher_weight, labels,
                           student_bias=student_bias, teacher_bias=teacher_bias, mask=mask,
                           return_entropy=return_entropy)


class FusedDivergence(nn.Module):
    """``fused_divergence`` as a module: the options once, validated here.

    Example::

        distill = FusedDivergence(kind="jsd", beta=0.5, temperature=2.0)
        loss = distill(hs, student.lm_head.weight, ht, teacher.lm_head.weight, labels)
    """

    def __init__(self, **options) -> None:
        super().__init__()
        self.return_entropy = _check_flag("return_entropy", options.pop("return_entropy", False))
        self.options = DivergenceOptions(**options)

    def forward(self, student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor, teacher_weight: Tensor,
                labels: Tensor | None = None, *, student_bias: Tensor | None = None,
                teacher_bias: Tensor | None = None, mask: Tensor | None = None) -> Tensor | DivergenceOutput:
        """As ``fused_divergence``'s arguments of the same names."""
        return divergence_with(self.options, student_hidden, student_weight, teacher_hidden, teacher_weight, labels,
                               student_bias=student_bias, teacher_bias=teacher_bias, mask=mask,
                               return_entropy=self.return_entropy)

    def extra_repr(self) -> str:
        default = DivergenceOptions()
        return ", ".join(f"{k}={v!r}" for k, v in vars(self.options).items() if v != getattr(default, k))


__all__ = ["DivergenceOptions", "DivergenceOutput", "FusedDivergence", "KINDS", "divergence_with", "fused_divergence"]
