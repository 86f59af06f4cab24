"""The logits matmul with row statistics in its epilogue (Triton; on CPU through the interpreter, fp16 only)."""
import pytest
import torch

from fused_lm_loss.loss_terms import LossTerms
from fused_lm_loss.transform import LogitTransform

from ..conftest import TEST_DEVICE, requires_triton
from ..reference import rel_err

pytestmark = requires_triton
from fused_lm_loss.kernels import matmul_stats, merge_partials  # noqa: E402

DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    TEST_DEVICE == "cpu", reason="the Triton interpreter computes bf16 dots of TMA-loaded tiles wrongly"))]


def _skip_unless_supported(hidden, weight):
    if not matmul_stats.supported(hidden, weight):
        pytest.skip("needs a TMA-capable GPU (sm90+) and a Triton with tensor descriptors, or the interpreter")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("logits_fp32", [False, True], ids=["logits_rounded", "logits_fp32"])
@pytest.mark.parametrize("softcap, logit_scale, need_sum", [(None, 1.0, False), (4.0, 0.7, True)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_partials_merge_to_the_row_statistics(dtype, logits_fp32, softcap, logit_scale, need_sum, with_bias):
    """300 rows (3 row tiles, the last partial), 700 columns (3 vocabulary tiles, the last partial), H = 40
    (one K step, zero-padded by TMA): merged partials against float64 statistics of the same logits."""
    rows, hidden_size, vocab = 300, 40, 700
    hidden = torch.randn(rows, hidden_size).to(dtype)
    weight = (torch.randn(vocab, hidden_size) * 0.6).to(dtype)
    bias = (torch.randn(vocab) * 0.5).to(dtype) if with_bias else None
    _skip_unless_supported(hidden, weight)
    target = torch.randint(0, vocab, (rows,))
    target[:5] = torch.tensor([0, 255, 256, vocab - 1, -1])  # tile edges; -1: the class is in another shard
    target[128:256] = torch.randint(0, 256, (128,))  # the second row tile: no target in vocabulary tiles 2, 3
    x = hidden.double() @ weight.double().T + (0 if bias is None else bias.double())
    if not logits_fp32:
        x = x.to(dtype).double()  # the statistics are those of the logits as a stored chunk would hold them
    z = x * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    row_max = z.amax(1)
    expected = [row_max, torch.exp(z - row_max[:, None]).sum(1),
                torch.where(target >= 0, z.gather(1, target.clamp(min=0)[:, None]).squeeze(1), 0.0)]
    if need_sum:
        expected.append(z.sum(1))

    partial = matmul_stats.matmul_partials(
        hidden, weight, bias, target, logits_dtype=torch.float32 if logits_fp32 else dtype,
        transform=LogitTransform(scale=logit_scale, softcap=softcap), need_sum=need_sum,
    )
    assert partial.shape == (4, 3, rows)
    # the merge sums the partials' logit sums when the terms smooth (need_sum asked the kernel to write them)
    got = merge_partials(partial, terms=LossTerms(label_smoothing=0.1 if need_sum else 0.0, vocab_size=vocab))
    # fp32 accumulation in another order than float64: a rounded logit may land one ulp away
    tol = 1e-5 if logits_fp32 else 2e-3
    for name, have, want in zip(("max", "sumexp", "target", "sum"), got, expected):
        assert have.dtype == torch.float32
        assert rel_err(have, want) < tol, name
    if not need_sum:
        assert not got[3].any()  # no sum asked for: the merge leaves it 0

    loss, lse = torch.full((2, rows), float("nan")).unbind(0)
    merge_partials(partial, loss_out=loss, lse_out=lse,
                   terms=LossTerms(label_smoothing=0.1 if need_sum else 0.0, z_loss=1e-3, vocab_size=vocab))
    expected_lse = torch.logsumexp(z, 1)
    smoothing = 0.1 if need_sum else 0.0
    expected_loss = expected_lse - (1 - smoothing) * expected[2] - smoothing / vocab * z.sum(1) + 1e-3 * expected_lse**2
    assert rel_err(lse, expected_lse) < tol and rel_err(loss, expected_loss) < tol


def test_supported_refuses_what_the_kernel_cannot_load():
    hidden, weight = torch.randn(8, 64, dtype=torch.float16), torch.randn(32, 64, dtype=torch.float16)
    _skip_unless_supported(hidden, weight)
    assert not matmul_stats.supported(hidden.float(), weight.float())  # fp32 would run as tf32
    assert not matmul_stats.supported(hidden, weight.bfloat16())  # mixed dtypes
    odd = torch.randn(8, 41, dtype=torch.float16)  # rows of 82 bytes: not 16-byte aligned for TMA
    assert not matmul_stats.supported(odd, torch.randn(32, 41, dtype=torch.float16))
    assert not matmul_stats.supported(hidden.t().contiguous().t(), weight)  # columns not contiguous
