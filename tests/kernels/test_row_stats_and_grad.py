"""The fused stats + gradient kernel equals the two separate kernels (Triton, interpreted on CPU)."""
import pytest
import torch

from ..reference import rel_err

triton = pytest.importorskip("triton")
from fused_lm_loss.kernels import grad_logits, row_stats, row_stats_and_grad  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 7), (9, 4096 + 100)])  # 9 rows > 4 programs: the persistent loop
@pytest.mark.parametrize("softcap,smoothing", [(None, 0.0), (5.0, 0.2)])
def test_fused_equals_separate_kernels(dtype, rows, vocab, softcap, smoothing):
    logits = (torch.randn(rows, vocab) * 4).to(dtype)
    target = torch.randint(0, vocab, (rows,))
    options = dict(logit_scale=0.9, softcap=softcap, label_smoothing=smoothing, vocab_size=vocab, z_loss=1e-3)
    stats = row_stats(logits, target, logit_scale=0.9, softcap=softcap, need_sum=smoothing > 0)
    expected = torch.empty_like(logits)
    grad_logits(logits, expected, target, stats[0] + torch.log(stats[1]), grad_scale=0.25, row_scale=None, **options)

    fused = logits.clone()
    fused_stats = row_stats_and_grad(fused, fused, target, grad_scale=0.25, **options)  # in place, as the loop does
    for a, b in zip(fused_stats, stats):
        assert rel_err(a, b) < 1e-6
    assert rel_err(fused, expected) < 1e-6
