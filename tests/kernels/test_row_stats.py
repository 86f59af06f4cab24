"""The stats kernel (Triton, interpreted on CPU) and its PyTorch twin against float64 math."""
import pytest
import torch

from fused_lm_loss import torch_path

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
    for impl in (row_stats, torch_path.row_stats):
        got = impl(logits, target, logit_scale=logit_scale, softcap=softcap, need_sum=True)
        for (name, want), have in zip(expected.items(), got):
            assert have.dtype == torch.float32
            assert rel_err(have, want) < 1e-5, (impl.__module__, name)


def test_row_stats_respects_row_stride():
    """The chunk loop passes row slices of a larger buffer: the kernel must use the row stride."""
    buffer = torch.randn(6, 64) * 3
    view = buffer[:, :50]
    target = torch.randint(0, 50, (6,))
    got = row_stats(view, target, logit_scale=1.0, softcap=None, need_sum=False)
    want = torch_path.row_stats(view.contiguous(), target, logit_scale=1.0, softcap=None, need_sum=False)
    for a, b in zip(got[:3], want[:3]):
        assert rel_err(a, b) < 1e-6


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
    lse = torch.logsumexp(z, 1)
    z_target = z.gather(1, target[:, None]).squeeze(1)
    expected = (1 - label_smoothing) * (lse - z_target) + label_smoothing * (lse - z.mean(1)) + z_loss * lse**2
    for impl in (row_losses, torch_path.row_losses):
        loss, lse_out = torch.full((2, rows), float("nan")).unbind(0)
        impl(logits, target, loss, lse_out, logit_scale=logit_scale, softcap=softcap,
             label_smoothing=label_smoothing, z_loss=z_loss, vocab_size=vocab)
        assert rel_err(loss, expected) < 1e-5, impl.__module__
        assert rel_err(lse_out, lse) < 1e-6, impl.__module__


@pytest.mark.parametrize("as_copy", [False, True], ids=["strided_tiles", "tile_buffer"])
def test_tile_stats_merged_over_column_tiles(as_copy, monkeypatch):
    """Partials of column tiles (strided views of the chunk as in training, or copies in a separate tile
    buffer as without gradients), split into segments, merged: the whole row's statistics and loss."""
    from fused_lm_loss import kernels

    monkeypatch.setattr(row_stats_module, "SEGMENT_COLS", 64)  # tiles of up to 160 columns: up to 3 segments
    rows, vocab, edges = 40, 700, (0, 160, 320, 480, 640, 700)
    logits = (torch.randn(rows, vocab) * 4).to(torch.bfloat16)
    target = torch.randint(0, vocab, (rows,))
    target[:6] = torch.tensor([0, 159, 160, 699, 640, -1])  # tile edges; -1: another vocab shard
    logits[7, 650] += 25  # a row maximum in the last tile
    z = logits.double() * 0.8
    z = 3.0 * torch.tanh(z / 3.0)
    row_max = z.amax(1)
    has_target = target >= 0
    expected = (row_max, torch.exp(z - row_max[:, None]).sum(1),
                torch.where(has_target, z.gather(1, target.clamp(min=0)[:, None]).squeeze(1), 0.0), z.sum(1))
    lse = torch.logsumexp(z, 1)
    expected_loss = 0.9 * (lse - expected[2]) + 0.1 * (lse - z.mean(1)) + 1e-3 * lse**2
    for ops in (kernels, torch_path):
        counts = [ops.segment_count(b - a) for a, b in zip(edges, edges[1:])]
        partial = ops.new_partials(rows, sum(counts), logits.device)
        first = 0
        for (a, b), count in zip(zip(edges, edges[1:]), counts):
            tile = logits[:, a:b].contiguous() if as_copy else logits[:, a:b]
            ops.tile_stats(tile, target, a, partial[:, first : first + count], logit_scale=0.8, softcap=3.0,
                           need_sum=True)
            first += count
        for have, want, name in zip(ops.merge_stats(partial), expected, ("max", "sumexp", "target", "sum")):
            assert rel_err(have, want) < 1e-5, (ops.__name__, name)
        loss, lse_out = torch.full((2, rows), float("nan")).unbind(0)
        ops.merge_losses(partial, loss, lse_out, label_smoothing=0.1, z_loss=1e-3, vocab_size=vocab)
        assert rel_err(loss[has_target], expected_loss[has_target]) < 1e-5, ops.__name__
        assert rel_err(lse_out, lse) < 1e-6, ops.__name__
    assert sum(kernels.segment_count(b - a) for a, b in zip(edges, edges[1:])) == 3 + 3 + 3 + 3 + 1
