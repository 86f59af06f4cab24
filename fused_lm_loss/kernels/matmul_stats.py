"""Triton kernel: the logits matmul with the row statistics in its epilogue (forward without gradients).

Without gradients nothing needs the logits except the softmax statistics, so this kernel never writes
them. Each output tile x = h[rows] @ W[cols].T (+ b[cols]) is formed in fp32 on the tensor cores and
reduced in registers to the per-(row, tile) partials of ``row_stats``::

    z = transform(x)                            x first rounded to the logits dtype, as a stored chunk
    m = max_j z_j     s = sum_j exp(z_j - m)     sum = sum_j z_j (label smoothing)     z_t (tile holding t)

written as partial[k, tile_n, row] (k = max, sum-exp, target logit, sum; the target logit only into
segment 0's slot, by the one tile that holds it). The merge kernel of ``row_stats`` then gives loss and
lse (or the four statistics, for a vocab-parallel merge): ``merge_partials``.

The matmul is a persistent kernel (one program per SM walking the output tiles) that loads its operands
through TMA tensor descriptors, with the tile and K loops flattened so that the next tile's loads are in
flight during the epilogue. Tiles are visited vocabulary block by vocabulary block, all row tiles of a
block in a row: each W block is read from HBM once while the hidden rows stay in L2. On the H200 this
matmul runs within 0-6% of cuBLAS; the epilogue is not overlapped with the tensor cores, so it is kept to
a few ALU instructions per element (see the comment there). The forward without gradients then costs
1.00-1.07x one cuBLAS matmul of the full batch (10% ignored rows), against 0.97-1.20x for cuBLAS + the
stats kernel reading the logits back: a gain at small H (Qwen2.5-0.5B), equal at H >= 3584
(benchmarks/NOTES.md).

Needs a GPU with TMA (sm90+), bf16/fp16 operands with 16-byte aligned rows, and a Triton with host
tensor descriptors; ``supported`` says whether the inputs qualify, else the chunk loop keeps the
cuBLAS + ``row_stats`` path.
"""
import inspect
import os

import torch
import triton
import triton.language as tl

from ..transform import LogitTransform
from .args import check_target
from .online import LOG2E
from .transform import loss_space, transform_scalars

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # triton < 3.3
    TensorDescriptor = None

_HAS_FLATTEN = "flatten" in inspect.signature(tl.range.__init__).parameters
BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, NUM_WARPS = 128, 256, 64, 3, 8  # the best of 8 configs on the H200 (v11)


@triton.jit
def _matmul_stats_kernel(
    h_desc,
    w_desc,
    bias_ptr,
    target_ptr,
    partial_ptr,
    n_rows,
    n_cols,
    hidden_size,
    factor,
    u_per_x,
    cap,
    HAS_BIAS: tl.constexpr,
    HAS_FACTOR: tl.constexpr,
    ROUND_TO_BF16: tl.constexpr,
    ROUND_TO_FP16: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    NEED_SUM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    factor, u_per_x, cap = transform_scalars(factor, u_per_x, cap)
    tiles_m = tl.cdiv(n_rows, BLOCK_M)
    tiles_n = tl.cdiv(n_cols, BLOCK_N)
    k_steps = tl.cdiv(hidden_size, BLOCK_K)
    segment_stride = n_rows  # partial is (4, tiles_n, n_rows)
    stat_stride = tiles_n * n_rows
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS, flatten=True):
        tile_m = tile % tiles_m
        tile_n = tile // tiles_m
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_steps):
            h = h_desc.load([tile_m * BLOCK_M, k * BLOCK_K])
            w = w_desc.load([tile_n * BLOCK_N, k * BLOCK_K])
            acc = tl.dot(h, w.T, acc)

        # Epilogue, in ALU instructions per element (it is not overlapped with the tensor cores, so each one
        # costs ~1% of the matmul at K = 896): no multiply when the factor is 1, the column mask only in the last
        # vocabulary tile, the target compare only in tiles that hold some row's target, exp2 with one FFMA.
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n_rows
        z = acc
        if HAS_BIAS:
            z += tl.load(bias_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
        if ROUND_TO_BF16:  # the logits as the matmul would have stored them
            z = z.to(tl.bfloat16).to(tl.float32)
        if ROUND_TO_FP16:
            z = z.to(tl.float16).to(tl.float32)
        z, _ = loss_space(z, factor, u_per_x, cap, HAS_SOFTCAP, HAS_FACTOR)
        target = tl.load(target_ptr + rows, mask=row_ok, other=-1).to(tl.int32) - tile_n * BLOCK_N
        has_target = row_ok & (target >= 0) & (target < BLOCK_N)
        if tl.sum(has_target.to(tl.int32), axis=0) > 0:
            z_target = tl.sum(tl.where(tl.arange(0, BLOCK_N)[None, :] == target[:, None], z, 0.0), axis=1)
            tl.store(partial_ptr + 2 * stat_stride + rows, z_target, mask=has_target)
        out = partial_ptr + tile_n * segment_stride + rows
        if tile_n * BLOCK_N + BLOCK_N > n_cols:  # the last vocabulary tile: no columns past V
            col_ok = cols < n_cols
            if NEED_SUM:
                tl.store(out + 3 * stat_stride, tl.sum(tl.where(col_ok[None, :], z, 0.0), axis=1), mask=row_ok)
            z = tl.where(col_ok[None, :], z, float("-inf"))
        elif NEED_SUM:
            tl.store(out + 3 * stat_stride, tl.sum(z, axis=1), mask=row_ok)
        tile_max = tl.max(z, axis=1)
        # A row whose tile is all -inf (e.g. a -inf bias) subtracts 0, not -inf (-inf - -inf = NaN): sum-exp 0.
        # One select per row of the tile, nothing per element.
        shift = tl.where(tile_max == float("-inf"), 0.0, tile_max) * LOG2E
        tile_sumexp = tl.sum(tl.exp2(z * LOG2E - shift[:, None]), axis=1)
        tl.store(out, tile_max, mask=row_ok)
        tl.store(out + stat_stride, tile_sumexp, mask=row_ok)


def supported(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``matmul_partials`` can run on these operands (else: cuBLAS logits + ``row_stats``)."""
    if TensorDescriptor is None or not _HAS_FLATTEN or hidden.dtype != weight.dtype or hidden.shape[1] == 0:
        return False  # (no hidden columns: no tiles to load; the logits are the bias, made by the cuBLAS path)
    if hidden.is_cuda:
        if torch.cuda.get_device_capability(hidden.device)[0] < 9 or hidden.dtype not in (torch.bfloat16, torch.float16):
            return False
    elif os.environ.get("TRITON_INTERPRET") != "1" or hidden.dtype != torch.float16:
        return False  # the interpreter computes bf16 dots of TMA-loaded tiles wrongly (triton 3.9)
    return all(
        t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
        for t in (hidden, weight)
    )


def matmul_partials(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    *,
    logits_dtype: torch.dtype,
    transform: LogitTransform,
    need_sum: bool,
) -> torch.Tensor:
    """The (4, tiles, rows) fp32 partials of logits = hidden @ weight.T (+ bias), without writing the logits.

    ``logits_dtype``: the precision the logits would have been stored in (the matmul dtype, or fp32);
    the statistics are taken of the logits rounded to it, so the loss equals the stored-logits path's.
    """
    rows, hidden_size = hidden.shape
    vocab = weight.shape[0]
    check_target(target, rows, hidden.device, "matmul_partials")
    tiles_n = triton.cdiv(vocab, BLOCK_N)
    partial = torch.empty((4, tiles_n, rows), dtype=torch.float32, device=hidden.device)
    if rows == 0:
        return partial
    partial[2, 0].zero_()  # target logits: written only by the tile holding the target
    programs = min(_processors(hidden.device), triton.cdiv(rows, BLOCK_M) * tiles_n)
    _matmul_stats_kernel[(programs,)](
        TensorDescriptor.from_tensor(hidden, [BLOCK_M, BLOCK_K]),
        TensorDescriptor.from_tensor(weight, [BLOCK_N, BLOCK_K]),
        bias if bias is not None else partial,
        target,
        partial,
        rows,
        vocab,
        hidden_size,
        *transform.kernel_args(),
        **transform.kernel_flags(),
        HAS_BIAS=bias is not None,
        ROUND_TO_BF16=logits_dtype == torch.bfloat16,
        ROUND_TO_FP16=logits_dtype == torch.float16,
        NEED_SUM=need_sum,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        NUM_PROGRAMS=programs,
        num_stages=NUM_STAGES,
        num_warps=NUM_WARPS,
    )
    return partial


def partial_bytes_per_row(vocab: int) -> int:
    """fp32 partials per row: 4 per vocabulary tile."""
    return 16 * triton.cdiv(vocab, BLOCK_N)


def _processors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, so that each walks several tiles
    return torch.cuda.get_device_properties(device).multi_processor_count


__all__ = ["matmul_partials", "partial_bytes_per_row", "supported"]
