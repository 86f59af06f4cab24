"""The logits matmul with row statistics in its epilogue (Triton, interpreted on CPU) against float64."""
import pytest
import torch

from ..conftest import requires_triton
from ..reference import rel_err

pytestmark = requires_triton


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(70, 40, 600), (5, 16, 257), (130, 96, 300)])  # rows, H, V: ragged tiles
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("softcap, label_smoothing, z_loss", [(None, 0.0, 0.0), (3.0, 0.1, 1e-3)])
@pytest.mark.parametrize("round_logits", [True, False])
def test_matmul_row_losses_against_float64(dtype, shape, bias, softcap, label_smoothing, z_loss, round_logits):
    from fused_lm_loss.kernels.matmul_stats import matmul_row_losses

    rows, h, v = shape
    hidden = torch.randn(rows, h).to(dtype)
    weight = (torch.randn(v, h) * (3 / h**0.5)).to(dtype)
    b = (torch.randn(v) * 0.5).to(dtype) if bias else None
    target = torch.randint(0, v, (rows,))
    target[0] = v - 1  # in the last, partial vocabulary tile
    logit_scale = 0.9
    x = hidden.double() @ weight.double().T + (b.double() if bias else 0)
    if round_logits:  # the logits the cuBLAS path would store
        x = (hidden.float() @ weight.float().T + (b.float() if bias else 0)).to(dtype).double()
    z = x * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    lse = torch.logsumexp(z, 1)
    z_target = z.gather(1, target[:, None]).squeeze(1)
    expected = (1 - label_smoothing) * (lse - z_target) + label_smoothing * (lse - z.mean(1)) + z_loss * lse**2

    loss, lse_out = torch.full((2, rows), float("nan")).unbind(0)
    matmul_row_losses(hidden, weight, b, target, loss, lse_out, logit_scale=logit_scale, softcap=softcap,
                      label_smoothing=label_smoothing, z_loss=z_loss, vocab_size=v, round_logits=round_logits)
    # fp32 accumulation in another order than the reference: a rounded logit may land one ulp away
    tolerance = 2e-4 if round_logits else 1e-5
    assert rel_err(lse_out, lse) < tolerance
    assert rel_err(loss, expected) < 5 * tolerance


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_matmul_row_stats_match_row_stats_of_the_stored_logits(softcap):
    """The four statistics that vocab-parallel shards merge, with a target outside this shard (-1)."""
    from fused_lm_loss import torch_path
    from fused_lm_loss.kernels.matmul_stats import matmul_row_stats

    rows, h, v = 40, 48, 700
    hidden, weight = torch.randn(rows, h).bfloat16(), (torch.randn(v, h) * 0.4).bfloat16()
    target = torch.randint(0, v, (rows,))
    target[::3] = -1
    got = matmul_row_stats(hidden, weight, None, target, logit_scale=1.1, softcap=softcap, need_sum=True)
    logits = (hidden.float() @ weight.float().T).bfloat16()
    want = torch_path.row_stats(logits, target, logit_scale=1.1, softcap=softcap, need_sum=True)
    for name, a, b in zip(("max", "sumexp", "target", "sum"), got, want):
        assert rel_err(a, b) < 1e-5, name
