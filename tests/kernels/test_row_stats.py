"""The stats kernel (Triton, interpreted on CPU) and its PyTorch twin against float64 math."""
import pytest
import torch

from fused_lm_loss import torch_backend
from fused_lm_loss.loss_terms import LossTerms
from fused_lm_loss.transform import LogitTransform

from ..reference import rel_err

from ..conftest import requires_triton

pytestmark = requires_triton
import importlib  # noqa: E402

from fused_lm_loss.kernels import row_stats  # noqa: E402

row_stats_module = importlib.import_module("fused_lm_loss.kernels.row_stats")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 300, 4096 + 37])  # one element, one block, two blocks of the online loop
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("segment_cols", [None, 256])  # None: the default (one segment here); 256: up to 17
def test_row_stats_against_float64(dtype, vocab, softcap, segment_cols, monkeypatch):
    if segment_cols is not None:
        monkeypatch.setattr(row_stats_module, "SEGMENT_COLS", segment_cols)
    rows = 5
    logits = (torch.randn(rows, vocab) * 4).to(dtype)
    target = torch.randint(0, vocab, (rows,))
    target[1] = -1  # the target class lives in another vocab shard
    target[2] = vocab - 1  # in the last segment
    logits[3, -1] += 20  # one row's maximum in the last segment: the merge must rescale the others
    logit_scale = 0.7
    z = logits.double() * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    expected_max = z.amax(1)
    expected = {
        "max": expected_max,
        "sumexp": torch.exp(z - expected_max[:, None]).sum(1),
        "target": torch.where(target >= 0, z.gather(1, target.clamp(min=0)[:, None]).squeeze(1), 0.0),
        "sum": z.sum(1),
    }
    transform = LogitTransform(scale=logit_scale, softcap=softcap)
    terms = LossTerms(label_smoothing=0.1, vocab_size=vocab)  # smoothing: the logit sum is computed
    for impl in (row_stats, torch_backend.row_stats):
        got = impl(logits, target, transform=transform, terms=terms)
        for (name, want), have in zip(expected.items(), got):
            assert have.dtype == torch.float32
            assert rel_err(have, want) < 1e-5, (impl.__module__, name)


def test_row_stats_respects_row_stride():
    """The chunk loop passes row slices of a larger buffer: the kernel must use the row stride."""
    buffer = torch.randn(6, 64) * 3
    view = buffer[:, :50]
    target = torch.randint(0, 50, (6,))
    got = row_stats(view, target, transform=LogitTransform(), terms=LossTerms())
    want = torch_backend.row_stats(view.contiguous(), target, transform=LogitTransform(), terms=LossTerms())
    for a, b in zip(got[:3], want[:3]):
        assert rel_err(a, b) < 1e-6


def _row_losses_float64(z, target, label_smoothing, z_loss):
    """Each row's loss and lse from float64 logits z (after scale and softcap)."""
    lse = torch.logsumexp(z, 1)
    z_target = z.gather(1, target[:, None]).squeeze(1)
    loss = (1 - label_smoothing) * (lse - z_target) + label_smoothing * (lse - z.mean(1)) + z_loss * lse**2
    return loss, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("label_smoothing, z_loss", [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-3), (0.2, 1e-2)])
@pytest.mark.parametrize("segment_cols", [None, 256])
def test_row_losses_against_float64(dtype, softcap, label_smoothing, z_loss, segment_cols, monkeypatch):
    """Loss and lse written by the merge kernel (and the PyTorch twin), against the float64 formula."""
    from fused_lm_loss.kernels import row_losses

    if segment_cols is not None:
        monkeypatch.setattr(row_stats_module, "SEGMENT_COLS", segment_cols)
    rows, vocab = 70, 1000  # more rows than one merge program takes (32)
    logits = (torch.randn(rows, vocab) * 4).to(dtype)
    target = torch.randint(0, vocab, (rows,))
    logits[3, -1] += 20
    logit_scale = 0.7
    z = logits.double() * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    expected, lse = _row_losses_float64(z, target, label_smoothing, z_loss)
    for impl in (row_losses, torch_backend.row_losses):
        loss, lse_out = torch.full((2, rows), float("nan")).unbind(0)
        impl(logits, target, loss, lse_out, transform=LogitTransform(scale=logit_scale, softcap=softcap),
             terms=LossTerms(label_smoothing=label_smoothing, z_loss=z_loss, vocab_size=vocab))
        assert rel_err(loss, expected) < 1e-5, impl.__module__
        assert rel_err(lse_out, lse) < 1e-6, impl.__module__


def test_merge_over_more_segments_than_one_block(monkeypatch):
    """125 segments per row: the merge kernel loops over its blocks of 64 segments (one combo, 5 rows: the
    interpreter makes every segment expensive)."""
    from fused_lm_loss.kernels import row_losses

    monkeypatch.setattr(row_stats_module, "SEGMENT_COLS", 8)
    rows, vocab = 5, 1000
    logits = (torch.randn(rows, vocab) * 4).to(torch.bfloat16)
    target = torch.randint(0, vocab, (rows,))
    target[0] = vocab - 1  # in the last segment of the second block
    logits[3, -1] += 20  # one row's maximum in the last segment: the merge must rescale the others
    label_smoothing, z_loss, softcap = 0.1, 1e-3, 3.0
    z = softcap * torch.tanh(logits.double() / softcap)
    expected, lse = _row_losses_float64(z, target, label_smoothing, z_loss)
    loss, lse_out = torch.full((2, rows), float("nan")).unbind(0)
    row_losses(logits, target, loss, lse_out, transform=LogitTransform(softcap=softcap),
               terms=LossTerms(label_smoothing=label_smoothing, z_loss=z_loss, vocab_size=vocab))
    assert rel_err(loss, expected) < 1e-5
    assert rel_err(lse_out, lse) < 1e-6
