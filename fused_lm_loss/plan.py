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
Either way the loss holds at most the accumulator + LOGITS_BUDGET_BYTES beyond inputs and gradients, plus
the per-token gradients saved wider than returned until backward rounds them once (``row_grad_dtype``: an
fp32 dX is N x H x 2 bytes over bf16; one set per gradient component of ``token_stats``). Those are a term
of their own, not charged to the budget: charging them split Qwen2.5-7B's batch into two chunks on the H200,
8% slower (benchmarks/NOTES.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .backends import Backend
from .distributed import Shard
from .exp_epilogue import MIN_GRAD_SCALE
from .exp_epilogue import bytes_per_row as exp_epilogue_bytes_per_row
from .loss_terms import LossTerms
from .options import LossOptions
from .transform import LogitTransform

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
    # the loss: z = transform(x), the loss terms over shard.total classes (the gradient's z-loss may differ)
    transform: LogitTransform  # what the head's logits still need (given logits already carry the model's part)
    terms: LossTerms
    grad_terms: LossTerms  # the terms as the gradient sees them (class weights rescale the z-loss: ops.py)
    need_argmax: bool  # the top-1 of each row (token accuracy)
    # rows and chunks
    n_rows: int
    chunk_rows: int
    tile_cols: int  # vocabulary columns per tile: all of this shard's (shard.size) unless tiled (vocab_tiling)
    stats_in_matmul: bool  # forward without gradients: statistics from the matmul epilogue, no logits chunk
    exp_epilogue: bool  # training, sm90: the logits GEMM writes E = exp(z - k) and the statistics (exp_epilogue.py)
    kept_logits: str | None  # the head's kept logits (keep_logits): "store" (forward writes them for backward),
    #                          "reuse" (backward reads them instead of recomputing), None (a logits chunk buffer)
    # buffer dtypes (see the table in chunked.py)
    matmul_dtype: torch.dtype
    logits_dtype: torch.dtype
    grad_input_dtype: torch.dtype  # dX / du rows: wider than matmul_dtype when they are sums rounded once
    accum_dtype: torch.dtype  # dW across chunks; the weight's dtype when there is one chunk (unless saved wide)
    weight_grad_dtype: torch.dtype  # dW as returned: saved wide until backward where the memory allows
    saved_dtype: torch.dtype  # the small per-vocabulary gradients (db, dB), saved until backward rounds them
    split_grad: bool  # fp32 logits from bf16/fp16 operands: G saved as hi + lo
    grad_components: int  # gradients made per chunk (each backpropagated into its own set of gradients)
    # gradient scale: each row's d(loss)/d(logits) is multiplied by grad_scale (times row_scale[i] if given)
    grad_scale: float
    overlap_grad_matmuls: bool  # CUDA: dX on a second stream beside dW

    def chunks(self):
        """(start, end) of each chunk of the selected rows."""
        for start in range(0, self.n_rows, self.chunk_rows):
            yield start, min(start + self.chunk_rows, self.n_rows)

    @property
    def tiled(self) -> bool:
        return self.tile_cols < self.shard.size

    def tiles(self):
        """(start, end) of each tile of the shard's vocabulary columns (only when ``tiled``)."""
        for start in range(0, self.shard.size, self.tile_cols):
            yield start, min(start + self.tile_cols, self.shard.size)


def loss_terms(opts: LossOptions, shard: Shard, device: torch.device) -> LossTerms:
    """The loss terms of a call: the options' smoothing and z-loss over the whole vocabulary, and the class
    weights as the kernels read them ((V_shard,) fp32, contiguous, on ``device``)."""
    class_weight = opts.class_weight
    if class_weight is not None:
        if class_weight.shape != (shard.size,):
            raise ValueError(f"class_weight must have one weight per class: shape ({shard.size},), got "
                             f"{tuple(class_weight.shape)}")
        class_weight = class_weight.to(device=device, dtype=torch.float32).contiguous()
    return LossTerms(label_smoothing=opts.label_smoothing, z_loss=opts.z_loss, vocab_size=shard.total,
                     class_weight=class_weight)


def make_plan(
    opts: LossOptions,
    backend: Backend,
    shard: Shard,
    rows,
    head,
    *,
    needs: GradNeeds = GradNeeds(),
    grad_scale: float = 1.0,
    components: int = 1,
    epilogue_stats: bool = True,
    terms: LossTerms | None = None,
    grad_terms: LossTerms | None = None,
    vocab_tiles: bool = False,
) -> Plan:
    """The plan of one call over the selected ``rows`` (a ``chunked.Rows``: ``count`` of ``total`` tokens, and
    an ``index`` when some were dropped, so that the head gathers the selected ones). ``head`` is a
    ``chunked.LinearHead`` or ``chunked.GivenLogits``: it tells the device, the matmul dtype, the weight whose
    gradient is summed over chunks (``vocab_weight``), the operands of a statistics-epilogue matmul
    (``stats_operands``), whether its logits already carry the model's softcap / scale (``transformed``), the
    bytes its per-chunk row copies take (``row_bytes``), and its kept logits (``kept_logits``: "store", a forward
    that keeps all rows' logits for backward: no logits chunk, no statistics epilogue; "reuse", a backward that
    reads them: each gradient component's G has a buffer of its own, the kept logits are never overwritten, so
    retain_graph stays exact, and a chunk of all rows keeps to the budget: the vocabulary is tiled instead).
    ``components``: gradients the step makes per chunk (when ``needs`` has any); ``epilogue_stats``: whether
    the step's statistics are the loss's, which a no-grad forward may take from the matmul epilogue;
    ``terms``: the loss terms (``loss_terms``; default: none but the vocabulary size); ``grad_terms``: those of
    the gradient when they differ (class weights divide the z-loss by the token count); ``vocab_tiles``: the step
    needs no statistics (a recompute in backward, the row's lse known), so a chunk may cover a tile of the
    vocabulary instead of all of it (``vocab_tiling``).
    """
    device, matmul_dtype, weight = head.device, head.matmul_dtype, head.vocab_weight
    n_rows, has_index = rows.count, rows.index is not None
    terms = terms if terms is not None else LossTerms(vocab_size=shard.total)
    class_weight = terms.class_weight
    kept_logits = head.kept_logits_mode
    logits_dtype = matmul_dtype if head.transformed else (opts.logits_dtype or matmul_dtype)
    components = components if needs.any() else 0
    split_grad = needs.any() and logits_dtype != matmul_dtype
    grad_input_dtype = row_grad_dtype(opts, device, matmul_dtype)
    weight_dtype = matmul_dtype if weight is None else weight.dtype
    accum_dtype = torch.promote_types(opts.accum_dtype or weight_dtype, weight_dtype)
    operands = head.stats_operands
    need_argmax = epilogue_stats and opts.return_token_accuracy and not vocab_tiles  # (a recompute takes no statistics)
    assert not (kept_logits == "store" and components)
    # (not with a process group: whether the epilogue serves depends on this rank's weight, and so would the number
    # of chunks, which every rank must share)
    stats_in_matmul = (
        kept_logits is None and epilogue_stats and not needs.any() and operands is not None and class_weight is None
        and not need_argmax and shard.group is None and backend.supports_stats_in_matmul(*operands)
    )
    transform = opts.transform.without_model_part() if head.transformed else opts.transform
    # the plain loss only: the epilogue applies no bias or transform and sums no logits or class weights, and the
    # top-1 (token accuracy) of E's tiles is not z's. Not for a recompute (vocab_tiles): E must agree with the lse
    # the forward took, and that forward (no gradients) took it from logits rounded to the matmul dtype
    exp_epilogue = (
        needs.any() and epilogue_stats and not vocab_tiles and components == 1 and kept_logits is None
        and operands is not None and head.bias is None and shard.group is None and class_weight is None and not terms.smooths
        and not transform.has_softcap and transform.factor == 1.0 and logits_dtype == matmul_dtype
        and not need_argmax and (grad_scale == 0 or abs(grad_scale) >= MIN_GRAD_SCALE)
        and backend.supports_exp_epilogue(*operands)
    )

    row_bytes = head.row_bytes(has_index, needs, grad_input_dtype)
    # (f h overwrites the gathered rows; without an index the rows are the caller's, and f h takes a buffer)
    epilogue_row_bytes = exp_epilogue_bytes_per_row(
        shard.size, 0 if has_index else operands[0].shape[1] * matmul_dtype.itemsize
    ) if exp_epilogue else 0
    row_bytes += epilogue_row_bytes
    per_logit = bytes_per_logit(backend.name, logits_dtype, matmul_dtype, split_grad)
    wide_dw = needs.weight and weight is not None and saves_weight_grad_wide(
        opts, backend.name, rows.total, shard.chunk_vocab, weight, per_logit
    )
    per_logit += max(components - 1, 0) * matmul_dtype.itemsize  # the earlier components' G buffers
    if kept_logits is not None:  # the logits live in the kept tensor; the last G gets a buffer in their place
        per_logit += (matmul_dtype.itemsize if components and not split_grad else 0) - logits_dtype.itemsize
    if stats_in_matmul:  # chunks bound only the fp32 partials (and the gathered rows)
        bytes_per_row = backend.matmul_partial_bytes_per_row(shard.chunk_vocab) + row_bytes
        max_rows = opts.chunk_size or rows_within(bytes_per_row, LOGITS_BUDGET_BYTES)
    else:
        bytes_per_row = shard.chunk_vocab * per_logit + row_bytes
        accumulates_wide = needs.weight and weight is not None and accum_dtype != weight_dtype
        accumulator_bytes = result_bytes = 0
        weight_elements = shard.chunk_vocab * weight.shape[1] if weight is not None else 0  # (the same on every rank)
        if wide_dw:  # the saved dW holds its extra bytes over the returned dtype: the chunk may take them
            accumulator_bytes = result_bytes = weight_elements * (accum_dtype.itemsize - weight_dtype.itemsize)
        elif accumulates_wide:
            accumulator_bytes = weight_elements * accum_dtype.itemsize
            result_bytes = weight_elements * weight_dtype.itemsize
        # The kept logits already hold N x V: their G takes no chunk of all rows beyond the budget (that chunk
        # would hold the accumulator's or the returned dW's bytes while dW is written), so tiles or chunks
        chunk_extra = (0, 0) if kept_logits == "reuse" else (accumulator_bytes, result_bytes)
        max_rows = max_chunk_rows(n_rows, bytes_per_row, opts.chunk_size, *chunk_extra)
        if exp_epilogue and max_rows < n_rows <= max_chunk_rows(n_rows, bytes_per_row - epilogue_row_bytes,
                                                                 opts.chunk_size, *chunk_extra):
            # The epilogue's per-tile statistics would split a batch that fits one chunk without them, and a second
            # chunk brings the wide dW accumulator and its passes: at Qwen2.5-7B (N = 8192) 1.05-1.06x the floor
            # against 0.98-0.99x in one chunk (RESULTS.md, session 17). Keep the one chunk, and cuBLAS.
            exp_epilogue, max_rows, row_bytes = False, n_rows, row_bytes - epilogue_row_bytes
    chunk_rows = split_rows(n_rows, max_rows)
    tile_cols = shard.size
    # (not with vocab parallelism: every rank's chunks stay those of chunk_vocab, in step with the others)
    if (vocab_tiles and chunk_rows < n_rows and opts.chunk_size is None and not stats_in_matmul and not split_grad
            and not exp_epilogue
            and class_weight is None and components <= 1 and weight is not None and not wide_dw
            and shard.group is None):
        chunk_rows, tile_cols = vocab_tiling(n_rows, shard.size, per_logit, row_bytes, chunk_rows,
                                             accum_dtype.itemsize, weight_dtype.itemsize, result_bytes)
    if chunk_rows >= n_rows and not wide_dw:  # one chunk: dW is one matmul (fp32 inside), rounded once
        accum_dtype = weight_dtype

    return Plan(
        backend=backend,
        shard=shard,
        needs=needs,
        transform=transform,
        terms=terms,
        grad_terms=grad_terms if grad_terms is not None else terms,
        need_argmax=need_argmax,
        n_rows=n_rows,
        chunk_rows=chunk_rows,
        tile_cols=tile_cols,
        stats_in_matmul=stats_in_matmul,
        exp_epilogue=exp_epilogue,
        kept_logits=kept_logits,
        matmul_dtype=matmul_dtype,
        logits_dtype=logits_dtype,
        grad_input_dtype=grad_input_dtype,
        accum_dtype=accum_dtype,
        weight_grad_dtype=accum_dtype if wide_dw else weight_dtype,
        saved_dtype=saved_grad_dtype(opts, matmul_dtype),
        split_grad=split_grad,
        grad_components=components,
        grad_scale=grad_scale,
        overlap_grad_matmuls=device.type == "cuda" and needs.row_inputs and needs.weights,
    )


def saved_grad_dtype(opts: LossOptions, dtype: torch.dtype) -> torch.dtype:
    """The dtype a gradient made in forward is saved in until backward, which applies grad_output / scaling
    and rounds it once to ``dtype``: ``accum_dtype`` where it is wider (fp32 by default)."""
    return torch.promote_types(opts.accum_dtype or dtype, dtype)


def row_grad_dtype(opts: LossOptions, device: torch.device, matmul_dtype: torch.dtype) -> torch.dtype:
    """dtype of the per-token gradients (dX, du) made in forward: saved wide (``saved_grad_dtype``; fp32 for the
    hi + lo sum of fp32 logits) where the matmul writes it directly, so that backward rounds them once
    whatever grad_output is (and vocab shards' partials are summed before that rounding). On CUDA with
    torch < 2.8 (no fp32 output from bf16 operands) the matmul dtype: upcasting W every chunk costs more."""
    if device.type == "cuda" and not HAS_OUT_DTYPE_MM:
        return matmul_dtype
    if opts.logits_dtype not in (None, matmul_dtype):
        return torch.float32
    return saved_grad_dtype(opts, matmul_dtype)


def bytes_per_logit(backend_name: str, logits_dtype: torch.dtype, matmul_dtype: torch.dtype, split_grad: bool) -> int:
    """Chunk bytes per logit: the logits (then G in place; or G as hi + lo beside fp32 logits), and on the
    PyTorch backend its fp32 temporaries."""
    per_logit = logits_dtype.itemsize + (2 * matmul_dtype.itemsize if split_grad else 0)
    return per_logit + (TORCH_BACKEND_TEMP_BYTES if backend_name == "torch" else 0)


def saves_weight_grad_wide(
    opts: LossOptions, backend_name: str, n_tokens: int, chunk_vocab: int, weight: torch.Tensor, per_logit: int
) -> bool:
    """Whether dW is saved in ``accum_dtype`` until backward (rounded once there, whatever grad_output is).

    Decided from shapes alone (the operator's output dtype must not depend on the data): yes when all
    ``n_tokens`` rows, ignored or not, fit in one chunk within LOGITS_BUDGET_BYTES plus what the wide dW
    costs over the weight's dtype. A larger batch keeps the weight's dtype, so that one chunk may still use
    the accumulator's memory (a single dW matmul, rounded once: exact when grad_output / scaling is 1).
    """
    wide = saved_grad_dtype(opts, weight.dtype)
    extra = chunk_vocab * weight.shape[1] * (wide.itemsize - weight.dtype.itemsize)  # (the same on every rank)
    return extra > 0 and n_tokens * chunk_vocab * per_logit <= LOGITS_BUDGET_BYTES + extra


def grad_dtypes(opts: LossOptions, device: torch.device, hidden: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, low_rank_weight: torch.Tensor | None, n_tokens: int,
                chunk_vocab: int, backend_name: str) -> tuple:
    """dtypes of (d hidden, d weight, d bias, d u, d B) as the operators return them (``ops_common`` builds their
    output specs from these): each saved wide until backward rounds it once, dW where the memory allows
    (``saves_weight_grad_wide``)."""
    rows = row_grad_dtype(opts, device, hidden.dtype)
    logits_dtype = opts.logits_dtype or hidden.dtype
    split_grad = logits_dtype != hidden.dtype
    per_logit = bytes_per_logit(backend_name, logits_dtype, hidden.dtype, split_grad)
    wide_dw = saves_weight_grad_wide(opts, backend_name, n_tokens, chunk_vocab, weight, per_logit)
    return (
        rows,
        saved_grad_dtype(opts, weight.dtype) if wide_dw else weight.dtype,
        None if bias is None else saved_grad_dtype(opts, bias.dtype),
        rows,
        None if low_rank_weight is None else saved_grad_dtype(opts, low_rank_weight.dtype),
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


#: The narrowest vocabulary tile ``vocab_tiling`` considers: narrower ones make short-K matmuls.
MIN_TILE_COLS = 1024


def vocab_tiling(n_rows: int, vocab: int, per_logit: int, row_bytes: int, untiled_rows: int, accum_size: int,
                 weight_size: int, result_bytes: int) -> tuple[int, int]:
    """(chunk rows, tile columns) for a step without statistics: the fewest bytes of gradient traffic.

    With whole-vocabulary chunks every chunk reads and writes the V x H dW accumulator; with tiles of the
    vocabulary every tile reads and writes the chunk's dX rows instead. Per element of H (both scale with it)::

        dW:  one row chunk: written once in the weight's dtype; c chunks: 2 c accum_size + the final rounding
        dX:  one tile: written once in fp32; t tiles: 2 t * 4 (summed in fp32 over tiles)

    The candidates: the untiled chunks (``untiled_rows``), and for k = 1, 2, ... row chunks the widest tile the
    budget allows (``LOGITS_BUDGET_BYTES``; with several chunks plus the returned dW's ``result_bytes``, as
    ``max_chunk_rows``; less the chunk's ``row_bytes`` per row). With one row chunk dW needs no accumulator.
    """
    def traffic(rows: int, cols: int) -> int:
        chunks, tiles = -(-n_rows // rows), -(-vocab // cols)
        dw = weight_size if chunks == 1 else 2 * chunks * accum_size + accum_size + weight_size
        dx = 4 if tiles == 1 else 8 * tiles
        return dw * vocab + dx * n_rows

    best = (traffic(untiled_rows, vocab), untiled_rows, vocab)
    for k in range(1, 17):
        rows = split_rows(n_rows, -(-n_rows // k))
        budget = LOGITS_BUDGET_BYTES + (result_bytes if k > 1 else 0)
        cols = min(vocab, (budget - rows * row_bytes) // max(rows * per_logit, 1))
        if cols < MIN_TILE_COLS:
            continue  # (fewer rows per chunk, with more chunks, leave wider tiles)
        cols = split_rows(vocab, cols)  # equal tiles, a multiple of 64 columns where that fits
        candidate = (traffic(rows, cols), rows, cols)
        if candidate[0] < best[0]:
            best = candidate
    return best[1], best[2]


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
