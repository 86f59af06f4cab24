"""One call's plan: every decision the chunk loop needs, resolved once, from the options and the tensors.

``make_plan`` is the only place that sizes chunks and picks buffer dtypes; ``chunked.run_chunks`` and the
heads read the plan and nothing else of the options.

Chunk size. Chunks are as few as the memory allows and of equal size (``split_rows``): every chunk reads
and writes the whole dW accumulator, so their number, not their size, sets that cost. Without
``chunk_size`` a chunk's buffers take at most ``LOGITS_BUDGET_BYTES``, plus, when dW is summed in a wider
dtype than the weight's, memory that the accumulator's cost already pays for:
  - one chunk needs no accumulator (dW is a single matmul), so it may also take the accumulator's bytes;
  - with several chunks the returned dW is written once, after the loop has freed the chunk buffer, so
    the chunk may also take the returned dW's bytes.
Either way the loss holds at most the accumulator + LOGITS_BUDGET_BYTES beyond inputs and gradients.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .backends import Backend
from .distributed import Shard
from .options import LossOptions

#: Memory the chunk buffers may take when ``chunk_size`` is None: 240 MiB, so that with the small
#: per-chunk temporaries the loss stays within 0.25 GiB beyond its inputs and gradients.
LOGITS_BUDGET_BYTES = 240 * 2**20
#: The PyTorch backend's fp32 temporaries per logit (the loss-space copy, exp, and the gradient): counted in
#: its chunks so that CPU runs keep to the same budget.
TORCH_BACKEND_TEMP_BYTES = 12
#: torch >= 2.8 lets cuBLAS write fp32 products of bf16/fp16 operands directly (``out_dtype``).
HAS_OUT_DTYPE_MM = hasattr(torch.ops.aten.mm, "dtype_out") and hasattr(torch.ops.aten.addmm, "dtype_out")


@dataclass(frozen=True)
class GradNeeds:
    """Which gradients to produce: the autograd inputs' requires_grad (with grad mode on), nothing else."""

    hidden: bool = False
    weight: bool = False
    bias: bool = False
    low_rank_input: bool = False
    low_rank_weight: bool = False

    def any(self) -> bool:
        return self.hidden or self.weight or self.bias or self.low_rank_input or self.low_rank_weight

    @property
    def row_inputs(self) -> bool:
        """A per-token input (hidden, u) needs its gradient rows: G @ W or G @ B."""
        return self.hidden or self.low_rank_input

    @property
    def weights(self) -> bool:
        """A per-vocabulary input (W, b, B) needs its gradient: G.T @ h, G.sum(0), G.T @ u."""
        return self.weight or self.bias or self.low_rank_weight


@dataclass(frozen=True)
class Plan:
    """Resolved once per call (``make_plan``); the chunk loop reads nothing else."""

    backend: Backend
    shard: Shard
    needs: GradNeeds
    # the loss: z = softcap(logit_scale * x), loss terms over shard.total classes
    logit_scale: float
    softcap: float | None
    label_smoothing: float
    z_loss: float
    # rows and chunks
    n_rows: int
    chunk_rows: int
    stats_in_matmul: bool  # forward without gradients: statistics from the matmul epilogue, no logits chunk
    # buffer dtypes (see the table in chunked.py)
    matmul_dtype: torch.dtype
    logits_dtype: torch.dtype
    grad_input_dtype: torch.dtype  # dX / du rows: wider than matmul_dtype when they are sums rounded once
    accum_dtype: torch.dtype  # dW / dB across chunks; the weight's dtype when there is one chunk
    split_grad: bool  # fp32 logits from bf16/fp16 operands: G kept as hi + lo
    # gradient scale: each row's d(loss)/d(logits) is multiplied by grad_scale (times row_scale[i] if given)
    grad_scale: float
    overlap_grad_matmuls: bool  # CUDA: dX on a second stream beside dW

    def chunks(self):
        """(start, end) of each chunk of the kept rows."""
        for start in range(0, self.n_rows, self.chunk_rows):
            yield start, min(start + self.chunk_rows, self.n_rows)

    @property
    def need_sum(self) -> bool:
        return self.label_smoothing > 0

    @property
    def loss_terms(self) -> dict:
        """Keyword arguments of the backend's loss and gradient steps."""
        return dict(
            logit_scale=self.logit_scale,
            softcap=self.softcap,
            label_smoothing=self.label_smoothing,
            z_loss=self.z_loss,
            vocab_size=self.shard.total,
        )


def make_plan(
    opts: LossOptions,
    backend: Backend,
    shard: Shard,
    n_rows: int,
    head,
    *,
    has_index: bool,
    needs: GradNeeds = GradNeeds(),
    grad_scale: float = 1.0,
) -> Plan:
    """The plan of one call over ``n_rows`` kept rows (``has_index``: some rows were dropped, so the head
    gathers the kept ones). ``head`` is a ``chunked.LinearHead`` or ``chunked.GivenLogits``: it tells
    the device, the matmul dtype, the weight whose gradient is summed over chunks (``vocab_weight``), the
    operands of a statistics-epilogue matmul (``stats_operands``), whether its logits already carry the
    model's softcap / scale (``transformed``), and the bytes its per-chunk row copies take (``row_bytes``).
    """
    device, matmul_dtype, weight = head.device, head.matmul_dtype, head.vocab_weight
    logits_dtype = matmul_dtype if head.transformed else (opts.logits_dtype or matmul_dtype)
    split_grad = needs.any() and logits_dtype != matmul_dtype
    grad_input_dtype = matmul_dtype
    if device.type != "cuda" or HAS_OUT_DTYPE_MM:
        # dX is kept wider than the matmul dtype when it is a sum that should be rounded once: hi + lo terms,
        # and vocab shards' partials summed across ranks (distributed.py), where the matmul writes that dtype
        # directly; upcasting W every chunk instead (CUDA, torch < 2.8) would cost more.
        if split_grad:
            grad_input_dtype = torch.float32
        elif shard.group is not None and shard.reduce_grad_input:
            grad_input_dtype = torch.promote_types(opts.accum_dtype or matmul_dtype, matmul_dtype)
    weight_dtype = matmul_dtype if weight is None else weight.dtype
    accum_dtype = torch.promote_types(opts.accum_dtype or weight_dtype, weight_dtype)
    operands = head.stats_operands
    stats_in_matmul = not needs.any() and operands is not None and backend.supports_stats_in_matmul(*operands)

    row_bytes = head.row_bytes(has_index, needs, grad_input_dtype)
    if stats_in_matmul:  # chunks bound only the fp32 partials (and the gathered rows)
        bytes_per_row = backend.matmul_partial_bytes_per_row(shard.chunk_vocab) + row_bytes
        max_rows = opts.chunk_size or rows_within(bytes_per_row, LOGITS_BUDGET_BYTES)
    else:
        per_logit = logits_dtype.itemsize + (2 * matmul_dtype.itemsize if split_grad else 0)
        if backend.name == "torch":
            per_logit += TORCH_BACKEND_TEMP_BYTES
        bytes_per_row = shard.chunk_vocab * per_logit + row_bytes
        wide_dw = needs.weights and weight is not None and accum_dtype != weight_dtype
        max_rows = max_chunk_rows(
            n_rows,
            bytes_per_row,
            opts.chunk_size,
            accumulator_bytes=weight.numel() * accum_dtype.itemsize if wide_dw else 0,
            result_bytes=weight.numel() * weight_dtype.itemsize if wide_dw else 0,
        )
    chunk_rows = split_rows(n_rows, max_rows)
    if chunk_rows >= n_rows:  # one chunk: each weight gradient is one matmul (fp32 inside), rounded once
        accum_dtype = weight_dtype

    return Plan(
        backend=backend,
        shard=shard,
        needs=needs,
        logit_scale=1.0 if head.transformed else opts.logit_scale,
        softcap=None if head.transformed else opts.softcap,
        label_smoothing=opts.label_smoothing,
        z_loss=opts.z_loss,
        n_rows=n_rows,
        chunk_rows=chunk_rows,
        stats_in_matmul=stats_in_matmul,
        matmul_dtype=matmul_dtype,
        logits_dtype=logits_dtype,
        grad_input_dtype=grad_input_dtype,
        accum_dtype=accum_dtype,
        split_grad=split_grad,
        grad_scale=grad_scale,
        overlap_grad_matmuls=device.type == "cuda" and needs.row_inputs and needs.weights,
    )


def rows_within(bytes_per_row: int, budget: int) -> int:
    """The most rows whose chunk buffers stay within ``budget`` bytes (at least one)."""
    return max(1, budget // max(bytes_per_row, 1))


def max_chunk_rows(
    n_rows: int, bytes_per_row: int, chunk_size: int | None, accumulator_bytes: int = 0, result_bytes: int = 0
) -> int:
    """The most rows a chunk may take: ``chunk_size``, else what the memory allows (module docstring)."""
    if chunk_size is not None:
        return chunk_size
    if n_rows * bytes_per_row <= LOGITS_BUDGET_BYTES + accumulator_bytes:
        return max(n_rows, 1)
    return rows_within(bytes_per_row, LOGITS_BUDGET_BYTES + result_bytes)


def split_rows(n_rows: int, max_rows: int) -> int:
    """Rows per chunk: as few chunks as ``max_rows`` allows, all of about the same size.

    Every chunk reads and writes the whole V x H weight-gradient accumulator, so a nearly empty last
    chunk would cost as much as a full one. With several chunks the size is rounded up to a multiple of
    64 (cuBLAS tiles) when that still fits in ``max_rows``.
    """
    if n_rows <= 0:
        return 1
    n_chunks = -(-n_rows // max_rows)
    if n_chunks == 1:
        return n_rows  # one chunk: a buffer of exactly the rows there are
    rows = -(-n_rows // n_chunks)
    for multiple in (64, 8):
        rounded = -(-rows // multiple) * multiple
        if rounded <= max_rows:
            return rounded
    return rows
