"""The chunk loop and the autograd.Function around it.

Per chunk of (non-ignored) token rows::

    logits  = h_chunk @ W.T (+ b)             cuBLAS, in the matmul dtype (or fp32: logits_dtype)
    stats   = row_stats(logits)               max, sum-exp, target logit, logit sum   (fp32)
    G       = grad_logits(logits, lse)        fp32 math, stored in the matmul dtype, in place
    dX[chunk] = G @ W ;  dW += G.T @ h_chunk ;  db += G.sum(0)

so the N x V logits never exist at once. Gradients are produced in forward (scaled by
``scaling / num_items``); backward multiplies them by ``grad_output / scaling`` out of place.

Buffers and their precision:
  logits chunk  (chunk_rows, V_shard)   matmul dtype, or fp32 with ``logits_dtype=torch.float32``
  G chunk       same buffer as logits (overwritten in place) unless logits are fp32: then its own
                buffer in the matmul dtype, so both backward matmuls run on tensor cores
  row stats / loss / lse  (rows,)       fp32
  dX            (N, H)                  hidden dtype (each row is one full-V matmul, fp32 inside cuBLAS)
  dW            (V_shard, H)            ``accum_dtype`` (fp32 default): summed over chunks, so the
                                        narrow dtype would round once per chunk
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

#: Memory the logits (+ gradient) chunk may take when ``chunk_size`` is None.
LOGITS_BUDGET_BYTES = 256 * 2**20

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


def auto_chunk_rows(bytes_per_row: int) -> int:
    """Rows per chunk so that the chunk buffers stay within LOGITS_BUDGET_BYTES (multiple of 128 when large)."""
    rows = max(1, LOGITS_BUDGET_BYTES // max(bytes_per_row, 1))
    return rows // 128 * 128 if rows >= 256 else rows


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
    """Drop ignored tokens and check every other label is a class id (one host sync)."""
    valid = labels != ignore_index
    out_of_range = valid & ((labels < 0) | (labels >= shard.total))
    count, n_bad = torch.stack([valid.sum(), out_of_range.sum()]).tolist()
    if n_bad:
        examples = labels[out_of_range][:5].tolist()
        raise ValueError(
            f"{n_bad} label(s) are outside [0, {shard.total}) and not ignore_index={ignore_index}: e.g. {examples}"
        )
    index = None if count == labels.numel() else torch.nonzero(valid).squeeze(1)
    target = labels if index is None else labels[index]
    return Rows(index=index, target=shard.local_target(target), count=count)


@dataclass
class ChunkOutputs:
    loss: torch.Tensor | None  # (rows.count,) fp32 per-token loss
    lse: torch.Tensor | None  # (rows.count,) fp32 log-sum-exp over the whole vocabulary
    grad_hidden: torch.Tensor | None
    grad_weight: torch.Tensor | None
    grad_bias: torch.Tensor | None


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


_HAS_OUT_DTYPE_MM = hasattr(torch.ops.aten.mm, "dtype_out") and hasattr(torch.ops.aten.addmm, "dtype_out")


def run_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: Rows,
    opts: LossOptions,
    shard: distributed.Shard,
    *,
    lse: torch.Tensor | None = None,
    grad_scale: float = 1.0,
    row_scale: torch.Tensor | None = None,
    need_grad_hidden: bool = False,
    need_grad_weight: bool = False,
    need_grad_bias: bool = False,
) -> ChunkOutputs:
    """The chunk loop shared by every path (Triton or PyTorch kernels, forward or recompute).

    ``hidden`` is (N, H); the loop visits only ``rows``. With ``lse`` given (recompute in backward)
    the stats pass is skipped. Gradient rows are scaled by ``grad_scale`` (times ``row_scale[i]``).
    """
    ops = _kernels_for(hidden.device)
    device, mm_dtype = hidden.device, hidden.dtype
    n_rows, vocab = rows.count, weight.shape[0]
    chunk_vocab = shard.chunk_vocab
    need_grads = need_grad_hidden or need_grad_weight or need_grad_bias
    compute_stats = lse is None

    logits_dtype = opts.logits_dtype or mm_dtype
    separate_grad = need_grads and logits_dtype != mm_dtype
    bytes_per_row = chunk_vocab * (logits_dtype.itemsize + (mm_dtype.itemsize if separate_grad else 0))
    chunk_rows = max(1, min(opts.chunk_size or auto_chunk_rows(bytes_per_row), n_rows))
    logits_buf = torch.empty((chunk_rows, vocab), dtype=logits_dtype, device=device)
    grad_buf = torch.empty((chunk_rows, vocab), dtype=mm_dtype, device=device) if separate_grad else logits_buf

    loss_rows = torch.empty(n_rows, dtype=torch.float32, device=device) if compute_stats else None
    lse_rows = torch.empty(n_rows, dtype=torch.float32, device=device) if compute_stats else lse
    grad_hidden = grad_weight = grad_bias = None
    if need_grad_hidden:
        alloc = torch.empty if rows.index is None else torch.zeros
        grad_hidden = alloc(hidden.shape, dtype=mm_dtype, device=device)
    if need_grad_weight:
        accum_dtype = torch.promote_types(opts.accum_dtype or weight.dtype, weight.dtype)
        grad_weight = torch.zeros(weight.shape, dtype=accum_dtype, device=device) if n_rows == 0 else None
    if need_grad_bias:
        grad_bias = torch.zeros(vocab, dtype=torch.float32, device=device)

    smoothing = opts.label_smoothing
    for start in range(0, n_rows, chunk_rows):
        end = min(start + chunk_rows, n_rows)
        h = rows.gather(hidden, start, end)
        target = rows.target[start:end]
        logits = logits_buf[: end - start]
        _logits_into(logits, h, weight, bias)

        if compute_stats:
            stats = ops.row_stats(
                logits, target, logit_scale=opts.logit_scale, softcap=opts.softcap, need_sum=smoothing > 0
            )
            row_max, row_sumexp, target_logit, logit_sum = shard.merge_stats(*stats)
            chunk_lse = row_max + torch.log(row_sumexp)
            chunk_loss = chunk_lse - (1.0 - smoothing) * target_logit
            if smoothing > 0:
                chunk_loss -= (smoothing / shard.total) * logit_sum
            if opts.z_loss > 0:
                chunk_loss += opts.z_loss * chunk_lse * chunk_lse
            loss_rows[start:end] = chunk_loss
            lse_rows[start:end] = chunk_lse
        if not need_grads:
            continue

        grad = grad_buf[: end - start]
        ops.grad_logits(
            logits,
            grad,
            target,
            lse_rows[start:end],
            grad_scale=grad_scale,
            row_scale=None if row_scale is None else row_scale[start:end],
            logit_scale=opts.logit_scale,
            softcap=opts.softcap,
            label_smoothing=smoothing,
            vocab_size=shard.total,
            z_loss=opts.z_loss,
        )
        if need_grad_hidden:
            if rows.index is None:
                torch.mm(grad, weight, out=grad_hidden[start:end])
            else:
                grad_hidden.index_copy_(0, rows.index[start:end], torch.mm(grad, weight))
        if need_grad_weight:
            if grad_weight is None:
                grad_weight = torch.empty(weight.shape, dtype=accum_dtype, device=device)
                _matmul_accumulate(grad_weight, grad.t(), h, first=True)
            else:
                _matmul_accumulate(grad_weight, grad.t(), h, first=False)
        if need_grad_bias:
            grad_bias += grad.sum(dim=0, dtype=torch.float32)

    if grad_hidden is not None and opts.reduce_grad_input:
        shard.sum_partial_grad(grad_hidden)
    return ChunkOutputs(
        loss=loss_rows,
        lse=lse_rows,
        grad_hidden=grad_hidden,
        grad_weight=None if grad_weight is None else grad_weight.to(weight.dtype),
        grad_bias=None if grad_bias is None else grad_bias.to(bias.dtype),
    )


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """loss = CE(softcap(logit_scale * (hidden @ W.T + b)), labels) (+ z-loss), chunked.

    Inputs are already validated (see ``loss.fused_lm_loss``): hidden (..., H), weight (V, H) of the
    same dtype, labels shaped like hidden.shape[:-1].
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, opts: LossOptions, scaling: float, num_items):
        hidden2d = hidden.reshape(-1, hidden.shape[-1])
        shard = distributed.Shard.of(weight, opts)
        rows = select_rows(labels.reshape(-1), opts.ignore_index, shard)
        need_grad_hidden, need_grad_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_grad_bias = bias is not None and ctx.needs_input_grad[2]
        need_grads = need_grad_hidden or need_grad_weight or need_grad_bias
        ctx.hidden_shape, ctx.opts, ctx.shard, ctx.rows = hidden.shape, opts, shard, rows

        if opts.reduction == "none":
            # Per-token grad_output is unknown until backward: keep lse, recompute the rest then.
            out = run_chunks(hidden2d, weight, bias, rows, opts, shard)
            if need_grads:
                ctx.lse = out.lse
                ctx.save_for_backward(hidden2d, weight, bias)
            per_token = torch.zeros(labels.numel(), dtype=torch.float32, device=hidden.device)
            if rows.index is None:
                per_token.copy_(out.loss)
            else:
                per_token.index_copy_(0, rows.index, out.loss)
            return per_token.view(labels.shape)

        denominator = 1.0
        if opts.reduction == "mean":
            denominator = float(rows.count if num_items is None else num_items)
            if denominator <= 0 and (rows.count > 0 or denominator < 0):
                raise ValueError(f"num_items_in_batch must be > 0 when tokens carry a loss, got {num_items}")
            denominator = max(denominator, 1.0) if rows.count == 0 else denominator
        out = run_chunks(
            hidden2d,
            weight,
            bias,
            rows,
            opts,
            shard,
            grad_scale=scaling / denominator,
            need_grad_hidden=need_grad_hidden,
            need_grad_weight=need_grad_weight,
            need_grad_bias=need_grad_bias,
        )
        ctx.scaling = scaling
        ctx.grads = (out.grad_hidden, out.grad_weight, out.grad_bias)
        return out.loss.sum() / denominator

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        if ctx.opts.reduction == "none":
            grad_hidden, grad_weight, grad_bias = _recompute_grads(ctx, grad_output)
        else:
            grad_hidden, grad_weight, grad_bias = _rescale_grads(ctx, grad_output)
        if grad_hidden is not None:
            grad_hidden = grad_hidden.view(ctx.hidden_shape)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _rescale_grads(ctx, grad_output: torch.Tensor):
    """Apply grad_output / scaling to the gradients made in forward, never in place (retain_graph)."""
    go = float(grad_output)
    if ctx.scaling == 0.0:
        if go != 0.0:
            raise RuntimeError(
                "the fused loss was computed with scaling=0 (a GradScaler scale of 0?): its gradients are all "
                f"zero and cannot be rescaled to grad_output={go}. Use a non-zero scale."
            )
        return tuple(None if g is None else torch.zeros_like(g) for g in ctx.grads)
    factor = go / ctx.scaling
    if factor == 1.0:
        return ctx.grads
    return tuple(None if g is None else g * factor for g in ctx.grads)


def _recompute_grads(ctx, grad_output: torch.Tensor):
    """reduction="none": rerun the chunk loop with the per-token grad_output as each row's scale."""
    hidden2d, weight, bias = ctx.saved_tensors
    rows = ctx.rows
    per_token = grad_output.reshape(-1)
    row_scale = (per_token if rows.index is None else per_token[rows.index]).float().contiguous()
    out = run_chunks(
        hidden2d,
        weight,
        bias,
        rows,
        ctx.opts,
        ctx.shard,
        lse=ctx.lse,
        row_scale=row_scale,
        need_grad_hidden=ctx.needs_input_grad[0],
        need_grad_weight=ctx.needs_input_grad[1],
        need_grad_bias=bias is not None and ctx.needs_input_grad[2],
    )
    return out.grad_hidden, out.grad_weight, out.grad_bias
