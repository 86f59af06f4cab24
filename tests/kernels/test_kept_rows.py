"""The kept-rows kernel (Triton, interpreted on CPU) and its PyTorch twin against a plain Python loop."""
import pytest
import torch

from fused_lm_loss import torch_backend as torch_path

from ..conftest import requires_triton

pytestmark = requires_triton
from fused_lm_loss.kernels import kept_rows  # noqa: E402
from fused_lm_loss.kernels.kept_rows import BLOCK  # noqa: E402


def _expected(labels, ignore_index):
    """Positions, labels and (count, min, max) of the kept rows, by a Python loop."""
    kept = [(i, y) for i, y in enumerate(labels.tolist()) if y != ignore_index]
    values = [y for _, y in kept]
    summary = [len(kept), min(values), max(values)] if kept else [0, 0, 0]
    return [i for i, _ in kept], values, summary


@pytest.mark.parametrize("n", [1, 37, BLOCK, 2 * BLOCK + 5])
@pytest.mark.parametrize("ignored", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_kept_rows_against_python(n, ignored, dtype):
    labels = torch.randint(-3, 50_000, (n,), dtype=dtype)  # a few out-of-range labels: the summary must show them
    labels[torch.rand(n) < ignored] = -100
    want_positions, want_targets, want_summary = _expected(labels, -100)
    for impl in (kept_rows, torch_path.kept_rows):
        positions, targets, summary = impl(labels, -100)
        count = summary[0].item()
        assert summary.tolist() == want_summary, impl.__module__
        assert positions[:count].tolist() == want_positions, impl.__module__
        assert targets[:count].tolist() == want_targets, impl.__module__


def test_kept_rows_strided_labels_and_other_ignore_index():
    """A non-contiguous view (every second label), ignore_index 0 (a class id elsewhere) and a huge one."""
    base = torch.randint(0, 7, (2 * 3000,))
    labels = base[::2]
    for ignore_index in (0, 2**40):
        want = _expected(labels, ignore_index)
        for impl in (kept_rows, torch_path.kept_rows):
            positions, targets, summary = impl(labels, ignore_index)
            count = summary[0].item()
            assert (positions[:count].tolist(), targets[:count].tolist(), summary.tolist()) == want, impl.__module__
