"""The one-launch row losses + logits gradient kernel (Triton, interpreted on CPU) and its PyTorch twin,
against float64 autograd on the loss formula."""
import importlib

import pytest
import torch

from fused_lm_loss import torch_path

from ..conftest import requires_triton
from ..reference import rel_err

pytestmark = requires_triton
from fused_lm_loss.kernels import losses_and_grad  # noqa: E402

row_stats_module = importlib.import_module("fused_lm_loss.kernels.row_stats")


def _expected(logits, target, grad_scale, *, logit_scale, softcap, smoothing, z_loss):
    """Per-row loss and lse, and d(grad_scale * sum_i loss_i)/d(logits), in float64."""
    x = logits.double().requires_grad_(True)
    z = x * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    lse = torch.logsumexp(z, 1)
    loss = lse - (1 - smoothing) * z.gather(1, target[:, None]).squeeze(1) - smoothing / z.shape[1] * z.sum(1)
    loss = loss + z_loss * lse**2
    (loss.sum() * grad_scale).backward()
    return loss.detach(), lse.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("smoothing, z_loss", [(0.0, 0.0), (0.1, 1e-3)])
@pytest.mark.parametrize("segment_cols", [None, 256])  # None: the default (one segment here); 256: 5 segments
@pytest.mark.parametrize("rows_per_group", [1, 4])  # 11 rows: the last group is partial
def test_losses_and_grad_against_float64(dtype, softcap, smoothing, z_loss, segment_cols, rows_per_group, monkeypatch):
    if segment_cols is not None:
        monkeypatch.setattr(row_stats_module, "SEGMENT_COLS", segment_cols)
    rows, vocab = 11, 1100
    logits = (torch.randn(rows, vocab) * 4).to(dtype)
    target = torch.randint(0, vocab, (rows,))
    target[0] = vocab - 1  # in the last segment
    logits[2, -1] += 25  # a row's maximum in the last segment: the merge must rescale the others
    options = dict(logit_scale=0.9, softcap=softcap, label_smoothing=smoothing, vocab_size=vocab, z_loss=z_loss)
    want_loss, want_lse, want_grad = _expected(
        logits, target, 0.3, logit_scale=0.9, softcap=softcap, smoothing=smoothing, z_loss=z_loss
    )
    runs = {
        "triton": lambda *a: losses_and_grad(*a, grad_scale=0.3, rows_per_group=rows_per_group, **options),
        "torch": lambda *a: torch_path.losses_and_grad(*a, grad_scale=0.3, **options),
    }
    for name, run in runs.items():
        source = logits.clone()
        grad = source if dtype != torch.float32 else torch.empty_like(logits)  # in place, as the chunk loop does
        loss, lse = torch.full((rows,), float("nan")), torch.full((rows,), float("nan"))
        if grad is not source:
            grad.fill_(float("nan"))
        run(source, grad, target, loss, lse)
        assert rel_err(loss, want_loss) < 1e-5, name
        assert rel_err(lse, want_lse) < 1e-6, name
        assert torch.isfinite(grad).all(), name
        assert rel_err(grad, want_grad) < (1e-5 if dtype == torch.float32 else 8e-3), name


def test_split_gradient_and_group_boundaries(monkeypatch):
    """fp32 logits with G stored as hi + lo (bf16); rows_per_group larger than the rows, and rows a multiple of it."""
    monkeypatch.setattr(row_stats_module, "SEGMENT_COLS", 512)
    for rows, rows_per_group in ((3, 8), (8, 4)):
        logits = torch.randn(rows, 1500) * 4
        target = torch.randint(0, 1500, (rows,))
        want_loss, want_lse, want_grad = _expected(logits, target, 1.0, logit_scale=1.0, softcap=None, smoothing=0.0, z_loss=0.0)
        hi, lo = torch.full((rows, 1500), float("nan"), dtype=torch.bfloat16), torch.empty(rows, 1500, dtype=torch.bfloat16)
        loss, lse = torch.empty(rows), torch.empty(rows)
        losses_and_grad(
            logits, hi, target, loss, lse, grad_scale=1.0, logit_scale=1.0, softcap=None, label_smoothing=0.0,
            vocab_size=1500, z_loss=0.0, out_lo=lo, rows_per_group=rows_per_group,
        )
        assert rel_err(loss, want_loss) < 1e-6 and rel_err(lse, want_lse) < 1e-6
        assert rel_err(hi, want_grad) > 1e-4  # one bf16 rounding alone is visibly off
        assert rel_err(hi.float() + lo.float(), want_grad) < 2e-5
