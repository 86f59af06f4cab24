"""Triton kernel: which token rows carry a loss (their label is not ``ignore_index``), in one launch.

For labels y (n,) and ``ignore_index`` it writes, with K = {i : y_i != ignore_index} in increasing order::

    positions[k] = i_k                 for k < |K|   (the selected rows, compacted; stable order)
    targets[k]   = y_{i_k}
    summary      = (|K|, min_K y, max_K y)           int64; (0, 0, 0) when K is empty

so that the host reads the three summary numbers with one sync and checks the label range, and nothing is
left to launch after it (``chunked.select_rows``). Entries of ``positions`` and ``targets`` from |K| on are not
written.

One launch rather than about ten small PyTorch kernels (compare, where, aminmax, sum, stack, nonzero, gather):
before a step's first matmul the GPU waits for the host to issue them, and each costs the host more than the GPU
(benchmarks/NOTES.md). One program walks the labels BLOCK at a time; the exclusive prefix sum of the
selection flags gives each selected label its slot, which keeps the order deterministic (no atomics). It reads 8
bytes per label: ~10 µs for 8k labels, ~0.1 ms for 128k.
"""
import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _select_rows_kernel(labels_ptr, n, ignore_index, positions_ptr, targets_ptr, summary_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    selected = tl.zeros((), dtype=tl.int64)
    lowest = tl.full((), 2**62, dtype=tl.int64)
    highest = tl.full((), -(2**62), dtype=tl.int64)
    for start in range(0, n, BLOCK):
        rows = start + offsets
        in_range = rows < n
        label = tl.load(labels_ptr + rows, mask=in_range, other=0).to(tl.int64)
        is_selected = (label != ignore_index) & in_range
        flag = is_selected.to(tl.int64)
        slot = selected + tl.cumsum(flag, axis=0) - flag  # exclusive prefix sum: this label's place among them
        tl.store(positions_ptr + slot, rows.to(tl.int64), mask=is_selected)
        tl.store(targets_ptr + slot, label, mask=is_selected)
        selected += tl.sum(flag, axis=0)
        lowest = tl.minimum(lowest, tl.min(tl.where(is_selected, label, 2**62), axis=0))
        highest = tl.maximum(highest, tl.max(tl.where(is_selected, label, -(2**62)), axis=0))
    tl.store(summary_ptr, selected)
    tl.store(summary_ptr + 1, tl.where(selected > 0, lowest, 0))
    tl.store(summary_ptr + 2, tl.where(selected > 0, highest, 0))


def select_rows(labels: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions (n,) int64, targets (n,) int64, summary (3,) int64) for 1-d integer labels; see the module doc."""
    labels, n = labels.contiguous(), labels.numel()
    positions = torch.empty(n, dtype=torch.int64, device=labels.device)
    targets = torch.empty(n, dtype=torch.int64, device=labels.device)
    summary = torch.empty(3, dtype=torch.int64, device=labels.device)
    _select_rows_kernel[(1,)](labels, n, ignore_index, positions, targets, summary, BLOCK=BLOCK, num_warps=4)
    return positions, targets, summary
