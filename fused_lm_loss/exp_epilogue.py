"""The Hopper path: the logits GEMM's epilogue stores E = exp(z - k) and the row statistics from the fp32 accumulator.

Today's chunk rounds every logit to bf16 (the cuBLAS output), reads the chunk back for the softmax statistics and
again for the gradient, so G carries the rounding of z (relative error ~6e-3 against float64 on realistic
logits). On sm90 with the optional extra ``fused-lm-loss[hopper]`` (quack-kernels, NVIDIA CuTe DSL) the logits
GEMM of a training chunk instead writes, per row i and tile t of ``tile_n`` columns (kernels/exp_gemm.py)::

    c_i  = floor(log2e z_i,target)                  before the GEMM, from one row of h and of W (kernels/row_offset.py)
    k_it = max(c_i, round(log2e max_{j in t} z_ij) - HEADROOM)     an integer: 2^k rescales E exactly
    E_ij = bf16(2^(log2e z_ij - k_it))              in place of the logits chunk (same bytes)
    s_it = sum_{j in t} 2^(log2e z_ij - k_it)       fp32
    z_i,target                                      fp32, the accumulator's own value

so that lse_i = ln2 k_i* + log(sum_t s_it 2^(k_it - k_i*)) with k_i* = max_t k_it (the backend's ``merge_exp_stats``,
one launch) and p_ij = E_ij 2^(k_it - log2e lse_i). A target logit is never above its row's max, so c_i keeps the
row's large values clear of underflow, and HEADROOM bounds E above. Where no tile's max is more than HEADROOM above
c_i (the target within ~44 nats of the row's max: every realistic row) every k_it is c_i: the row's E share one
offset and G_i = f_i E_i with one factor per row, so no pass over the chunk forms G: ``grad_from_exp`` writes f and
the target column (and moves the rare rows with tiles of their own to one offset), and the gradient GEMMs take E
with f on their small side: dX = f (E @ W), dW = E^T (f h) (chunked.py). The gradient is then as exact as E's one
rounding (and f h's, for dW). Measured on the H200 with per-tile offsets and a G pass (benchmarks/NOTES.md,
session 14): G 10x closer to float64 (6.4e-4 against 6.4e-3), lse 3e-6 against 5e-4, dX / dW 2.4-2.9e-3 against
6.9-7.5e-3 for the whole step.

The plan takes this path (``plan.exp_epilogue``) for a training step of the plain loss: no bias, softcap, logit
scale / temperature, label smoothing or class weights, no vocab-parallel shards, no LoRA term on the head, bf16
operands, a vocabulary that 192 or 128 divides, a gradient scale of at least ``MIN_GRAD_SCALE`` (or 0), and not where
the per-tile statistics (``bytes_per_row``) would split a batch that fits one chunk without them (a second chunk
brings the wide dW accumulator: that cost Qwen2.5-7B 6%); everything else keeps cuBLAS + ``row_stats``. On CPU
(tests) the same algorithm runs in PyTorch (``exp_matmul_reference``).

Buffers: E (chunk rows, V) bf16 in the logits chunk's place; k and s (chunk rows, V / tile_n) fp32 (k an integer
exponent, fp32 as the epilogue writes it); c, the target logit and f (chunk rows,) fp32; f h (chunk rows, H) in the
matmul dtype, in the gathered rows' place where there are any (``bytes_per_row``).
"""
from __future__ import annotations

import functools
import importlib.metadata
import math
import warnings
from dataclasses import dataclass

import torch

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2
# How far above a row's shared offset a tile's max may be before the tile takes its own (log2 units, kernels/exp_gemm.py):
# E <= 2^64.5 and a row's sum <= V 2^64.5 stay far inside bf16 / fp32 range, also through the dX GEMM's sums
HEADROOM = 64.0
# The smallest |gradient scale| the path serves. A row's factor f (kernels/grad_from_exp.py) is at least 2^-82 s: K, the
# row's offset, is within HEADROOM + 1/2 of its top tile's exponent, which is within log2 V (<= 18) of log2e lse. So f
# stays a normal fp32 for |s| >= 2^-44; below it (no realistic loss weight) f would lose bits or flush to 0 and drop
# the row's gradient: cuBLAS + row_stats serve instead
MIN_GRAD_SCALE = 2.0**-44
# the epilogue's column tiles, the widest that divides V: both run the pingpong schedule (<= 208 columns), which
# beat the cooperative one in every measured case (Gemma-2-2B: 128 columns pingpong 0.92x cuBLAS + stats, 256
# cooperative 1.00-1.02x; benchmarks/NOTES.md). Only the widths the GPU tests ran: another V keeps cuBLAS
TILE_WIDTHS = (192, 128)
QUACK_VERSION = "0.6.5"  # the pinned, tested versions of the [hopper] extra
CUTLASS_DSL_VERSION = "4.8.1"


@dataclass
class ExpStats:
    """What the epilogue writes besides E, for one chunk: k and s (rows, tiles) fp32, the target logit (rows,)."""

    k: torch.Tensor
    sum_exp: torch.Tensor
    target_logit: torch.Tensor
    tile_n: int
    row_factor: torch.Tensor | None = None  # (rows,) fp32 f, set by the gradient step: G = f[:, None] * E


def tile_width(vocab: int) -> int | None:
    return next((t for t in TILE_WIDTHS if vocab % t == 0), None)


def bytes_per_row(vocab: int, scaled_rows_bytes: int) -> int:
    """The path's memory per chunk row besides E: k and s per tile, c, the target logit and f (fp32), and
    ``scaled_rows_bytes`` for f h where it does not overwrite the gathered rows."""
    tiles = vocab // (tile_width(vocab) or 1)
    return 4 * (2 * tiles + 3) + scaled_rows_bytes


@functools.lru_cache(maxsize=None)
def _quack_epilogue():
    """Quack's E-storing GEMM epilogue, or None where quack-kernels / the CuTe DSL are missing or are not the
    tested versions (said once, with a warning: the chunk loop then keeps cuBLAS + row_stats)."""
    try:
        installed = (importlib.metadata.version("quack-kernels"), importlib.metadata.version("nvidia-cutlass-dsl"))
    except importlib.metadata.PackageNotFoundError:
        return None
    if installed != (QUACK_VERSION, CUTLASS_DSL_VERSION):
        warnings.warn(f"fused_lm_loss: the Hopper path was tested with quack-kernels {QUACK_VERSION} and "
                      f"nvidia-cutlass-dsl {CUTLASS_DSL_VERSION}, found {installed[0]} and {installed[1]}: not used "
                      "(pip install 'fused-lm-loss[hopper]' installs the tested ones)", stacklevel=2)
        return None
    try:
        from .kernels.exp_gemm import shared_offset_exp
    except Exception as e:  # noqa: BLE001 - any import failure: the extra is not usable here
        warnings.warn(f"fused_lm_loss: the Hopper path is not used: quack-kernels does not import "
                      f"({type(e).__name__}: {str(e)[:200]})", stacklevel=2)
        return None
    return shared_offset_exp


def supported(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the GPU path can serve these operands: sm90, bf16, contiguous rows, the [hopper] extra installed; a
    hidden size that 8 divides (16-byte rows for TMA) and not 0 (an empty K loop never ran on the GPU)."""
    return (
        hidden.is_cuda and weight.is_cuda and hidden.dtype == weight.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(hidden.device) == (9, 0)
        and weight.is_contiguous() and weight.data_ptr() % 32 == 0
        and hidden.shape[1] > 0 and hidden.shape[1] % 8 == 0
        and tile_width(weight.shape[0]) is not None and _quack_epilogue() is not None
    )


def exp_matmul(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, e_out: torch.Tensor) -> ExpStats:
    """E of ``hidden @ weight.T`` into ``e_out`` (rows, V) and the chunk's ExpStats, on the GPU (CuTe DSL)."""
    from .kernels.row_offset import row_offset

    rows, vocab = e_out.shape
    tile_n = tile_width(vocab)
    stats = _empty_stats(rows, vocab, tile_n, hidden.device)
    hidden, target = _aligned(hidden), _aligned(target)
    offset = row_offset(hidden, weight, target)
    _quack_epilogue().gemm(
        hidden, weight, e_out,
        epi_args=dict(max_log2=tile_n, row_k=offset, sum_exp=stats.sum_exp, max_log2_out=stats.k, target=target,
                      target_logit=stats.target_logit),
        tile_M=128, tile_N=tile_n, cluster_M=2, cluster_N=1, pingpong=True,
    )
    _tile_offsets(stats.k, offset)
    return stats


def _tile_offsets(tile_max: torch.Tensor, offset: torch.Tensor) -> None:
    """The epilogue's k_it from the tiles' own exponents (written as the GEMM's ``max_log2_out``), in place: the same
    fp32 integer arithmetic as its fmax (kernels/exp_gemm.py)."""
    torch.maximum(tile_max.sub_(HEADROOM), offset[:, None], out=tile_max)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy where its data is not 32-byte aligned (the GEMM's operands and vectors must be:
    a chunk's slice of the rows or labels starts anywhere)."""
    return t if t.is_contiguous() and t.data_ptr() % 32 == 0 else t.clone(memory_format=torch.contiguous_format)


def exp_matmul_reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         e_out: torch.Tensor) -> ExpStats:
    """The same outputs in PyTorch (CPU tests): z in fp32 from the bf16 / fp16 operands, as the tensor cores form it."""
    from .kernels.row_offset import row_offset_reference

    rows, vocab = e_out.shape
    tile_n = tile_width(vocab)
    stats = _empty_stats(rows, vocab, tile_n, hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):  # (the op's body runs under the caller's autocast)
        z = (hidden.float() @ weight.float().t()).view(rows, -1, tile_n)
        offset = row_offset_reference(hidden, weight, target)
    stats.k.copy_(torch.round(z.amax(2) * LOG2E))
    _tile_offsets(stats.k, offset)
    e = torch.exp2(z * LOG2E - stats.k[:, :, None])
    stats.sum_exp.copy_(e.sum(2))
    e_out.copy_(e.view(rows, vocab))
    stats.target_logit.copy_(z.view(rows, vocab).gather(1, target.clamp(min=0)[:, None]).squeeze(1))
    return stats


def _empty_stats(rows: int, vocab: int, tile_n: int, device: torch.device) -> ExpStats:
    tiles = vocab // tile_n
    return ExpStats(
        k=torch.empty((rows, tiles), dtype=torch.float32, device=device),
        sum_exp=torch.empty((rows, tiles), dtype=torch.float32, device=device),
        target_logit=torch.empty(rows, dtype=torch.float32, device=device),
        tile_n=tile_n,
    )
