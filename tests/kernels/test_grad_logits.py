"""The gradient kernel (Triton, interpreted on CPU) and its PyTorch twin against float64 autograd."""
import pytest
import torch

from fused_lm_loss import torch_backend
from fused_lm_loss.loss_terms import LossTerms
from fused_lm_loss.transform import LogitTransform

from ..reference import rel_err

from ..conftest import requires_triton

pytestmark = requires_triton
from fused_lm_loss.kernels import grad_logits  # noqa: E402


def _expected(logits, target, row_scale, *, logit_scale, softcap, smoothing, vocab_total, z_loss):
    """d(sum_i row_scale_i * loss_i)/d(logits) in float64, by autograd on the loss formula."""
    x = logits.double().requires_grad_(True)
    z = x * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    lse = torch.logsumexp(z, 1)
    target_z = torch.where(target >= 0, z.gather(1, target.clamp(min=0)[:, None]).squeeze(1), 0.0)
    loss = lse - (1 - smoothing) * target_z - smoothing / vocab_total * z.sum(1) + z_loss * lse**2
    (loss * row_scale.double()).sum().backward()
    return x.grad, lse.detach().float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("per_row", [False, True])
def test_grad_logits_against_float64(dtype, softcap, per_row):
    rows, vocab = 7, 2048 + 300  # two column blocks, the second partial
    logits = (torch.randn(rows, vocab) * 4).to(dtype)
    target = torch.randint(0, vocab, (rows,))
    options = dict(logit_scale=0.8, softcap=softcap, smoothing=0.15, vocab_total=vocab, z_loss=1e-2)
    row_scale = torch.rand(rows) + 0.5 if per_row else torch.full((rows,), 1.0)
    want, lse = _expected(logits, target, row_scale * 3.0, **options)
    for impl in (grad_logits, torch_backend.grad_logits):
        out = torch.full_like(logits, float("nan"))  # poisoned: every element must be written
        impl(
            logits,
            out,
            target,
            lse,
            grad_scale=3.0,
            row_scale=row_scale if per_row else None,
            transform=LogitTransform(scale=options["logit_scale"], softcap=softcap),
            terms=LossTerms(label_smoothing=options["smoothing"], z_loss=options["z_loss"], vocab_size=vocab),
        )
        tol = 1e-5 if dtype == torch.float32 else 8e-3
        assert torch.isfinite(out).all(), impl.__module__
        assert rel_err(out, want) < tol, impl.__module__


def test_grad_logits_in_place_and_target_elsewhere():
    """out may alias the logits (the chunk loop's in-place reuse); target -1 = class on another shard."""
    logits = torch.randn(4, 100) * 3
    target = torch.tensor([3, -1, 99, -1])
    lse = torch.logsumexp(logits, 1)
    softmax = torch.softmax(logits, 1)
    expected = torch.empty_like(logits)
    kwargs = dict(
        grad_scale=0.5, row_scale=None, transform=LogitTransform(), terms=LossTerms(label_smoothing=0.0, vocab_size=100)
    )
    torch_backend.grad_logits(logits, expected, target, lse, **kwargs)
    grad_logits(logits, logits, target, lse, **kwargs)
    assert rel_err(logits, expected) < 1e-6
    assert rel_err(logits[[1, 3]], 0.5 * softmax[[1, 3]]) < 1e-6  # no "- 1" anywhere in those rows
    assert rel_err(logits[0, 3], 0.5 * (softmax[0, 3] - 1)) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_output_carries_the_rounding_residual(dtype):
    """out_lo: G = hi + lo to ~16 significant bits, in the kernel and its PyTorch twin."""
    logits = torch.randn(6, 1000) * 4  # fp32 logits, as with logits_dtype=torch.float32
    target = torch.randint(0, 1000, (6,))
    lse = torch.logsumexp(logits, 1)
    options = dict(transform=LogitTransform(), terms=LossTerms(label_smoothing=0.1, vocab_size=1000))
    exact = torch.empty_like(logits)
    torch_backend.grad_logits(logits, exact, target, lse, grad_scale=1.0, row_scale=None, **options)
    hi, lo = torch.empty(6, 1000, dtype=dtype), torch.empty(6, 1000, dtype=dtype)
    for run in (
        lambda: grad_logits(logits, hi, target, lse, grad_scale=1.0, row_scale=None, out_lo=lo, **options),
        lambda: torch_backend.grad_logits(logits, hi, target, lse, grad_scale=1.0, row_scale=None, out_lo=lo, **options),
    ):
        hi.fill_(float("nan"))
        lo.fill_(float("nan"))
        run()
        assert rel_err(hi, exact) > 1e-4  # one rounding alone is visibly off
        assert rel_err(hi.float() + lo.float(), exact) < 2e-5
