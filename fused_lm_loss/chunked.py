"""The chunk loop and the autograd.Function around it.

Per chunk of (non-ignored) token rows::

    logits  = h_chunk @ W.T (+ b)             cuBLAS, in the matmul dtype (or fp32: logits_dtype)
    stats   = row_stats(logits)               max, sum-exp, target logit, logit sum   (fp32)
    G       = grad_logits(logits, lse)        fp32 math, stored in the matmul dtype, in place
    dX[chunk] = G @ W ;  dW += G.T @ h_chunk ;  db += G.sum(0)     (on CUDA, dX on a second stream)

so the N x V logits never exist at once. Gradients are produced in forward (scaled by
``scaling / num_items``); backward multiplies them by ``grad_output / scaling`` out of place.

Without gradients (no_grad, eval, the forward of reduction="none") nothing but the statistics needs the
logits: on a GPU with TMA the logits matmul reduces each output tile to them in its epilogue
(kernels/matmul_stats.py) and no logits chunk exists at all (``_losses_without_logits``).

Chunks are as few as the memory allows and of equal size: each one reads and writes the whole dW
accumulator, so their number, not their size, sets that cost (``max_chunk_rows``).

Buffers and their precision:
  logits chunk  (chunk_rows, V_shard)   matmul dtype, or fp32 with ``logits_dtype=torch.float32``.
                                        240 MiB; with an fp32 dW accumulator for a bf16/fp16 weight also the
                                        memory that accumulator pays for: its own when one chunk needs no
                                        accumulator, else the returned dW's, which is allocated after the loop
  G chunk       same buffer as logits (overwritten in place). With fp32 logits from bf16/fp16
                operands: two buffers of the matmul dtype holding G = hi + lo (see kernels/grad_logits.py);
                dX = hi @ W + lo @ W on tensor cores sees G to ~16 bits, dW uses hi
  row stats / loss / lse  (rows,)       fp32; partial statistics per (row, vocab segment or tile) fp32
  dX            (N, H)                  hidden dtype (each row is one full-V matmul, fp32 inside cuBLAS);
                                        fp32 (then cast once) with a hi + lo G, and for vocab-parallel
                                        partials summed across ranks (in ``accum_dtype``)
  dW            (V_shard, H)            ``accum_dtype`` (fp32 default): summed over chunks, so the
                                        narrow dtype would round once per chunk; with one chunk it is a
                                        single matmul written in the weight's dtype
  db            (V_shard,)              fp32, cast to the bias dtype at the end
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.autograd.function import once_differentiable

from . import distributed, torch_path
from .options import LossOptions

#: Memory the logits (+ gradient) chunk may take when ``chunk_size`` is None: 240 MiB, so that with
#: the small per-chunk temporaries the loss stays within 0.25 GiB beyond its inputs and gradients.
LOGITS_BUDGET_BYTES = 240 * 2**20
#: Without gradients, take the statistics from the logits matmul's epilogue where the kernel supports the
#: inputs (kernels/matmul_stats.py): no logits chunk is written or read (a switch for A/B benchmarks).
STATS_IN_MATMUL = True
#: On CUDA, run G @ W on a second stream beside G.T @ h (a switch for A/B benchmarks).
OVERLAP_GRAD_MATMULS = True
_side_streams: dict = {}
#: torch >= 2.8 lets cuBLAS write fp32 products of bf16/fp16 operands directly (``out_dtype``).
_HAS_OUT_DTYPE_MM = hasattr(torch.ops.aten.mm, "dtype_out") and hasattr(torch.ops.aten.addmm, "dtype_out")

_forced_backend: str | None = None


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force the per-chunk kernels: "triton" (also on CPU tensors under TRITON_INTERPRET=1) or "torch"."""
    global _forced_backend
    if name not in ("triton", "torch"):
        raise ValueError(f"backend must be 'triton' or 'torch', got {name!r}")
    previous, _forced_backend = _forced_backend, name
    try:
        yield
    finally:
        _forced_backend = previous


def _kernels_for(device: torch.device):
    backend = _forced_backend or ("triton" if device.type == "cuda" else "torch")
    if backend == "torch":
        return torch_path
    from . import kernels

    return kernels


def auto_chunk_rows(bytes_per_row: int, extra_bytes: int = 0) -> int:
    """The most rows per chunk for which the chunk buffers stay within LOGITS_BUDGET_BYTES (+ ``extra_bytes``)."""
    return max(1, (LOGITS_BUDGET_BYTES + extra_bytes) // max(bytes_per_row, 1))


def plan_chunk_rows(n_rows: int, max_rows: int) -> int:
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


def max_chunk_rows(
    n_rows: int, bytes_per_row: int, chunk_size: int | None, accumulator_bytes: int = 0, result_bytes: int = 0
) -> int:
    """The most rows a chunk may take: ``chunk_size``, else what the memory allows.

    The chunk buffers get LOGITS_BUDGET_BYTES, plus, when dW is summed in a wider dtype than the weight's,
    memory that the accumulator's cost already pays for (``accumulator_bytes``: the V x H accumulator;
    ``result_bytes``: the dW returned in the weight's dtype):
      - one chunk needs no accumulator (dW is a single matmul), so it may also take the accumulator's bytes;
      - with several chunks the returned dW is written once, after the loop has freed the chunk buffer, so
        the chunk may also take the returned dW's bytes.
    Either way the loss holds at most the accumulator + LOGITS_BUDGET_BYTES beyond inputs and gradients,
    and fewer chunks mean fewer passes over the accumulator, which is what costs at small chunks.
    """
    if chunk_size is not None:
        return chunk_size
    if n_rows * bytes_per_row <= LOGITS_BUDGET_BYTES + accumulator_bytes:
        return max(n_rows, 1)
    return auto_chunk_rows(bytes_per_row, result_bytes)


def _side_stream(device: torch.device):
    """A second CUDA stream for G @ W: with few rows it has few output tiles, and fills the GPU only beside
    the large G.T @ h running on the main stream."""
    if not OVERLAP_GRAD_MATMULS or device.type != "cuda":
        return None
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


@dataclass
class Rows:
    """The token rows that carry a loss, after dropping ignored labels."""

    index: torch.Tensor | None  # positions in the flattened batch; None when no label is ignored
    target: torch.Tensor  # target column in this shard's weight, -1 when the token's class is elsewhere
    count: int  # number of non-ignored tokens

    def gather(self, rows_tensor: torch.Tensor, start: int, end: int) -> torch.Tensor:
        if self.index is None:
            return rows_tensor[start:end]
        return rows_tensor.index_select(0, self.index[start:end])


def select_rows(labels: torch.Tensor, ignore_index: int, shard: distributed.Shard) -> Rows:
    """Drop ignored tokens and check every other label is a class id.

    One host sync (the row count sizes the chunks; a bad label must raise here, not in a kernel), after one
    kernel that finds the kept rows, their labels and the label range (kernels/kept_rows.py): on a GPU the
    time before the first matmul is idle, waiting for the host to issue what comes before it, and in a
    training step each sync also stops the host from running ahead (benchmarks/NOTES.md v13, v14).
    """
    if labels.numel() == 0:
        return Rows(index=None, target=labels, count=0)
    positions, targets, summary = _kernels_for(labels.device).kept_rows(labels, ignore_index)
    count, lowest, highest = summary.tolist()
    if lowest < 0 or highest >= shard.total:
        out_of_range = (labels != ignore_index) & ((labels < 0) | (labels >= shard.total))
        examples = labels[out_of_range][:5].tolist()
        raise ValueError(
            f"{int(out_of_range.sum())} label(s) are outside [0, {shard.total}) and not ignore_index={ignore_index}: "
            f"e.g. {examples}"
        )
    if count == labels.numel():
        return Rows(index=None, target=shard.local_target(labels), count=count)
    return Rows(index=positions[:count], target=shard.local_target(targets[:count]), count=count)


@dataclass(frozen=True)
class GradNeeds:
    """Which gradients to produce: the autograd inputs' requires_grad, nothing else."""

    hidden: bool = False
    weight: bool = False
    bias: bool = False
    low_rank_input: bool = False
    low_rank_weight: bool = False

    def any(self) -> bool:
        return self.hidden or self.weight or self.bias or self.low_rank_input or self.low_rank_weight


@dataclass
class ChunkOutputs:
    loss: torch.Tensor | None  # (rows.count,) fp32 per-token loss
    lse: torch.Tensor | None  # (rows.count,) fp32 log-sum-exp over the whole vocabulary
    grads: tuple  # (hidden, weight, bias, low_rank_input, low_rank_weight), None where not needed


def _logits_into(out: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out = h @ W.T (+ b); ``out`` may be fp32 while h and W are bf16/fp16 (fp32 logits)."""
    if out.dtype == h.dtype:
        if bias is None:
            torch.mm(h, weight.t(), out=out)
        else:
            torch.addmm(bias, h, weight.t(), out=out)
        return
    _matmul_accumulate(out, h, weight.t(), first=True)
    if bias is not None:
        out += bias


def _matmul_accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, first: bool) -> None:
    """acc = a @ b (first) or acc += a @ b, with acc possibly wider (fp32) than the operands.

    On CUDA the wide output comes straight out of cuBLAS (``out_dtype``, torch >= 2.8), so no
    V x H temporary exists; elsewhere the operands are upcast (exact products of bf16/fp16 values).
    """
    if acc.dtype != a.dtype:
        if a.is_cuda and _HAS_OUT_DTYPE_MM:
            if first:
                torch.ops.aten.mm.dtype_out(a, b, acc.dtype, out=acc)
            else:
                torch.ops.aten.addmm.dtype_out(acc, a, b, acc.dtype, out=acc)
            return
        a, b = a.to(acc.dtype), b.to(acc.dtype)
    if first:
        torch.mm(a, b, out=acc)
    else:
        acc.addmm_(a, b)


def mean_denominator(n_rows: int, num_items: object) -> float:
    """What reduction="mean" divides the summed loss by: ``num_items_in_batch``, else the rows with a loss
    (1 when there are none, so that all-ignored batches give 0)."""
    denominator = float(n_rows if num_items is None else num_items)
    if denominator < 0 or (denominator == 0 and n_rows > 0):
        raise ValueError(f"num_items_in_batch must be > 0 when tokens carry a loss, got {num_items}")
    return max(denominator, 1.0)


def run_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    low_rank: tuple[torch.Tensor, torch.Tensor] | None,
    rows: Rows,
    opts: LossOptions,
    shard: distributed.Shard,
    *,
    needs: GradNeeds = GradNeeds(),
    lse: torch.Tensor | None = None,
    grad_scale: float = 1.0,
    row_scale: torch.Tensor | None = None,
) -> ChunkOutputs:
    """The chunk loop shared by every path (Triton or PyTorch kernels, forward or recompute).

    ``hidden`` is (N, H); the loop visits only ``rows``. ``low_rank = (u, B)`` adds u @ B.T to the
    logits (a LoRA adapter on lm_head). With ``lse`` given (recompute in backward) the stats pass is
    skipped. Gradient rows are scaled by ``grad_scale`` (times ``row_scale[i]``).
    """
    ops = _kernels_for(hidden.device)
    device, mm_dtype = hidden.device, hidden.dtype
    n_rows, vocab = rows.count, weight.shape[0]
    compute_stats = lse is None

    logits_dtype = opts.logits_dtype or mm_dtype
    if compute_stats and not needs.any() and low_rank is None and _stats_in_matmul(ops, hidden, weight):
        return _losses_without_logits(hidden, weight, bias, rows, opts, shard, ops, logits_dtype)
    split_grad = needs.any() and logits_dtype != mm_dtype  # fp32 logits: G kept as hi + lo (see module doc)
    # dX is kept wider than the matmul dtype when it is a sum (hi + lo terms; vocab shards' partials) that
    # should be rounded once, where the matmul writes that dtype directly; upcasting W every chunk instead
    # (CUDA, torch < 2.8) would cost more.
    grad_input_dtype = mm_dtype
    if device.type != "cuda" or _HAS_OUT_DTYPE_MM:
        grad_input_dtype = torch.float32 if split_grad else shard.grad_input_dtype(mm_dtype, opts)

    bytes_per_row = shard.chunk_vocab * (logits_dtype.itemsize + (2 * mm_dtype.itemsize if split_grad else 0))
    if rows.index is not None:  # per-chunk copies of the kept rows: h (and u) gathered, dX (and du) scattered
        rank = 0 if low_rank is None else low_rank[0].shape[1]
        bytes_per_row += (hidden.shape[1] + rank) * mm_dtype.itemsize
        bytes_per_row += (hidden.shape[1] * needs.hidden + rank * needs.low_rank_input) * grad_input_dtype.itemsize
    accum_dtype = torch.promote_types(opts.accum_dtype or weight.dtype, weight.dtype)
    wide_dw = needs.weight and accum_dtype != weight.dtype
    chunk_rows = plan_chunk_rows(
        n_rows,
        max_chunk_rows(
            n_rows,
            bytes_per_row,
            opts.chunk_size,
            accumulator_bytes=weight.numel() * accum_dtype.itemsize if wide_dw else 0,
            result_bytes=weight.numel() * weight.dtype.itemsize if wide_dw else 0,
        ),
    )
    if chunk_rows >= n_rows:  # one chunk: each weight gradient is one matmul (fp32 inside), rounded once
        accum_dtype = weight.dtype
    logits_buf, grad_buf, grad_lo_buf = _chunk_buffers(chunk_rows, vocab, logits_dtype, mm_dtype, split_grad, device)

    loss_rows = torch.empty(n_rows, dtype=torch.float32, device=device) if compute_stats else None
    lse_rows = torch.empty(n_rows, dtype=torch.float32, device=device) if compute_stats else lse
    grad_hidden = _row_grad_buffer(hidden, rows, grad_input_dtype) if needs.hidden else None
    grad_low_rank_input = _row_grad_buffer(low_rank[0], rows, grad_input_dtype) if needs.low_rank_input else None
    grad_weight = _Accumulator(weight.shape, accum_dtype, device) if needs.weight else None
    grad_low_rank_weight = _Accumulator(low_rank[1].shape, accum_dtype, device) if needs.low_rank_weight else None
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=device) if needs.bias else None

    smoothing = opts.label_smoothing
    loss_options = dict(
        logit_scale=opts.logit_scale,
        softcap=opts.softcap,
        label_smoothing=smoothing,
        vocab_size=shard.total,
        z_loss=opts.z_loss,
    )
    for start in range(0, n_rows, chunk_rows):
        end = min(start + chunk_rows, n_rows)
        h = rows.gather(hidden, start, end)
        target = rows.target[start:end]
        logits = logits_buf[: end - start]
        _logits_into(logits, h, weight, bias)
        if low_rank is not None:
            u = rows.gather(low_rank[0], start, end)
            _matmul_accumulate(logits, u, low_rank[1].t(), first=False)

        grad = grad_buf[: end - start]
        grad_lo = None if grad_lo_buf is None else grad_lo_buf[: end - start]
        # dX gets G as hi + lo; dW, summed in fp32 over all rows, is already as exact as torch's with hi alone
        # (benchmarks/NOTES.md), and one GEMM cheaper.
        dx_terms = (grad,) if grad_lo is None else (grad, grad_lo)
        if compute_stats and shard.group is None:  # the chunk holds the whole vocabulary
            ops.row_losses(logits, target, loss_rows[start:end], lse_rows[start:end], **loss_options)
        elif compute_stats:  # vocab-parallel: merge the shards' statistics first
            stats = ops.row_stats(
                logits, target, logit_scale=opts.logit_scale, softcap=opts.softcap, need_sum=smoothing > 0
            )
            loss_rows[start:end], lse_rows[start:end] = torch_path.loss_from_stats(
                *shard.merge_stats(*stats), label_smoothing=smoothing, z_loss=opts.z_loss, vocab_size=shard.total
            )
        if not needs.any():
            continue
        ops.grad_logits(
            logits,
            grad,
            target,
            lse_rows[start:end],
            grad_scale=grad_scale,
            row_scale=None if row_scale is None else row_scale[start:end],
            out_lo=grad_lo,
            **loss_options,
        )
        # dX beside dW; with no weight gradient (frozen lm_head) there is nothing to run beside
        has_dx = grad_hidden is not None or grad_low_rank_input is not None
        has_dw = grad_weight is not None or grad_low_rank_weight is not None
        side = _side_stream(device) if has_dx and has_dw else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if grad_hidden is not None:
                _store_rows(grad_hidden, rows, start, end, dx_terms, weight)
            if grad_low_rank_input is not None:
                _store_rows(grad_low_rank_input, rows, start, end, dx_terms, low_rank[1])
        if grad_weight is not None:
            grad_weight.add(grad.t(), h)
        if grad_low_rank_weight is not None:
            grad_low_rank_weight.add(grad.t(), u)
        if grad_bias is not None:
            grad_bias += grad.sum(dim=0, dtype=torch.float32)
        if side is not None:  # the next chunk overwrites G
            torch.cuda.current_stream(device).wait_stream(side)

    # Free the chunk buffers first: with several chunks the dW result takes their memory (max_chunk_rows).
    logits_buf = grad_buf = grad_lo_buf = logits = grad = grad_lo = dx_terms = None
    grad_hidden, grad_low_rank_input = (
        None if partial is None else shard.sum_partial_grad(partial, opts).to(mm_dtype)  # one rounding
        for partial in (grad_hidden, grad_low_rank_input)
    )
    grads = (
        grad_hidden,
        None if grad_weight is None else grad_weight.result(weight.dtype),
        None if grad_bias is None else grad_bias.to(bias.dtype),
        grad_low_rank_input,
        None if grad_low_rank_weight is None else grad_low_rank_weight.result(low_rank[1].dtype),
    )
    return ChunkOutputs(loss=loss_rows, lse=lse_rows, grads=grads)


def _stats_in_matmul(ops, hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    return STATS_IN_MATMUL and ops is not torch_path and ops.matmul_stats.supported(hidden, weight)


def _losses_without_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: Rows,
    opts: LossOptions,
    shard: distributed.Shard,
    ops,
    logits_dtype: torch.dtype,
) -> ChunkOutputs:
    """Loss and lse without gradients: the logits matmul reduces its tiles to row statistics in its epilogue
    (kernels/matmul_stats.py), so no logits exist; chunks only bound the fp32 partials (and gathered rows)."""
    n_rows, smoothing = rows.count, opts.label_smoothing
    bytes_per_row = ops.matmul_stats.partial_bytes_per_row(weight.shape[0])
    if rows.index is not None:
        bytes_per_row += hidden.shape[1] * hidden.element_size()
    chunk_rows = plan_chunk_rows(n_rows, opts.chunk_size or auto_chunk_rows(bytes_per_row))
    loss = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(loss)
    for start in range(0, n_rows, chunk_rows):
        end = min(start + chunk_rows, n_rows)
        partial = ops.matmul_stats.matmul_partials(
            rows.gather(hidden, start, end),
            weight,
            bias,
            rows.target[start:end],
            logits_dtype=logits_dtype,
            logit_scale=opts.logit_scale,
            softcap=opts.softcap,
            need_sum=smoothing > 0,
        )
        merge = dict(label_smoothing=smoothing, z_loss=opts.z_loss, vocab_size=shard.total)
        if shard.group is None:
            ops.merge_partials(partial, need_sum=smoothing > 0, loss_out=loss[start:end], lse_out=lse[start:end], **merge)
        else:  # vocab-parallel: merge the shards' statistics first
            stats = shard.merge_stats(*ops.merge_partials(partial, need_sum=smoothing > 0))
            loss[start:end], lse[start:end] = torch_path.loss_from_stats(*stats, **merge)
    return ChunkOutputs(loss=loss, lse=lse, grads=(None,) * 5)


def _chunk_buffers(
    rows: int, vocab: int, logits_dtype: torch.dtype, mm_dtype: torch.dtype, split_grad: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(logits, G, G_lo) chunk buffers: G overwrites the logits in place, except with fp32 logits from
    bf16/fp16 operands, where G = hi + lo gets two buffers of its own. They are carved from one allocation
    (each part 256-byte aligned for cuBLAS), so that what they free after the loop is one block."""
    parts = [logits_dtype] + ([mm_dtype, mm_dtype] if split_grad else [])
    sizes = [-(-rows * vocab * dtype.itemsize // 256) * 256 for dtype in parts]
    flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    views, offset = [], 0
    for dtype, size in zip(parts, sizes):
        views.append(flat[offset : offset + rows * vocab * dtype.itemsize].view(dtype).view(rows, vocab))
        offset += size
    if not split_grad:
        return views[0], views[0], None
    return views[0], views[1], views[2]


def _row_grad_buffer(like: torch.Tensor, rows: Rows, dtype: torch.dtype) -> torch.Tensor:
    """Gradient of a per-token input: rows that carry no loss stay zero."""
    alloc = torch.empty if rows.index is None else torch.zeros
    return alloc(like.shape, dtype=dtype, device=like.device)


def _store_rows(
    out: torch.Tensor, rows: Rows, start: int, end: int, grad_terms: tuple, weight: torch.Tensor
) -> None:
    """out[chunk rows] = sum(G_k @ weight); ``out`` may be wider (fp32) than the G terms and weight."""
    part = out[start:end]
    if rows.index is not None:
        part = torch.empty((end - start, out.shape[1]), dtype=out.dtype, device=out.device)
    for k, term in enumerate(grad_terms):
        _matmul_accumulate(part, term, weight, first=k == 0)
    if rows.index is not None:
        out.index_copy_(0, rows.index[start:end], part)


class _Accumulator:
    """A weight gradient summed over chunks in ``dtype``; the first chunk writes instead of adding."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self.total: torch.Tensor | None = None

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        first = self.total is None
        if first:
            self.total = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        _matmul_accumulate(self.total, a, b, first=first)

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        """The sum in ``dtype`` (the accumulator itself when it already has that dtype)."""
        if self.total is None:  # no token carried a loss
            return torch.zeros(self.shape, dtype=dtype, device=self.device)
        return self.total.to(dtype)


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """loss = CE(softcap(logit_scale * (hidden @ W.T + b + u @ B.T)), labels) (+ z-loss), chunked.

    Inputs are already validated (see ``loss.fused_lm_loss``): hidden (..., H), weight (V, H) of the
    same dtype, labels shaped like hidden.shape[:-1]; the low-rank pair (u (..., r), B (V, r)) is optional.
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, low_rank_input, low_rank_weight, labels, opts, scaling, num_items, grad_enabled
    ):
        hidden2d = hidden.reshape(-1, hidden.shape[-1])
        low_rank = None
        if low_rank_input is not None:
            low_rank = (low_rank_input.reshape(-1, low_rank_input.shape[-1]), low_rank_weight)
        shard = distributed.Shard.of(weight, labels, opts)
        rows = select_rows(labels.reshape(-1), opts.ignore_index, shard)
        # Inside forward grad mode is always off; whether the caller's was on is passed in.
        needs = GradNeeds(*ctx.needs_input_grad[:5]) if grad_enabled else GradNeeds()
        ctx.shapes = (hidden.shape, None if low_rank_input is None else low_rank_input.shape)
        ctx.opts, ctx.shard, ctx.rows, ctx.needs = opts, shard, rows, needs

        if opts.reduction == "none":
            # Per-token grad_output is unknown until backward: keep lse, recompute the rest then.
            out = run_chunks(hidden2d, weight, bias, low_rank, rows, opts, shard)
            if needs.any():
                ctx.lse = out.lse
                ctx.save_for_backward(hidden2d, weight, bias, *(low_rank or (None, None)))
            per_token = torch.zeros(labels.numel(), dtype=torch.float32, device=hidden.device)
            if rows.index is None:
                per_token.copy_(out.loss)
            else:
                per_token.index_copy_(0, rows.index, out.loss)
            return per_token.view(labels.shape)

        denominator = mean_denominator(rows.count, num_items) if opts.reduction == "mean" else 1.0
        out = run_chunks(
            hidden2d, weight, bias, low_rank, rows, opts, shard, needs=needs, grad_scale=scaling / denominator
        )
        ctx.scaling = scaling
        # Saved through autograd (not as plain attributes), already in the inputs' shapes, so the engine sees
        # our reference to the very tensors it receives: it then never steals them for param.grad and
        # accumulates into them in place (retain_graph stays right).
        ctx.save_for_backward(*_input_shaped(out.grads, ctx.shapes))
        return out.loss.sum() / denominator

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        if ctx.opts.reduction == "none":
            grads = _recompute_grads(ctx, grad_output)
        else:
            grads = _rescale_grads(ctx, grad_output)
        return (*grads, None, None, None, None, None)


def _input_shaped(grads: tuple, shapes: tuple) -> tuple:
    """Per-token gradients come out of the chunk loop as (N, .): view them in their input's shape."""
    grad_hidden, grad_weight, grad_bias, grad_low_rank_input, grad_low_rank_weight = grads
    hidden_shape, low_rank_shape = shapes
    if grad_hidden is not None:
        grad_hidden = grad_hidden.view(hidden_shape)
    if grad_low_rank_input is not None:
        grad_low_rank_input = grad_low_rank_input.view(low_rank_shape)
    return grad_hidden, grad_weight, grad_bias, grad_low_rank_input, grad_low_rank_weight


def _rescale_grads(ctx, grad_output: torch.Tensor) -> tuple:
    """Apply grad_output / scaling to the gradients made in forward, never in place (retain_graph)."""
    go = float(grad_output)
    grads = ctx.saved_tensors
    if ctx.scaling == 0.0:
        if go != 0.0:
            raise RuntimeError(
                "the fused loss was computed with scaling=0 (a GradScaler scale of 0?): its gradients are all "
                f"zero and cannot be rescaled to grad_output={go}. Use a non-zero scale."
            )
        return tuple(None if g is None else torch.zeros_like(g) for g in grads)
    factor = go / ctx.scaling
    if factor == 1.0:
        return grads
    return tuple(None if g is None else g * factor for g in grads)


def _recompute_grads(ctx, grad_output: torch.Tensor) -> tuple:
    """reduction="none": rerun the chunk loop with the per-token grad_output as each row's scale."""
    hidden2d, weight, bias, low_rank_input, low_rank_weight = ctx.saved_tensors
    low_rank = None if low_rank_input is None else (low_rank_input, low_rank_weight)
    rows = ctx.rows
    per_token = grad_output.reshape(-1)
    row_scale = (per_token if rows.index is None else per_token[rows.index]).float().contiguous()
    out = run_chunks(
        hidden2d, weight, bias, low_rank, rows, ctx.opts, ctx.shard, needs=ctx.needs, lse=ctx.lse, row_scale=row_scale
    )
    return _input_shaped(out.grads, ctx.shapes)
