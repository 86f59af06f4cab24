"""The stats kernel (Triton, interpreted on CPU) and its PyTorch twin against float64 math."""
import math

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


@pytest.mark.parametrize("rows, tiles", [(1, 1), (7, 5), (6, 600)])  # 7: not a multiple of the rows per program;
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])                     # 600: more tiles than one block of the merge
def test_merge_exp_stats_against_float64(rows, tiles, z_loss):
    """The Hopper epilogue's per-(row, tile) integer exponents k and sums s (exp_epilogue.py) merged into each row's
    loss and lse, the kernel and its PyTorch twin: lse = log sum_t s_t 2^k_t, loss = lse - z_target + z_loss lse^2."""
    from fused_lm_loss.exp_epilogue import ExpStats
    from fused_lm_loss.kernels import merge_exp_stats

    k = torch.randint(-40, 41, (rows, tiles)).float()
    k[0, -1] = 120.0  # one tile far above the rest: every other sum is moved by 2^-(120 - k), some to 0
    sum_exp = torch.rand(rows, tiles) * 100 + 0.7  # a tile's sum holds its largest element, 2^[-1/2, 1/2]
    stats = ExpStats(k=k, sum_exp=sum_exp, target_logit=torch.randn(rows) * 10, tile_n=128)
    lse = torch.logsumexp(sum_exp.double().log() + k.double() * math.log(2.0), 1)
    expected = lse - stats.target_logit.double() + z_loss * lse * lse
    terms = LossTerms(z_loss=z_loss, vocab_size=128 * tiles)
    for impl in (merge_exp_stats, torch_backend.merge_exp_stats):
        loss_out, lse_out = torch.full((2, rows), float("nan")).unbind(0)
        impl(stats, loss_out, lse_out, terms=terms)
        assert rel_err(lse_out, lse) < 1e-6, impl.__module__
        assert rel_err(loss_out, expected) < 1e-6, impl.__module__


@pytest.mark.parametrize("where", ["k", "sum_exp"])
def test_merge_exp_stats_keeps_a_nan(where):
    """A NaN exponent or sum (a NaN in the hidden states) makes its row's loss and lse NaN, the other rows exact."""
    from fused_lm_loss.exp_epilogue import ExpStats
    from fused_lm_loss.kernels import merge_exp_stats

    stats = ExpStats(k=torch.randint(-5, 6, (3, 300)).float(), sum_exp=torch.rand(3, 300) + 1,
                     target_logit=torch.randn(3), tile_n=128)
    getattr(stats, where)[1, 257] = float("nan")
    for impl in (merge_exp_stats, torch_backend.merge_exp_stats):
        loss_out, lse_out = torch.zeros((2, 3)).unbind(0)
        impl(stats, loss_out, lse_out, terms=LossTerms(vocab_size=128 * 300))
        assert loss_out[1].isnan() and lse_out[1].isnan(), impl.__module__
        assert loss_out[[0, 2]].isfinite().all() and lse_out[[0, 2]].isfinite().all(), impl.__module__
