"""The select-rows kernel (Triton, interpreted on CPU) and its PyTorch twin against a plain Python loop."""
import pytest
import torch

from fused_lm_loss import torch_backend

from ..conftest import requires_triton

pytestmark = requires_triton
from fused_lm_loss.kernels import select_rows  # noqa: E402
from fused_lm_loss.kernels.select_rows import BLOCK  # noqa: E402


def _expected(labels, ignore_index):
    """Positions, labels and (count, min, max) of the kept rows, by a Python loop."""
    kept = [(i, y) for i, y in enumerate(labels.tolist()) if y != ignore_index]
    values = [y for _, y in kept]
    summary = [len(kept), min(values), max(values)] if kept else [0, 0, 0]
    return [i for i, _ in kept], values, summary


@pytest.mark.parametrize("n", [1, 37, BLOCK, 2 * BLOCK + 5])
@pytest.mark.parametrize("ignored", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_select_rows_against_python(n, ignored, dtype):
    labels = torch.randint(-3, 50_000, (n,), dtype=dtype)  # a few out-of-range labels: the summary must show them
    labels[torch.rand(n) < ignored] = -100
    want_positions, want_targets, want_summary = _expected(labels, -100)
    for impl in (select_rows, torch_backend.select_rows):
        positions, targets, summary = impl(labels, -100)
        count = summary[0].item()
        assert summary.tolist() == want_summary, impl.__module__
        assert positions[:count].tolist() == want_positions, impl.__module__
        assert targets[:count].tolist() == want_targets, impl.__module__


def test_select_rows_strided_labels_and_other_ignore_index():
    """A non-contiguous view (every second label), ignore_index 0 (a class id elsewhere) and a huge one."""
    base = torch.randint(0, 7, (2 * 3000,))
    labels = base[::2]
    for ignore_index in (0, 2**40):
        want = _expected(labels, ignore_index)
        for impl in (select_rows, torch_backend.select_rows):
            positions, targets, summary = impl(labels, ignore_index)
            count = summary[0].item()
            assert (positions[:count].tolist(), targets[:count].tolist(), summary.tolist()) == want, impl.__module__


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("layout", ["contiguous", "slice", "column", "broadcast_kept", "broadcast_ignored"])
def test_select_rows_any_integer_dtype_and_strides(dtype, layout):
    """Labels of every integer dtype, as any view: a strided slice, a column of a matrix, stride 0 (expand).
    uint8 labels hold 156 = -100 mod 256: PyTorch's `labels != -100` wraps -100 into uint8 and drops them;
    the label is 156, not ignore_index, and must be kept."""
    n = 301
    high = 255 if dtype == torch.uint8 else 127
    base = torch.randint(0, high + 1, (3 * n,), dtype=torch.int64)
    if dtype == torch.uint8:
        base[::5] = 156
    else:
        base[::5] = -100
    base = base.to(dtype)
    if layout == "contiguous":
        labels = base[:n]
    elif layout == "slice":
        labels = base[1::3]
    elif layout == "column":
        labels = base.view(n, 3)[:, 2]
    else:
        value = 7 if layout == "broadcast_kept" else (-100 if dtype != torch.uint8 else 200)
        labels = torch.tensor([value], dtype=dtype).expand(n)
        assert labels.stride() == (0,)
    ignore_index = 200 if layout == "broadcast_ignored" and dtype == torch.uint8 else -100
    want = _expected(labels, ignore_index)
    if dtype == torch.uint8 and layout not in ("broadcast_kept", "broadcast_ignored"):
        assert 156 in want[1]  # the wrapped value is there, and kept
    for impl in (select_rows, torch_backend.select_rows):
        positions, targets, summary = impl(labels, ignore_index)
        count = summary[0].item()
        assert (positions[:count].tolist(), targets[:count].tolist(), summary.tolist()) == want, impl.__module__
        assert positions.dtype == targets.dtype == summary.dtype == torch.int64, impl.__module__
