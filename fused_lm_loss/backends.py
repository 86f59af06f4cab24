"""The per-chunk steps behind one interface, and the one switch that picks who implements them.

Two backends implement the steps of the chunk loop (``Backend`` below, same signatures, same fp32 math):
the Triton kernels (``kernels/``) and their PyTorch twins (``torch_backend.py``). Which one runs:

    fused_lm_loss.use_backend("torch")       in code: from now on, or inside ``with use_backend(...):``
    FUSED_LM_LOSS_BACKEND=triton|torch        in the environment, when no use_backend() is in force
    (neither)                                 Triton for CUDA tensors, PyTorch otherwise

"triton" on CPU tensors needs the Triton interpreter (``TRITON_INTERPRET=1``), which the tests use.

Example::

    import fused_lm_loss
    fused_lm_loss.use_backend("torch")                 # every later call runs the PyTorch steps
    with fused_lm_loss.use_backend("triton"):          # only inside this block
        loss = fused_lm_loss.FusedLMLoss()(hidden, weight, labels)
"""
from __future__ import annotations

import os
from typing import Protocol

import torch

from .exp_epilogue import ExpStats
from .loss_terms import LossTerms
from .transform import LogitTransform

BACKENDS = ("triton", "torch")
ENV_VAR = "FUSED_LM_LOSS_BACKEND"


class Backend(Protocol):
    """What the chunk loop asks of a backend (see the kernel files for the math of each step).

    Shapes: ``labels`` (n,) any integer dtype and strides; ``logits`` (rows, V) with unit column stride;
    ``target`` (rows,) contiguous int64 columns of this vocab shard (-1: the class lives on another shard);
    statistics, losses and lse are fp32. ``transform`` is applied to the logits before the softmax
    (transform.py); ``terms`` are the loss's smoothing, z-loss, vocabulary size and class weights (loss_terms.py).
    """

    name: str

    def select_rows(self, labels: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions, targets, summary = (count, min, max)) of the labels that are not ``ignore_index``."""

    def row_stats(self, logits: torch.Tensor, target: torch.Tensor, *, transform: LogitTransform, terms: LossTerms
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(max, sum-exp, target logit, logit sum) per row, to be merged across vocab shards; the logit sum only
        when ``terms.smooths`` (weighted by the class weights when given: sum_j w_j z_j, 0 where w_j = 0)."""

    def row_losses(self, logits: torch.Tensor, target: torch.Tensor, loss_out: torch.Tensor, lse_out: torch.Tensor, *,
                   transform: LogitTransform, terms: LossTerms) -> None:
        """Per-row loss (``loss_terms.loss_from_stats``) and lse of a chunk that holds the whole vocabulary."""

    def grad_logits(self, logits: torch.Tensor, out: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, *,
                    transform: LogitTransform, terms: LossTerms, grad_scale: float, row_scale: torch.Tensor | None,
                    out_lo: torch.Tensor | None = None) -> None:
        """d(loss)/d(logits) into ``out`` (may be ``logits`` itself), fp32 math, times ``grad_scale`` (and
        ``row_scale`` per row); with ``out_lo`` the rounding residual."""

    def supports_exp_epilogue(self, hidden: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``exp_matmul`` can serve a training chunk on these operands (exp_epilogue.py: sm90, [hopper])."""

    def exp_matmul(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                   e_out: torch.Tensor) -> ExpStats:
        """E = exp(z - k) per (row, tile) of z = hidden @ weight.T into ``e_out``, and k, the tiles' sums of E and the
        target logit (fp32), all from the GEMM's fp32 accumulator."""

    def grad_from_exp(self, e: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, stats: ExpStats, *,
                      terms: LossTerms, grad_scale: float, row_scale: torch.Tensor | None) -> torch.Tensor:
        """The plain loss's d(loss)/d(logits) from ``exp_matmul``'s outputs as (rows,) fp32 factors f, with E
        rewritten in place so that G = f[:, None] * E."""

    def merge_exp_stats(self, stats: ExpStats, loss_out: torch.Tensor, lse_out: torch.Tensor, *,
                        terms: LossTerms) -> None:
        """Per-row loss and lse of the plain loss from ``exp_matmul``'s per-tile statistics (merged in base 2)."""

    def supports_stats_in_matmul(self, hidden: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``matmul_partials`` can give a no-grad forward its statistics without a logits chunk."""

    def matmul_partials(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        target: torch.Tensor, *, logits_dtype: torch.dtype, transform: LogitTransform,
                        need_sum: bool) -> torch.Tensor:
        """(4, tiles, rows) partial statistics of h @ W.T (+ b), never storing the logits."""

    def matmul_partial_bytes_per_row(self, vocab: int) -> int:
        """Bytes of ``matmul_partials`` output per row (chunk sizing)."""

    def merge_partials(self, partial: torch.Tensor, *, terms: LossTerms, loss_out: torch.Tensor | None = None,
                       lse_out: torch.Tensor | None = None):
        """Merge (4, segments, rows) partials into the four statistics, or (``loss_out``) into loss and lse."""

    def token_stats(self, logits: torch.Tensor, target: torch.Tensor, logprob_out: torch.Tensor,
                    entropy_out: torch.Tensor, lse_out: torch.Tensor, argmax_out: torch.Tensor | None, *,
                    transform: LogitTransform, mean_logit_out: torch.Tensor | None = None,
                    log_sum_sq_out: torch.Tensor | None = None) -> None:
        """Per row of a chunk holding the whole vocabulary (``target`` >= 0): log p(target), entropy and lse
        (fp32), the first argmax (int64; skipped when ``argmax_out`` is None), and, when their outputs are given,
        the mean logit and log sum_j p_j^2 (fp32)."""

    def token_grad_logits(self, logits: torch.Tensor, out: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                          entropy: torch.Tensor, grad_logprob: torch.Tensor | None,
                          grad_entropy: torch.Tensor | None, *, transform: LogitTransform) -> None:
        """d(sum a * logprob + b * entropy)/d(logits) into ``out`` (may be ``logits`` itself) for per-row weights
        a = ``grad_logprob``, b = ``grad_entropy`` (fp32, or None: that term absent); ``logits`` may be any
        columns of the vocabulary (a tile: ``lse`` / ``entropy`` are the whole row's, ``target`` -1 elsewhere)."""

    def divergence_rows(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                        divergence_out: torch.Tensor, entropy_out: torch.Tensor | None, grad_out: torch.Tensor | None,
                        row_weight: torch.Tensor | None, *, student: LogitTransform, teacher: LogitTransform,
                        beta: float) -> None:
        """Per row of a student's and a teacher's logits chunks (the whole vocabulary each): the divergence
        (``beta`` 0: KL(teacher || student), 1: KL(student || teacher), between: the generalized JSD), the
        student's entropy when asked, and ``row_weight`` times d divergence / d student logits into ``grad_out``
        (may be ``student_logits`` itself); see ``divergence.py``."""


    def scale_grad(self, x: torch.Tensor, factor: torch.Tensor, out: torch.Tensor) -> None:
        """out = x * factor for a gradient made in forward (backward's grad_output / scaling, a float64 scalar
        tensor on x's device), rounded once to out's dtype; ``out`` may be ``x`` (in place: nothing happens at a
        factor of exactly 1). No host sync on the device (kernels/scale_grad.py)."""


_chosen: str | None = None  # set by use_backend(); None: the environment variable, else the device decides


class use_backend:
    """Choose the backend: ``use_backend("torch")`` from now on, or ``with use_backend("torch"):`` for a block.

    ``use_backend(None)`` goes back to the default (``FUSED_LM_LOSS_BACKEND``, else by device).
    """

    def __init__(self, name: str | None) -> None:
        global _chosen
        if name is not None and name not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or None, got {name!r}")
        self._previous, _chosen = _chosen, name

    def __enter__(self) -> "use_backend":
        return self

    def __exit__(self, *exc_info: object) -> None:
        global _chosen
        _chosen = self._previous


def backend_name(device: torch.device) -> str:
    """The backend a call on ``device`` runs: use_backend(), else $FUSED_LM_LOSS_BACKEND, else by device."""
    name = _chosen or os.environ.get(ENV_VAR) or ("triton" if device.type == "cuda" else "torch")
    if name not in BACKENDS:
        raise ValueError(f"{ENV_VAR} must be one of {BACKENDS}, got {name!r}")
    # (meta tensors run no backend: the fake implementation reads the name only for the outputs' dtypes)
    if name == "triton" and device.type not in ("cuda", "meta") and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"the triton backend runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1; got {device} "
            "tensors: use_backend('torch') or move the tensors"
        )
    return name


def get_backend(device: torch.device) -> Backend:
    """The backend module for a call on ``device`` (Triton is imported only when it runs)."""
    if backend_name(device) == "torch":
        from . import torch_backend

        return torch_backend
    from . import kernels

    return kernels
