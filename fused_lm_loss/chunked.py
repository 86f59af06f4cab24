"""The chunk loop: one implementation for every path (forward, recompute; hidden states or given logits;
the loss or per-token outputs).

Per chunk of selected token rows (those whose label is not ``ignore_index``)::

    logits  = head.logits(chunk)              LinearHead: h_chunk @ W.T (+ b) (+ u @ B.T), cuBLAS;
                                              GivenLogits: the rows of logits that already exist
    step.stats(logits)                        LossStep: loss, lse (online softmax in fp32; vocab-parallel:
                                              merged across shards); TokenStep: log p(label), entropy, lse
    for each gradient component of the step:
        G = d(...)/d(logits)                  fp32 math, stored in the matmul dtype (the last in place)
        head.backprop(G)                      dX[chunk] = G @ W ; dW += G.T @ h ; db += G.sum(0)
                                              (CUDA: dX on a second stream beside dW); or dlogits[chunk] = G

so the N x V logits never exist at once. A recompute in backward, which knows each row's lse, may also tile
the vocabulary (``plan.tiles()``): per (rows, columns) tile the same steps, dX summed over the tiles and each
tile's slice of dW written once when all rows fit one chunk (plan.vocab_tiling). Gradients are produced in
forward (the loss: scaled by ``plan.grad_scale``, times ``row_scale`` per row when recomputing for a per-token
grad_output; per-token outputs: one component per output, weighted per row in backward); ``ops.py`` and
``token_ops.py`` wrap this in PyTorch operators and apply ``grad_output`` in backward. Every decision (chunk
rows, dtypes, backend, transform, loss terms, scale, components) comes from the ``Plan`` (``plan.py``).

Without gradients and on a GPU with TMA, nothing but the loss statistics needs the logits: the logits matmul
reduces each output tile to them in its epilogue (kernels/matmul_stats.py) and no logits chunk exists
(``LossStep.from_matmul``).

Buffers and their precision:
  logits chunk  (chunk_rows, tile_cols)  matmul dtype, or fp32 with ``logits_dtype=torch.float32``
                                        (tile_cols = V_shard unless the vocabulary is tiled)
  kept logits   (N, V_shard)             the logits dtype; only with keep_logits where backward would
                                        recompute (plan.kept_logits): forward writes each chunk's logits
                                        there, backward reads its tiles (never overwritten: retain_graph)
  G chunk       same buffer as logits (overwritten in place; each earlier gradient component of a step
                has a buffer of its own; with kept logits, each has its own). With fp32 logits from bf16/fp16
                operands: two buffers of the matmul dtype holding G = hi + lo (see kernels/grad_logits.py);
                dX = hi @ W + lo @ W on tensor cores sees G to ~16 bits, dW uses hi
  row stats / loss / lse  (rows,)       fp32; partial statistics per (row, vocab segment or tile) fp32
  Hopper path   (plan.exp_epilogue)     the logits chunk holds E = exp(z - k) (bf16) instead, k and its sums
                                        per (row, tile) and the target logit beside it, fp32 (exp_epilogue.py)
  dX            (N, H)                  ``plan.grad_input_dtype``: fp32 by default (saved until backward
                                        rounds it once; summed there over vocabulary tiles and vocab-parallel
                                        shards); the hidden dtype on CUDA with torch < 2.8
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
from .loss_terms import loss_from_stats
from .plan import HAS_OUT_DTYPE_MM, Plan

_side_streams: dict = {}


def label_ids(labels: torch.Tensor) -> torch.Tensor:
    """The one place labels are normalized: 1-d int64, in any strides (a slice, a broadcast).

    Every integer dtype is accepted. Narrower ones are widened first, since torch compares e.g. a uint8
    tensor with a negative ``ignore_index`` modulo 256 (label 156 would count as -100); uint64 values that int64
    cannot hold raise.
    """
    labels = labels.reshape(-1)
    if labels.dtype == torch.uint64 and labels.numel() and bool((labels.view(torch.int64) < 0).any()):
        # (.long() would wrap 2**64 - 100 to -100, ignore_index: that token would be dropped silently)
        raise ValueError("uint64 labels above 2**63 - 1 are not class ids (nor ignore_index)")
    return labels if labels.dtype == torch.int64 else labels.long()


@dataclass
class Rows:
    """The token rows that carry a loss (their label is not ``ignore_index``), selected once per call."""

    index: torch.Tensor | None  # their positions in the flattened batch; None when no label is ignored
    target: torch.Tensor  # contiguous int64: column in this shard's weight, -1 when the class is elsewhere
    count: int  # number of selected rows
    total: int  # number of tokens, ignored ones included

    def gather(self, rows_tensor: torch.Tensor, start: int, end: int) -> torch.Tensor:
        if self.index is None:
            return rows_tensor[start:end]
        return rows_tensor.index_select(0, self.index[start:end])

    def take(self, per_token: torch.Tensor) -> torch.Tensor:
        """(total,) per-token values -> (count,) contiguous values of the selected rows."""
        return (per_token if self.index is None else per_token[self.index]).contiguous()

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """(count,) values of the selected rows -> (total,), zero at ignored positions."""
        if self.index is None:
            return values
        return values.new_zeros(self.total).index_copy_(0, self.index, values)

    def mask(self, device: torch.device) -> torch.Tensor:
        """(total,) bool: True where the row carries a loss."""
        if self.index is None:
            return torch.ones(self.total, dtype=torch.bool, device=device)
        return torch.zeros(self.total, dtype=torch.bool, device=device).index_fill_(0, self.index, True)


def select_rows(labels: torch.Tensor, ignore_index: int, shard: distributed.Shard, backend: Backend) -> Rows:
    """Drop ignored tokens and check every other label is a class id.

    ``labels`` comes from ``label_ids`` (1-d int64, any strides: a slice, a broadcast); the selected labels
    come back as a new contiguous int64 tensor, which is all that any later kernel sees. One host sync (the row
    count sizes the chunks; a bad label must raise here, not in a kernel), after one kernel that finds the rows,
    their labels and the label range (kernels/select_rows.py). With vocab parallelism the ranks then compare
    their layouts, options and labels (``Shard.check_layout``), before any of them raises for a label.
    """
    if labels.numel() == 0:  # (with vocab parallelism, a rank without tokens still compares its layout)
        shard.check_layout(labels, 0, 0, 0)
        return Rows(index=None, target=torch.empty(0, dtype=torch.int64, device=labels.device), count=0, total=0)
    positions, targets, summary = backend.select_rows(labels, ignore_index)
    count, lowest, highest = summary.tolist()
    shard.check_layout(labels, count, lowest, highest)
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
    step: object  # the step, holding its per-row outputs (LossStep: loss, lse; TokenStep: logprob, entropy, ...)
    grads: tuple  # per gradient component, the head's gradients (LinearHead: d hidden, d W, d b, d u, d B)


def run_chunks(plan: Plan, head, rows: Rows, step) -> ChunkOutputs:
    """The chunk loop shared by every path: per chunk the head's logits, the step's statistics, then each of
    the step's gradient components (d(...)/d(logits) of the chunk), which the head backpropagates."""
    if plan.stats_in_matmul:
        return ChunkOutputs(step=step.from_matmul(plan, head, rows), grads=((None,) * 5,))
    assert not (plan.tiled and step.compute), "vocabulary tiles only for a step without statistics"
    head.start(plan, rows)
    for start, end in plan.chunks():
        for cols in plan.tiles() if plan.tiled else (None,):
            _run_chunk(head, rows, step, start, end, cols)
    return ChunkOutputs(step=step, grads=head.finish())


def _run_chunk(head, rows: Rows, step, start: int, end: int, cols: tuple[int, int] | None) -> None:
    # A function of its own so that no view of the chunk buffers outlives the loop: head.finish() frees
    # them before the dW result takes their memory (plan.py). ``cols``: the vocabulary tile, None for all.
    logits = head.logits(start, end, cols)
    if head.exp_stats is not None:  # the Hopper path: E in the logits' place, the statistics beside it
        step.exp_stats = head.exp_stats
    target = rows.target[start:end]
    if cols is not None:  # columns of the tile; -1 where the label is in another tile (as for another shard)
        target = torch.where((target >= cols[0]) & (target < cols[1]), target - cols[0], -1)
    step.stats(logits, target, start, end)
    for k, make_grad in enumerate(step.grads):
        grad, grad_lo = head.grad_buffers(start, end, k)
        make_grad(logits, grad, target, start, end, grad_lo)
        head.backprop(start, end, k)
    if head.exp_stats is not None:  # they end with their chunk: plan.py counts one chunk's, and the next chunk's
        head.exp_stats = step.exp_stats = None  # (or, after the last, the dW result) are allocated after this


class LossStep:
    """The cross-entropy of each row (loss, lse; vocab-parallel: merged across shards) and its gradient,
    scaled by ``plan.grad_scale`` (times ``row_scale[i]``). With ``lse`` given (the recompute of a per-token
    grad_output in backward) the statistics are skipped."""

    def __init__(self, plan: Plan, device: torch.device, *, lse: torch.Tensor | None = None,
                 row_scale: torch.Tensor | None = None) -> None:
        self.plan, self.row_scale, self.compute = plan, row_scale, lse is None
        self.loss = torch.empty(plan.n_rows, dtype=torch.float32, device=device) if self.compute else None
        self.lse = torch.empty(plan.n_rows, dtype=torch.float32, device=device) if self.compute else lse
        self.argmax = torch.empty(plan.n_rows, dtype=torch.int64, device=device) if plan.need_argmax else None
        self.grads = [self._grad] if plan.needs.any() else []
        self.exp_stats = None  # the chunk's exp_epilogue.ExpStats on the Hopper path (plan.exp_epilogue)

    def stats(self, logits: torch.Tensor, target: torch.Tensor, start: int, end: int) -> None:
        if self.compute and self.exp_stats is not None:  # E is not the logits: the epilogue's statistics
            self.plan.backend.merge_exp_stats(self.exp_stats, self.loss[start:end], self.lse[start:end],
                                              terms=self.plan.terms)
        elif self.compute:
            _chunk_losses(self.plan, logits, target, self.loss[start:end], self.lse[start:end])
        if self.argmax is not None:  # token accuracy: a second read of the chunk, only when asked for
            scratch = torch.empty((3, end - start), dtype=torch.float32, device=logits.device)
            self.plan.backend.token_stats(
                logits, target, scratch[0], scratch[1], scratch[2], self.argmax[start:end], transform=self.plan.transform
            )

    def _grad(self, logits, out, target, start, end, out_lo) -> None:
        plan = self.plan
        if self.exp_stats is not None:  # G = f E: E made G's rows up to f in place, f for the head's GEMMs
            assert out.data_ptr() == logits.data_ptr(), "G takes E's place on the Hopper path"
            self.exp_stats.row_factor = plan.backend.grad_from_exp(
                logits, target, self.lse[start:end], self.exp_stats, terms=plan.grad_terms,
                grad_scale=plan.grad_scale, row_scale=None if self.row_scale is None else self.row_scale[start:end],
            )
            return
        plan.backend.grad_logits(
            logits, out, target, self.lse[start:end], transform=plan.transform, terms=plan.grad_terms,
            grad_scale=plan.grad_scale, row_scale=None if self.row_scale is None else self.row_scale[start:end],
            out_lo=out_lo,
        )

    def from_matmul(self, plan: Plan, head: "LinearHead", rows: Rows) -> "LossStep":
        """Loss and lse without gradients: the logits matmul reduces its tiles to row statistics in its
        epilogue (kernels/matmul_stats.py), so no logits exist; chunks only bound the fp32 partials."""
        backend, shard = plan.backend, plan.shard
        for start, end in plan.chunks():
            partial = backend.matmul_partials(
                rows.gather(head.hidden, start, end),
                head.weight,
                head.bias,
                rows.target[start:end],
                logits_dtype=plan.logits_dtype,
                transform=plan.transform,
                need_sum=plan.terms.smooths,
            )
            loss, lse = self.loss[start:end], self.lse[start:end]
            if shard.group is None:
                backend.merge_partials(partial, terms=plan.terms, loss_out=loss, lse_out=lse)
            else:  # vocab-parallel: merge the shards' statistics first
                stats = shard.merge_stats(*backend.merge_partials(partial, terms=plan.terms))
                loss[:], lse[:] = loss_from_stats(*stats, plan.terms)
        return self


class TokenStep:
    """Per-token outputs of each row (log-probability of the label, entropy, lse, and, when asked, the argmax,
    the mean logit and log sum p^2) and gradients of ``sum_i a_i logprob_i + b_i entropy_i``.

    In forward (``weights=None``) it computes the outputs and, for each name in ``components`` ("logprob",
    "entropy"), one gradient component with one weight for every row (``logprob_weight`` for the logprob,
    1 for the entropy), which backward weights per row. In backward
    (``weights=(a, b)`` per selected row, either may be None; the forward's ``lse`` and ``entropy`` given) it skips
    the outputs and makes the one gradient of the weighted sum.
    """

    def __init__(self, plan: Plan, device: torch.device, *, need_argmax: bool = False, need_mean_logit: bool = False,
                 need_log_sum_sq: bool = False, components: tuple = (), logprob_weight: float = 1.0,
                 weights: tuple | None = None, lse: torch.Tensor | None = None,
                 entropy: torch.Tensor | None = None) -> None:
        self.plan, self.compute, self.logprob_weight = plan, weights is None, logprob_weight
        if self.compute:
            n = plan.n_rows

            def buffer(asked: bool = True, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
                return torch.empty(n, dtype=dtype, device=device) if asked else None

            self.logprob, self.entropy, self.lse = buffer(), buffer(), buffer()
            self.argmax = buffer(need_argmax, torch.int64)
            self.mean_logit, self.log_sum_sq = buffer(need_mean_logit), buffer(need_log_sum_sq)
            self.grads = [self._unit_grad(name) for name in components]
        else:
            self.lse, self.entropy, self.weights = lse, entropy, weights
            self.grads = [self._weighted_grad]

    def stats(self, logits: torch.Tensor, target: torch.Tensor, start: int, end: int) -> None:
        if self.compute:
            part = [None if out is None else out[start:end] for out in (self.argmax, self.mean_logit, self.log_sum_sq)]
            self.plan.backend.token_stats(
                logits, target, self.logprob[start:end], self.entropy[start:end], self.lse[start:end], part[0],
                transform=self.plan.transform, mean_logit_out=part[1], log_sum_sq_out=part[2],
            )

    def _unit_grad(self, name: str):
        def make(logits, out, target, start, end, out_lo) -> None:
            value = self.logprob_weight if name == "logprob" else 1.0
            same = torch.full((end - start,), value, dtype=torch.float32, device=logits.device)
            self._token_grad(logits, out, target, start, end, *((same, None) if name == "logprob" else (None, same)))

        return make

    def _weighted_grad(self, logits, out, target, start, end, out_lo) -> None:
        a, b = (None if w is None else w[start:end] for w in self.weights)
        self._token_grad(logits, out, target, start, end, a, b)

    def _token_grad(self, logits, out, target, start, end, grad_logprob, grad_entropy) -> None:
        self.plan.backend.token_grad_logits(
            logits, out, target, self.lse[start:end], self.entropy[start:end], grad_logprob, grad_entropy,
            transform=self.plan.transform,
        )


def _chunk_losses(plan: Plan, logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor, lse: torch.Tensor) -> None:
    """Per-row loss and lse of one chunk, into ``loss`` and ``lse``."""
    if plan.shard.group is None:  # the chunk holds the whole vocabulary
        plan.backend.row_losses(logits, target, loss, lse, transform=plan.transform, terms=plan.terms)
        return
    # vocab-parallel: merge the shards' statistics first (class weights are refused there: options.CONFLICTS)
    stats = plan.backend.row_stats(logits, target, transform=plan.transform, terms=plan.terms)
    loss[:], lse[:] = loss_from_stats(*plan.shard.merge_stats(*stats), plan.terms)


@dataclass(frozen=True)
class KeptLogits:
    """The logits kept from forward for backward (``keep_logits``): (N, V_shard) in the logits dtype, the selected
    rows first. Forward writes each chunk's logits there ("store"); backward reads its tiles ("reuse")."""

    tensor: torch.Tensor
    mode: str  # "store" | "reuse"

    @classmethod
    def of(cls, tensor: torch.Tensor, mode: str) -> "KeptLogits | None":
        """The kept logits in ``tensor`` for ``mode``, or None where the operator keeps none (a (0,) tensor)."""
        return cls(tensor, mode) if tensor.numel() else None


class LinearHead:
    """logits = h @ W.T (+ b) (+ u @ B.T) of the selected rows; gradients for hidden, weight, bias, u and B.

    ``hidden`` (N, H), ``weight`` (V_shard, H), ``low_rank = (u (N, r), B (V_shard, r))`` or None: a LoRA
    adapter on lm_head. ``finish`` returns, per gradient component of the step, (d hidden, d weight, d bias,
    d u, d B), None where not needed.
    """

    def __init__(self, hidden, weight, bias, low_rank, kept_logits: KeptLogits | None = None) -> None:
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.u, self.b = low_rank if low_rank is not None else (None, None)
        self.kept_logits = kept_logits
        self.device, self.matmul_dtype = hidden.device, hidden.dtype

    # what make_plan asks of a head
    transformed = False  # the logits are raw matmul outputs: the plan applies the whole logit transform
    exp_stats = None  # the last chunk's exp_epilogue.ExpStats (plan.exp_epilogue)

    @property
    def kept_logits_mode(self) -> str | None:
        return None if self.kept_logits is None else self.kept_logits.mode

    @property
    def vocab_weight(self) -> torch.Tensor:
        return self.weight

    @property
    def stats_operands(self):
        """(hidden, weight) when the statistics may come from the matmul epilogue (no low-rank term)."""
        return (self.hidden, self.weight) if self.u is None else None

    def row_bytes(self, has_index: bool, needs, grad_input_dtype: torch.dtype) -> int:
        """Per-chunk copies of the selected rows: h (and u) gathered, dX (and du) rows before their scatter."""
        if not has_index:
            return 0
        rank = 0 if self.u is None else self.u.shape[1]
        size = self.matmul_dtype.itemsize * (self.hidden.shape[1] + rank)
        return size + grad_input_dtype.itemsize * (self.hidden.shape[1] * needs.hidden + rank * needs.low_rank_input)

    # the loop
    def start(self, plan: Plan, rows: Rows) -> None:
        self.plan, self.rows = plan, rows
        if plan.kept_logits == "store":  # rows past the selected ones hold no logits: zeros, not uninitialized memory
            self.kept_logits.tensor[rows.count:].zero_()
        self.buffers = _chunk_buffers(
            plan.chunk_rows, plan.tile_cols if plan.tiled else self.weight.shape[0], plan.logits_dtype, plan.matmul_dtype,
            plan.split_grad, plan.grad_components, self.device, logits_elsewhere=plan.kept_logits is not None,
        )
        self.sets = [self._grad_set() for _ in range(plan.grad_components)]
        self.row_parts: dict = {}  # dX / du rows of the chunk while they are summed over vocabulary tiles
        self.side = _side_stream(self.device) if plan.overlap_grad_matmuls else None

    def _grad_set(self) -> dict:
        """One component's gradients: dX / du rows (saved wide), dW / dB accumulators, db in fp32."""
        plan, rows, needs, vocab = self.plan, self.rows, self.plan.needs, self.weight.shape[0]
        return {
            "hidden": _row_grad_buffer(self.hidden, rows, plan.grad_input_dtype) if needs.hidden else None,
            "weight": _Accumulator(self.weight.shape, plan.accum_dtype, self.device) if needs.weight else None,
            "bias": torch.zeros(vocab, dtype=torch.float32, device=self.device) if needs.bias else None,
            "u": _row_grad_buffer(self.u, rows, plan.grad_input_dtype) if needs.low_rank_input else None,
            # B is small (V x r): summed and saved in the wide dtype, so that backward rounds it once
            "b": _Accumulator(self.b.shape, plan.saved_dtype, self.device) if needs.low_rank_weight else None,
        }

    def logits(self, start: int, end: int, cols: tuple[int, int] | None = None) -> torch.Tensor:
        self.cols = cols or (0, self.weight.shape[0])
        first, last = self.cols
        if first == 0:  # the chunk's rows, gathered once for all its tiles
            self.h = self.rows.gather(self.hidden, start, end)
            self.u_rows = None if self.u is None else self.rows.gather(self.u, start, end)
        tile = slice(first, last)
        if self.plan.kept_logits == "reuse":  # kept from forward (the rows of this tile: a strided view)
            return self.kept_logits.tensor[start:end, tile]
        if self.plan.kept_logits == "store":  # all columns: contiguous rows of the kept tensor
            logits = self.kept_logits.tensor[start:end]
        else:
            logits = _view(self.buffers.logits, end - start, last - first)
        if self.plan.exp_epilogue:  # E and the statistics instead of the logits (never tiled, no bias or u)
            self.exp_stats = self.plan.backend.exp_matmul(self.h, self.weight, self.rows.target[start:end], logits)
            return logits
        logits_into(logits, self.h, self.weight[tile], None if self.bias is None else self.bias[tile])
        if self.u is not None:
            matmul_accumulate(logits, self.u_rows, self.b[tile].t(), first=False)
        return logits

    def grad_buffers(self, start: int, end: int, component: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        grad, grad_lo, width = self.buffers.grad[component], self.buffers.grad_lo, self.cols[1] - self.cols[0]
        self.grad = _view(grad, end - start, width)
        self.grad_lo = None if grad_lo is None else _view(grad_lo, end - start, width)
        return self.grad, self.grad_lo

    def backprop(self, start: int, end: int, component: int = 0) -> None:
        grad, side, out = self.grad, self.side, self.sets[component]
        first, last = self.cols
        tile = slice(first, last)
        # dX gets G as hi + lo; dW, summed in fp32 over all rows, is already as exact as torch's with hi alone
        # (benchmarks/NOTES.md), and one GEMM cheaper.
        dx_terms = (grad,) if self.grad_lo is None else (grad, self.grad_lo)
        # the Hopper path: G = f E with one factor per row (grad_from_exp.py), so dX = f (E @ W), dW = E^T (f h)
        row_factor = None if self.exp_stats is None else self.exp_stats.row_factor
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for name, vocab_operand in (("hidden", self.weight), ("u", self.b)):
                if out[name] is not None:
                    self._store_rows(out[name], (component, name), start, end, dx_terms, vocab_operand[tile],
                                     row_factor)
        if out["weight"] is not None:
            h = self.h
            if row_factor is not None:  # f h over the gathered rows (read only here), else in a buffer of its own
                h = torch.mul(h, row_factor[:, None], out=h if self.rows.index is not None else torch.empty_like(h))
            out["weight"].add(grad.t(), h, first=start == 0, rows=tile)
        if out["b"] is not None:
            out["b"].add(grad.t(), self.u_rows, first=start == 0, rows=tile)
        if out["bias"] is not None:
            out["bias"][tile] += grad.sum(dim=0, dtype=torch.float32)
        if side is not None:  # the next component, tile or chunk overwrites G
            torch.cuda.current_stream(self.device).wait_stream(side)

    def _store_rows(self, out: torch.Tensor, key: tuple, start: int, end: int, grad_terms: tuple,
                    vocab_operand: torch.Tensor, row_factor: torch.Tensor | None = None) -> None:
        """out[chunk rows] (+)= sum(G_k @ vocab_operand) for this tile's columns: written by the first tile,
        summed over the others; with dropped rows built in a buffer of the chunk's rows, scattered after the
        last tile. ``out`` may be wider (fp32) than the G terms and the operand. ``row_factor`` (one tile only):
        G is row_factor[:, None] * grad_terms[0], applied to the product's rows (in ``out``'s dtype)."""
        first_tile, last_tile = self.cols[0] == 0, self.cols[1] == self.weight.shape[0]
        if self.rows.index is None:
            part = out[start:end]
        elif first_tile:
            part = self.row_parts[key] = torch.empty((end - start, out.shape[1]), dtype=out.dtype, device=out.device)
        else:
            part = self.row_parts[key]
        for k, term in enumerate(grad_terms):
            matmul_accumulate(part, term, vocab_operand, first=first_tile and k == 0)
        if row_factor is not None:
            assert first_tile and last_tile and len(grad_terms) == 1
            part.mul_(row_factor[:, None])
        if self.rows.index is not None and last_tile:
            out.index_copy_(0, self.rows.index[start:end], part)
            del self.row_parts[key]

    def finish(self) -> tuple:
        # Free the chunk buffers first: with several chunks the dW result takes their memory (plan.py).
        self.buffers = self.h = self.u_rows = self.grad = self.grad_lo = self.row_parts = None
        plan = self.plan
        results = []
        for out in self.sets:  # rounded to the inputs' dtypes in backward, after grad_output / scaling (ops.py)
            rows_grads = (None if out[k] is None else plan.shard.sum_partial_grad(out[k]) for k in ("hidden", "u"))
            grad_hidden, grad_u = rows_grads
            results.append((
                grad_hidden,
                None if out["weight"] is None else out["weight"].result(plan.weight_grad_dtype),
                None if out["bias"] is None else out["bias"].to(plan.saved_dtype),
                grad_u,
                None if out["b"] is None else out["b"].result(plan.saved_dtype),
            ))
        self.sets = None
        return tuple(results) or ((None,) * 5,)  # no gradient asked for


class GivenLogits:
    """The logits already exist (transformers' loss signature): read their rows, write d(loss)/d(logits).

    ``logits`` (N, V) already carry the model's softcap / scale. ``finish`` returns ((d logits,),) or ((None,),).
    """

    def __init__(self, logits: torch.Tensor) -> None:
        self.given, self.device, self.matmul_dtype = logits, logits.device, logits.dtype
        self.vocab_weight = self.stats_operands = self.kept_logits_mode = self.exp_stats = None

    # the logits already carry the model's softcap / scale (the plan applies only the temperature); their dtype
    # is the logits dtype
    transformed = True

    def row_bytes(self, has_index: bool, needs, grad_input_dtype: torch.dtype) -> int:
        return 0  # the chunk buffer (gathered rows, then G in place) is the logits buffer of the plan

    def start(self, plan: Plan, rows: Rows) -> None:
        assert plan.grad_components <= 1, "one gradient component on given logits"
        self.plan, self.rows = plan, rows
        contiguous_rows = self.given.stride(1) == 1
        self.buffer = None
        if rows.index is not None or not contiguous_rows:
            self.buffer = torch.empty((plan.chunk_rows, self.given.shape[1]), dtype=self.matmul_dtype, device=self.device)
        self.grad_logits = None
        if plan.needs.any():
            alloc = torch.empty if rows.index is None else torch.zeros  # ignored rows: zero gradient
            self.grad_logits = alloc(self.given.shape, dtype=self.matmul_dtype, device=self.device)

    def logits(self, start: int, end: int, cols: None = None) -> torch.Tensor:
        if self.buffer is None:
            return self.given[start:end]
        out = self.buffer[: end - start]
        if self.rows.index is None:
            out.copy_(self.given[start:end])
        else:
            torch.index_select(self.given, 0, self.rows.index[start:end], out=out)
        return out

    def grad_buffers(self, start: int, end: int, component: int = 0) -> tuple[torch.Tensor, None]:
        if self.rows.index is None:
            return self.grad_logits[start:end], None  # G straight into the result
        return self.buffer[: end - start], None  # in place over the gathered rows, scattered in backprop

    def backprop(self, start: int, end: int, component: int = 0) -> None:
        if self.rows.index is not None:
            self.grad_logits.index_copy_(0, self.rows.index[start:end], self.buffer[: end - start])

    def finish(self) -> tuple:
        self.buffer = None
        return ((self.grad_logits,),)


def _side_stream(device: torch.device):
    """A second CUDA stream for G @ W: with few rows it has few output tiles, and fills the GPU only beside
    the large G.T @ h running on the main stream."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def logits_into(out: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out = h @ W.T (+ b); ``out`` may be fp32 while h and W are bf16/fp16 (fp32 logits)."""
    if out.dtype == h.dtype:
        if bias is None:
            torch.mm(h, weight.t(), out=out)
        else:
            torch.addmm(bias, h, weight.t(), out=out)
        return
    matmul_accumulate(out, h, weight.t(), first=True)
    if bias is not None:
        out += bias


def matmul_accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, first: bool) -> None:
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


@dataclass
class ChunkBuffers:
    """Flat buffers with room for (chunk rows, tile columns) each; ``_view`` gives a chunk's (rows, cols)."""

    logits: torch.Tensor | None  # in the logits dtype; None when they are kept elsewhere (plan.kept_logits)
    grad: list  # per gradient component, in the matmul dtype; the last one in place of the logits
    grad_lo: torch.Tensor | None  # with fp32 logits from bf16/fp16 operands, G = hi + lo: lo's buffer


def _view(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A contiguous (rows, cols) view of the start of a flat chunk buffer (cuBLAS writes it with out=)."""
    return flat[: rows * cols].view(rows, cols)


def _chunk_buffers(
    rows: int, vocab: int, logits_dtype: torch.dtype, mm_dtype: torch.dtype, split_grad: bool, components: int,
    device: torch.device, logits_elsewhere: bool = False,
) -> ChunkBuffers:
    """The chunk's logits and gradient buffers. The last gradient component overwrites the logits in place
    (each earlier one, read from the same logits, has a buffer of its own), except with fp32 logits from
    bf16/fp16 operands, where G = hi + lo gets two buffers of its own. ``logits_elsewhere`` (kept for or from
    backward): no logits buffer, and every component's G has its own. They are carved from one allocation
    (each part 256-byte aligned for cuBLAS), so that what they free after the loop is one block."""
    assert not (split_grad and components > 1), "fp32 logits with one gradient component"
    if logits_elsewhere:
        parts = [mm_dtype] * (2 if split_grad else components)
    else:
        parts = [logits_dtype] + [mm_dtype] * max(components - 1, 0) + ([mm_dtype, mm_dtype] if split_grad else [])
    sizes = [-(-rows * vocab * dtype.itemsize // 256) * 256 for dtype in parts]
    flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    views, offset = [], 0
    for dtype, size in zip(parts, sizes):
        views.append(flat[offset : offset + rows * vocab * dtype.itemsize].view(dtype))
        offset += size
    if logits_elsewhere:
        return ChunkBuffers(logits=None, grad=views[:1] if split_grad else views, grad_lo=views[1] if split_grad else None)
    if split_grad:
        return ChunkBuffers(logits=views[0], grad=[views[1]], grad_lo=views[2])
    return ChunkBuffers(logits=views[0], grad=views[1:] + [views[0]], grad_lo=None)


def _row_grad_buffer(like: torch.Tensor, rows: Rows, dtype: torch.dtype) -> torch.Tensor:
    """Gradient of a per-token input: rows that carry no loss stay zero."""
    alloc = torch.empty if rows.index is None else torch.zeros
    return alloc(like.shape, dtype=dtype, device=like.device)


class _Accumulator:
    """A weight gradient summed over chunks in ``dtype``; the first chunk writes (each tile's rows) instead of
    adding."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self.total: torch.Tensor | None = None

    def add(self, a: torch.Tensor, b: torch.Tensor, *, first: bool, rows: slice = slice(None)) -> None:
        """total[rows] = a @ b (``first``: the first chunk) or += a @ b; ``rows``: a vocabulary tile's rows."""
        if self.total is None:
            self.total = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        matmul_accumulate(self.total[rows], a, b, first=first)

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        """The sum in ``dtype`` (the accumulator itself when it already has that dtype)."""
        if self.total is None:  # no token carried a loss
            return torch.zeros(self.shape, dtype=dtype, device=self.device)
        return self.total.to(dtype)
