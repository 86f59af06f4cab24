"""The chunk loop: one implementation for every path (forward, recompute; hidden states or given logits).

Per chunk of kept token rows (those whose label is not ``ignore_index``)::

    logits  = head.logits(chunk)              LinearHead: h_chunk @ W.T (+ b) (+ u @ B.T), cuBLAS;
                                              GivenLogits: the rows of logits that already exist
    loss, lse = backend.row_losses(logits)    online softmax in fp32 (vocab-parallel: row_stats, merged)
    G       = backend.grad_logits(logits)     fp32 math, stored in the matmul dtype (in place of the logits)
    head.backprop(G)                          dX[chunk] = G @ W ; dW += G.T @ h ; db += G.sum(0)
                                              (CUDA: dX on a second stream beside dW); or dlogits[chunk] = G

so the N x V logits never exist at once. Gradients are produced in forward (scaled by ``plan.grad_scale``,
times ``row_scale`` per row when recomputing for a per-token grad_output); ``ops.py`` wraps this in
PyTorch operators and applies ``grad_output`` in backward. Every decision (chunk rows, dtypes, backend,
scale) comes from the ``Plan`` (``plan.py``).

Without gradients and on a GPU with TMA, nothing but the statistics needs the logits: the logits matmul
reduces each output tile to them in its epilogue (kernels/matmul_stats.py) and no logits chunk exists
(``_losses_from_matmul``).

Buffers and their precision:
  logits chunk  (chunk_rows, V_shard)   matmul dtype, or fp32 with ``logits_dtype=torch.float32``
  G chunk       same buffer as logits (overwritten in place). With fp32 logits from bf16/fp16
                operands: two buffers of the matmul dtype holding G = hi + lo (see kernels/grad_logits.py);
                dX = hi @ W + lo @ W on tensor cores sees G to ~16 bits, dW uses hi
  row stats / loss / lse  (rows,)       fp32; partial statistics per (row, vocab segment or tile) fp32
  dX            (N, H)                  hidden dtype (each row is one full-V matmul, fp32 inside cuBLAS);
                                        fp32 (then cast once) with a hi + lo G, and for vocab-parallel
                                        partials summed across ranks (in ``accum_dtype``)
  dW            (V_shard, H)            ``plan.accum_dtype`` (fp32 default): summed over chunks, so the
                                        narrow dtype would round once per chunk; with one chunk it is a
                                        single matmul written in the weight's dtype
  db            (V_shard,)              fp32, cast to the bias dtype at the end
  dlogits       (N, V)                  the given logits' dtype (GivenLogits)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from . import distributed
from .backends import Backend
from .plan import HAS_OUT_DTYPE_MM, Plan
from .torch_backend import loss_from_stats

_side_streams: dict = {}


def label_ids(labels: torch.Tensor) -> torch.Tensor:
    """The one place labels are normalized: 1-d int64, any strides kept (a slice, a broadcast).

    Every integer dtype is accepted. Narrower ones are widened first, since torch compares e.g. a uint8
    tensor with a negative ``ignore_index`` modulo 256 (label 156 would count as -100).
    """
    labels = labels.reshape(-1)
    return labels if labels.dtype == torch.int64 else labels.long()


@dataclass
class Rows:
    """The token rows that carry a loss, after dropping ignored labels."""

    index: torch.Tensor | None  # positions in the flattened batch; None when no label is ignored
    target: torch.Tensor  # contiguous int64: column in this shard's weight, -1 when the class is elsewhere
    count: int  # number of non-ignored tokens
    total: int  # number of tokens, ignored ones included

    def gather(self, rows_tensor: torch.Tensor, start: int, end: int) -> torch.Tensor:
        if self.index is None:
            return rows_tensor[start:end]
        return rows_tensor.index_select(0, self.index[start:end])


def select_rows(labels: torch.Tensor, ignore_index: int, shard: distributed.Shard, backend: Backend) -> Rows:
    """Drop ignored tokens and check every other label is a class id.

    ``labels`` comes from ``label_ids`` (1-d int64, any strides: a slice, a broadcast); the kept labels
    come back as a new contiguous int64 tensor, which is all that any later kernel sees. One host sync (the row count
    sizes the chunks; a bad label must raise here, not in a kernel), after one kernel that finds the kept
    rows, their labels and the label range (kernels/kept_rows.py).
    """
    if labels.numel() == 0:
        return Rows(index=None, target=torch.empty(0, dtype=torch.int64, device=labels.device), count=0, total=0)
    positions, targets, summary = backend.kept_rows(labels, ignore_index)
    count, lowest, highest = summary.tolist()
    if lowest < 0 or highest >= shard.total:
        out_of_range = (labels != ignore_index) & ((labels < 0) | (labels >= shard.total))
        examples = labels[out_of_range][:5].tolist()
        raise ValueError(
            f"{int(out_of_range.sum())} label(s) are outside [0, {shard.total}) and not ignore_index={ignore_index}: "
            f"e.g. {examples}"
        )
    index = None if count == labels.numel() else positions[:count]
    return Rows(index=index, target=shard.local_target(targets[:count]), count=count, total=labels.numel())


@dataclass
class ChunkOutputs:
    loss: torch.Tensor | None  # (rows.count,) fp32 per-token loss
    lse: torch.Tensor | None  # (rows.count,) fp32 log-sum-exp over the whole vocabulary
    grads: tuple  # the head's gradients, None where not needed


def run_chunks(
    plan: Plan, head, rows: Rows, *, lse: torch.Tensor | None = None, row_scale: torch.Tensor | None = None
) -> ChunkOutputs:
    """The chunk loop shared by every path. With ``lse`` given (recompute in backward) the statistics pass
    is skipped; ``row_scale`` (rows.count,) multiplies each row's gradient."""
    if plan.stats_in_matmul:
        return _losses_from_matmul(plan, head, rows)
    backend, device = plan.backend, head.device
    compute_stats = lse is None
    loss_rows = torch.empty(plan.n_rows, dtype=torch.float32, device=device) if compute_stats else None
    lse_rows = torch.empty(plan.n_rows, dtype=torch.float32, device=device) if compute_stats else lse
    head.start(plan, rows)
    for start, end in plan.chunks():
        logits = head.logits(start, end)
        target = rows.target[start:end]
        if compute_stats:
            _chunk_losses(plan, logits, target, loss_rows[start:end], lse_rows[start:end])
        if not plan.needs.any():
            continue
        grad, grad_lo = head.grad_buffers(start, end)
        backend.grad_logits(
            logits,
            grad,
            target,
            lse_rows[start:end],
            grad_scale=plan.grad_scale,
            row_scale=None if row_scale is None else row_scale[start:end],
            out_lo=grad_lo,
            **plan.loss_terms,
        )
        head.backprop(start, end)
    return ChunkOutputs(loss=loss_rows, lse=lse_rows, grads=head.finish())


def _chunk_losses(plan: Plan, logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor, lse: torch.Tensor) -> None:
    """Per-row loss and lse of one chunk, into ``loss`` and ``lse``."""
    if plan.shard.group is None:  # the chunk holds the whole vocabulary
        plan.backend.row_losses(logits, target, loss, lse, **plan.loss_terms)
        return
    stats = plan.backend.row_stats(
        logits, target, logit_scale=plan.logit_scale, softcap=plan.softcap, need_sum=plan.need_sum
    )
    loss[:], lse[:] = loss_from_stats(  # vocab-parallel: merge the shards' statistics first
        *plan.shard.merge_stats(*stats), label_smoothing=plan.label_smoothing, z_loss=plan.z_loss,
        vocab_size=plan.shard.total,
    )


def _losses_from_matmul(plan: Plan, head: "LinearHead", rows: Rows) -> ChunkOutputs:
    """Loss and lse without gradients: the logits matmul reduces its tiles to row statistics in its epilogue
    (kernels/matmul_stats.py), so no logits exist; chunks only bound the fp32 partials (and gathered rows)."""
    backend, shard = plan.backend, plan.shard
    loss = torch.empty(plan.n_rows, dtype=torch.float32, device=head.device)
    lse = torch.empty_like(loss)
    merge = dict(label_smoothing=plan.label_smoothing, z_loss=plan.z_loss, vocab_size=shard.total)
    for start, end in plan.chunks():
        partial = backend.matmul_partials(
            rows.gather(head.hidden, start, end),
            head.weight,
            head.bias,
            rows.target[start:end],
            logits_dtype=plan.logits_dtype,
            logit_scale=plan.logit_scale,
            softcap=plan.softcap,
            need_sum=plan.need_sum,
        )
        if shard.group is None:
            backend.merge_partials(partial, need_sum=plan.need_sum, loss_out=loss[start:end], lse_out=lse[start:end], **merge)
        else:  # vocab-parallel: merge the shards' statistics first
            stats = shard.merge_stats(*backend.merge_partials(partial, need_sum=plan.need_sum))
            loss[start:end], lse[start:end] = loss_from_stats(*stats, **merge)
    return ChunkOutputs(loss=loss, lse=lse, grads=(None,) * 5)


class LinearHead:
    """logits = h @ W.T (+ b) (+ u @ B.T) of the kept rows; gradients for hidden, weight, bias, u and B.

    ``hidden`` (N, H), ``weight`` (V_shard, H), ``low_rank = (u (N, r), B (V_shard, r))`` or None: a LoRA
    adapter on lm_head. ``finish`` returns (d hidden, d weight, d bias, d u, d B), None where not needed.
    """

    def __init__(self, hidden, weight, bias, low_rank) -> None:
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.u, self.b = low_rank if low_rank is not None else (None, None)
        self.device, self.matmul_dtype = hidden.device, hidden.dtype

    # what make_plan asks of a head
    transformed = False  # the logits are raw matmul outputs: the plan applies softcap / logit scale
    @property
    def vocab_weight(self) -> torch.Tensor:
        return self.weight

    @property
    def stats_operands(self):
        """(hidden, weight) when the statistics may come from the matmul epilogue (no low-rank term)."""
        return (self.hidden, self.weight) if self.u is None else None

    def row_bytes(self, has_index: bool, needs, grad_input_dtype: torch.dtype) -> int:
        """Per-chunk copies of the kept rows: h (and u) gathered, dX (and du) rows before their scatter."""
        if not has_index:
            return 0
        rank = 0 if self.u is None else self.u.shape[1]
        size = self.matmul_dtype.itemsize * (self.hidden.shape[1] + rank)
        return size + grad_input_dtype.itemsize * (self.hidden.shape[1] * needs.hidden + rank * needs.low_rank_input)

    # the loop
    def start(self, plan: Plan, rows: Rows) -> None:
        self.plan, self.rows, needs = plan, rows, plan.needs
        self.buffers = _chunk_buffers(
            plan.chunk_rows, self.weight.shape[0], plan.logits_dtype, plan.matmul_dtype, plan.split_grad, self.device
        )
        self.grad_hidden = _row_grad_buffer(self.hidden, rows, plan.grad_input_dtype) if needs.hidden else None
        self.grad_u = _row_grad_buffer(self.u, rows, plan.grad_input_dtype) if needs.low_rank_input else None
        self.grad_weight = _Accumulator(self.weight.shape, plan.accum_dtype, self.device) if needs.weight else None
        # B is small (V x r): summed and kept in the wide dtype, so that backward rounds it once
        self.grad_b = _Accumulator(self.b.shape, plan.kept_dtype, self.device) if needs.low_rank_weight else None
        self.grad_bias = torch.zeros(self.weight.shape[0], dtype=torch.float32, device=self.device) if needs.bias else None
        self.side = _side_stream(self.device) if plan.overlap_grad_matmuls else None

    def logits(self, start: int, end: int) -> torch.Tensor:
        self.h = self.rows.gather(self.hidden, start, end)
        logits = self.buffers[0][: end - start]
        _logits_into(logits, self.h, self.weight, self.bias)
        if self.u is not None:
            self.u_rows = self.rows.gather(self.u, start, end)
            _matmul_accumulate(logits, self.u_rows, self.b.t(), first=False)
        return logits

    def grad_buffers(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, grad, grad_lo = self.buffers
        self.grad = grad[: end - start]
        self.grad_lo = None if grad_lo is None else grad_lo[: end - start]
        return self.grad, self.grad_lo

    def backprop(self, start: int, end: int) -> None:
        grad, side = self.grad, self.side
        # dX gets G as hi + lo; dW, summed in fp32 over all rows, is already as exact as torch's with hi alone
        # (benchmarks/NOTES.md), and one GEMM cheaper.
        dx_terms = (grad,) if self.grad_lo is None else (grad, self.grad_lo)
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if self.grad_hidden is not None:
                _store_rows(self.grad_hidden, self.rows, start, end, dx_terms, self.weight)
            if self.grad_u is not None:
                _store_rows(self.grad_u, self.rows, start, end, dx_terms, self.b)
        if self.grad_weight is not None:
            self.grad_weight.add(grad.t(), self.h)
        if self.grad_b is not None:
            self.grad_b.add(grad.t(), self.u_rows)
        if self.grad_bias is not None:
            self.grad_bias += grad.sum(dim=0, dtype=torch.float32)
        if side is not None:  # the next chunk overwrites G
            torch.cuda.current_stream(self.device).wait_stream(side)

    def finish(self) -> tuple:
        # Free the chunk buffers first: with several chunks the dW result takes their memory (plan.py).
        self.buffers = self.h = self.u_rows = self.grad = self.grad_lo = None
        plan = self.plan
        grad_hidden, grad_u = (
            None if partial is None else plan.shard.sum_partial_grad(partial) for partial in (self.grad_hidden, self.grad_u)
        )
        return (  # rounded to the inputs' dtypes in backward, after grad_output / scaling (ops.py)
            grad_hidden,
            None if self.grad_weight is None else self.grad_weight.result(plan.weight_grad_dtype),
            None if self.grad_bias is None else self.grad_bias.to(plan.kept_dtype),
            grad_u,
            None if self.grad_b is None else self.grad_b.result(plan.kept_dtype),
        )


class GivenLogits:
    """The logits already exist (transformers' loss signature): read their rows, write d(loss)/d(logits).

    ``logits`` (N, V) already carry the model's softcap / scale. ``finish`` returns (d logits,) or (None,).
    """

    def __init__(self, logits: torch.Tensor) -> None:
        self.given, self.device, self.matmul_dtype = logits, logits.device, logits.dtype
        self.vocab_weight = self.stats_operands = None

    transformed = True  # the logits already carry the model's softcap / scale; their dtype is the logits dtype

    def row_bytes(self, has_index: bool, needs, grad_input_dtype: torch.dtype) -> int:
        return 0  # the chunk buffer (gathered rows, then G in place) is the logits buffer of the plan

    def start(self, plan: Plan, rows: Rows) -> None:
        self.plan, self.rows = plan, rows
        contiguous_rows = self.given.stride(1) == 1
        self.buffer = None
        if rows.index is not None or not contiguous_rows:
            self.buffer = torch.empty((plan.chunk_rows, self.given.shape[1]), dtype=self.matmul_dtype, device=self.device)
        self.grad_logits = None
        if plan.needs.any():
            alloc = torch.empty if rows.index is None else torch.zeros  # ignored rows: zero gradient
            self.grad_logits = alloc(self.given.shape, dtype=self.matmul_dtype, device=self.device)

    def logits(self, start: int, end: int) -> torch.Tensor:
        if self.buffer is None:
            return self.given[start:end]
        out = self.buffer[: end - start]
        if self.rows.index is None:
            out.copy_(self.given[start:end])
        else:
            torch.index_select(self.given, 0, self.rows.index[start:end], out=out)
        return out

    def grad_buffers(self, start: int, end: int) -> tuple[torch.Tensor, None]:
        if self.rows.index is None:
            return self.grad_logits[start:end], None  # G straight into the result
        return self.buffer[: end - start], None  # in place over the gathered rows, scattered in backprop

    def backprop(self, start: int, end: int) -> None:
        if self.rows.index is not None:
            self.grad_logits.index_copy_(0, self.rows.index[start:end], self.buffer[: end - start])

    def finish(self) -> tuple:
        self.buffer = None
        return (self.grad_logits,)


def _side_stream(device: torch.device):
    """A second CUDA stream for G @ W: with few rows it has few output tiles, and fills the GPU only beside
    the large G.T @ h running on the main stream."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


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
        if a.is_cuda and HAS_OUT_DTYPE_MM:
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
