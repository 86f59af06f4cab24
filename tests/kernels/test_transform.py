"""tanh and the logit transform (kernels/transform.py, transform.LogitTransform) against float64: a dense grid,
the branch point, tiny and huge arguments, +-inf and NaN; the fitted polynomial; the softcap gradient end to end
at fp32 round-off; the temperature (z = c * tanh(s * x / c) / T, or s * x / T) in every kernel and in the PyTorch
twin (``LogitTransform.apply`` / ``chain``)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fused_lm_loss import torch_backend
from fused_lm_loss.loss_terms import LossTerms
from fused_lm_loss.transform import LogitTransform

from ..conftest import TEST_DEVICE, requires_triton
from ..reference import rel_err

pytestmark = requires_triton
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fused_lm_loss.kernels import grad_logits, row_losses, token_grad_logits, token_stats  # noqa: E402
from fused_lm_loss.kernels import transform as transform_module  # noqa: E402
from fused_lm_loss.kernels.transform import tanh  # noqa: E402

from .test_token_stats import _assert_argmax  # noqa: E402  (argmax where fp32 can tell the maximum apart)

# Largest error allowed, in ulps of the exact value's binade: interpreter (exactly rounded exp and division; 1.5
# measured) and GPU (ex2.approx, div.full; 1.8 measured on the H200). The former exp-only formula was off by
# ~2e7 ulps next to 0 and by up to 7 ulps elsewhere.
MAX_ULPS = 2.0 if TEST_DEVICE == "cpu" else 3.0
# Both branches of tanh are computed for every element: the interpreter's numpy reports the discarded one's
# overflow (and inf - inf) at huge or infinite arguments. A GPU raises nothing.
ignore_numpy_overflow = pytest.mark.filterwarnings(
    "ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning"
)


@triton.jit
def _tanh_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tanh(tl.load(x_ptr + offsets, mask=mask, other=0.0)), mask=mask)


def _kernel_tanh(x: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(x, 7.0)  # poisoned: every element must be written
    block = 4096
    _tanh_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), BLOCK=block)
    return out


def _ulps(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """|actual - expected| in ulps of fp32 numbers in expected's binade (float64 expected)."""
    _, exponent = torch.frexp(expected.abs())
    ulp = torch.ldexp(torch.ones_like(expected), (exponent - 24).clamp(min=-149))
    return (actual.double() - expected).abs() / ulp


def _grid() -> torch.Tensor:
    """fp32 arguments: a dense uniform grid, a geometric one down to the smallest normal numbers, every fp32
    number within 2000 ulps of the branch points +-TANH_SMALL, and the large range where tanh saturates."""
    small = transform_module.TANH_SMALL.value
    dense = torch.linspace(-12.0, 12.0, 2**19 + 1, dtype=torch.float64)
    geometric = torch.logspace(-37.5, 1.5, 2**17, dtype=torch.float64)
    branch = torch.tensor(small, dtype=torch.float32).view(torch.int32) + torch.arange(-2000, 2001, dtype=torch.int32)
    large = torch.logspace(0.9, 38.5, 4096, dtype=torch.float64)
    positive = torch.cat([dense, geometric, branch.view(torch.float32).double(), large]).float()
    return torch.cat([positive, -positive])


@ignore_numpy_overflow
def test_tanh_within_a_few_ulps_everywhere():
    x = _grid()
    got = _kernel_tanh(x)
    ulps = _ulps(got, torch.tanh(x.double()))
    worst = int(ulps.argmax())
    assert ulps.max() <= MAX_ULPS, f"{ulps.max().item():.2f} ulps at u = {x[worst].item()!r}"
    # tiny arguments: tanh(u) = u to fp32 precision (the old formula returned 0 or multiples of 6e-8 there)
    tiny = torch.tensor([1e-30, 1e-12, 3e-8, 1e-5, -1e-20, -2e-7])
    assert torch.equal(_kernel_tanh(tiny), tiny)


@ignore_numpy_overflow
def test_tanh_special_values():
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 9.02, -9.02, 44.5, -89.0, 3.4e38, -3.4e38])
    got = _kernel_tanh(x).cpu()
    assert got[:2].tolist() == [1.0, -1.0]
    assert torch.isnan(got[2])
    assert got[3] == 0 and got[4] == 0  # (the sign of tanh(-0.0) is not kept: nothing downstream can see it)
    assert got[5:].tolist() == [1.0, -1.0, 1.0, -1.0, 1.0, -1.0]  # fp32 tanh is exactly +-1 from 9.0109 on


def _fit_small_branch(bound: float, terms: int, iterations: int = 400) -> np.ndarray:
    """float64 minimax (Lawson's iteration) of the relative error of tanh(a) ~ a + a^3 * P(a^2) on (0, bound]:
    how the coefficients in kernels/transform.py were made."""
    a = np.unique(np.concatenate([np.linspace(1e-4, bound, 3000), bound * np.sin(np.linspace(0, np.pi / 2, 3000))[1:]]))
    t = np.tanh(a)
    basis = np.stack([a ** (2 * k + 3) for k in range(terms)], 1)
    weight = 1 / t  # relative error
    lam = np.full(a.size, 1.0 / a.size)
    best = (np.inf, None)
    for _ in range(iterations):
        sw = np.sqrt(lam) * weight
        coef = np.linalg.lstsq(basis * sw[:, None], (t - a) * sw, rcond=None)[0]
        err = np.abs(basis @ coef - (t - a)) * weight
        if err.max() < best[0]:
            best = (err.max(), coef)
        lam = lam * err
        lam /= lam.sum()
    return best[1]


def test_polynomial_is_the_float64_fit():
    terms = sum(1 for k in range(10) if hasattr(transform_module, f"P{k}"))
    shipped = np.array([getattr(transform_module, f"P{k}").value for k in range(terms)])
    bound = transform_module.TANH_SMALL.value
    np.testing.assert_allclose(shipped, _fit_small_branch(bound, terms), rtol=1e-7)
    # the polynomial itself (float64) is within 2e-8 of tanh, relative: well below half an fp32 ulp (3e-8 to 6e-8)
    a = np.linspace(1e-6, bound, 200_001)
    approx = a + a**3 * np.polynomial.polynomial.polyval(a * a, shipped)
    assert np.max(np.abs(approx / np.tanh(a) - 1)) < 2e-8


def _expected(x, target, *, softcap, logit_scale, label_smoothing, z_loss):
    """Loss, lse and d(sum loss)/dx in float64: F.cross_entropy of softcap * tanh(logit_scale * x / softcap)."""
    xd = x.double().requires_grad_(True)
    z = softcap * torch.tanh(xd * logit_scale / softcap)
    lse = torch.logsumexp(z, 1)
    loss = F.cross_entropy(z, target, reduction="none", label_smoothing=label_smoothing) + z_loss * lse**2
    loss.sum().backward()
    return loss.detach(), lse.detach(), xd.grad


@pytest.mark.parametrize("rows, vocab, std", [(4, 8, 4.0), (16, 3000, 4.0), (16, 3000, 40.0)])
def test_softcap_gradient_at_fp32_roundoff(rows, vocab, std):
    """fp32 logits, softcap 30 (Gemma): loss, lse and gradient of the kernels at fp32 round-off, like the
    PyTorch twin (torch.tanh). With the former tanh the kernel's gradient error was 6.4e-7 at 4 x 8."""
    x = torch.randn(rows, vocab) * std
    target = torch.randint(0, vocab, (rows,))
    options = dict(softcap=30.0, logit_scale=0.9, label_smoothing=0.1, z_loss=1e-3)
    loss, lse, grad = _expected(x, target, **options)
    transform = LogitTransform(scale=options["logit_scale"], softcap=options["softcap"])
    terms = LossTerms(label_smoothing=options["label_smoothing"], z_loss=options["z_loss"], vocab_size=vocab)
    errors = {}
    for name, losses_fn, grad_fn in (("triton", row_losses, grad_logits), ("torch", torch_backend.row_losses, torch_backend.grad_logits)):
        got_loss, got_lse = torch.full((2, rows), float("nan")).unbind(0)
        losses_fn(x, target, got_loss, got_lse, transform=transform, terms=terms)
        got_grad = torch.full_like(x, float("nan"))
        grad_fn(x, got_grad, target, got_lse, grad_scale=1.0, row_scale=None, transform=transform, terms=terms)
        errors[name] = (rel_err(got_loss, loss), rel_err(got_lse, lse), rel_err(got_grad, grad))
    for name, (loss_err, lse_err, grad_err) in errors.items():
        assert loss_err < 3e-7 and lse_err < 3e-7 and grad_err < 3e-7, (name, errors)  # ~5 ulps
    assert errors["triton"][2] < 2 * errors["torch"][2], errors


# ---------------------------------------------------------------------------------------------------------------
# The temperature: z = c * tanh(s * x / c) / T with a softcap c, z = s * x / T without, in every kernel and in the
# PyTorch twin, against float64 written here from that formula.

TEMPERATURES = [0.7, 1.9]
SOFTCAPS = [None, 30.0, 3.0]  # 3.0: tanh well into saturation at std-4 logits


def _z_temperature(x: torch.Tensor, scale: float, softcap: float | None, temperature: float) -> torch.Tensor:
    """Loss-space logits in float64 from the literal formula (not the kernels' folding of the three numbers)."""
    x = x.double()
    z = scale * x if softcap is None else softcap * torch.tanh(scale * x / softcap)
    return z / temperature


def _loss_reference(x, target, row_scale, *, scale, softcap, temperature, label_smoothing, z_loss):
    """Per-row loss and lse, and d(sum_i row_scale_i loss_i)/dx: float64 autograd of F.cross_entropy (+ z-loss)."""
    xd = x.double().requires_grad_(True)
    z = _z_temperature(xd, scale, softcap, temperature)
    lse = torch.logsumexp(z, 1)
    loss = F.cross_entropy(z, target, reduction="none", label_smoothing=label_smoothing) + z_loss * lse**2
    (loss * row_scale.double()).sum().backward()
    return loss.detach(), lse.detach(), xd.grad


def _token_reference(x, target, a, b, *, scale, softcap, temperature):
    """(logprob, entropy, lse, z) and d(sum a * logprob + b * entropy)/dx, float64 autograd."""
    xd = x.double().requires_grad_(True)
    z = _z_temperature(xd, scale, softcap, temperature)
    log_p = torch.log_softmax(z, 1)
    logprob = log_p.gather(1, target[:, None]).squeeze(1)
    entropy = -(log_p.exp() * log_p).sum(1)
    (a.double() * logprob + b.double() * entropy).sum().backward()
    return logprob.detach(), entropy.detach(), torch.logsumexp(z, 1).detach(), z.detach(), xd.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_temperature_in_row_losses_and_grad_logits(dtype, softcap, temperature):
    """row_losses and grad_logits (and their twins) with LogitTransform(scale, softcap, temperature): loss, lse and
    d(sum_i row_scale_i loss_i)/dx against float64 autograd of the formula, on fresh random logits."""
    rows, vocab, scale = 6, 2048 + 300, 0.8  # two column blocks of the gradient kernel, the second partial
    x = (torch.randn(rows, vocab) * 4).to(dtype)
    target = torch.randint(0, vocab, (rows,))
    row_scale = torch.rand(rows) + 0.5
    grad_scale = 3.0
    options = dict(label_smoothing=0.1, z_loss=1e-3)
    loss, lse, grad = _loss_reference(x, target, row_scale * grad_scale, scale=scale, softcap=softcap,
                                      temperature=temperature, **options)
    transform = LogitTransform(scale=scale, softcap=softcap, temperature=temperature)
    terms = LossTerms(vocab_size=vocab, **options)
    grad_tol = 1e-5 if dtype == torch.float32 else 8e-3  # the gradient is stored in the logits dtype
    for losses_fn, grad_fn in ((row_losses, grad_logits), (torch_backend.row_losses, torch_backend.grad_logits)):
        got_loss, got_lse = torch.full((2, rows), float("nan")).unbind(0)
        losses_fn(x, target, got_loss, got_lse, transform=transform, terms=terms)
        assert rel_err(got_loss, loss) < 1e-5, losses_fn.__module__
        assert rel_err(got_lse, lse) < 1e-6, losses_fn.__module__
        got_grad = torch.full_like(x, float("nan"))  # poisoned: every element must be written
        grad_fn(x, got_grad, target, got_lse, transform=transform, terms=terms, grad_scale=grad_scale,
                row_scale=row_scale)
        assert torch.isfinite(got_grad).all(), grad_fn.__module__
        assert rel_err(got_grad, grad) < grad_tol, (grad_fn.__module__, rel_err(got_grad, grad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_temperature_in_token_stats_and_token_grad_logits(dtype, softcap, temperature):
    """token_stats and token_grad_logits (and their twins) with a temperature: logprob, entropy, lse, argmax and
    d(sum a * logprob + b * entropy)/dx against float64 of the formula, on fresh random logits."""
    rows, vocab, scale = 6, 2048 + 300, 0.8
    x = (torch.randn(rows, vocab) * 4).to(dtype)
    target = torch.randint(0, vocab, (rows,))
    a, b = torch.randn(rows), torch.randn(rows)
    logprob, entropy, lse, z, grad = _token_reference(x, target, a, b, scale=scale, softcap=softcap,
                                                      temperature=temperature)
    transform = LogitTransform(scale=scale, softcap=softcap, temperature=temperature)
    grad_tol = 1e-5 if dtype == torch.float32 else 8e-3
    for stats_fn, grad_fn in ((token_stats, token_grad_logits),
                              (torch_backend.token_stats, torch_backend.token_grad_logits)):
        got = torch.full((3, rows), float("nan")).unbind(0)  # poisoned: every row must be written
        argmax = torch.full((rows,), -7, dtype=torch.int64)
        stats_fn(x, target, *got, argmax, transform=transform)
        for name, have, want in zip(("logprob", "entropy", "lse"), got, (logprob, entropy, lse)):
            assert rel_err(have, want) < 1e-5, (stats_fn.__module__, name)
        _assert_argmax(argmax, z, stats_fn.__module__)
        got_grad = torch.full_like(x, float("nan"))
        grad_fn(x, got_grad, target, got[2], got[1], a, b, transform=transform)
        assert torch.isfinite(got_grad).all(), grad_fn.__module__
        assert rel_err(got_grad, grad) < grad_tol, (grad_fn.__module__, rel_err(got_grad, grad))


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("temperature", [1.0] + TEMPERATURES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logit_transform_apply_and_chain_against_float64_autograd(softcap, temperature, dtype):
    """The PyTorch twin: ``apply`` gives fp32 z (and tanh(.) with a softcap) of the formula; ``chain`` turns d/dz
    into d/dx = float64 autograd of sum(g * z), times grad_scale and a per-row scale, in place."""
    scale = 0.8
    x = (torch.randn(5, 1000) * 4).to(dtype)
    x[0, :4] = torch.tensor([0.0, 1e-6, 60.0, -60.0], dtype=dtype)  # zero, tiny, and saturated arguments
    transform = LogitTransform(scale=scale, softcap=softcap, temperature=temperature)
    xd = x.double().requires_grad_(True)
    z64 = _z_temperature(xd, scale, softcap, temperature)
    grad_z = torch.randn(x.shape)
    row_scale = torch.rand(5) + 0.5
    want = torch.autograd.grad(z64, xd, grad_z.double() * 0.25 * row_scale.double()[:, None], retain_graph=True)[0]
    want_unscaled = torch.autograd.grad(z64, xd, grad_z.double())[0]

    z, capped = transform.apply(x)
    assert z.dtype == torch.float32
    assert rel_err(z, z64.detach()) < 1e-6
    assert (z - z64.detach()).abs().max() <= 4 * torch.finfo(torch.float32).eps * z64.detach().abs().max()
    if softcap is None:
        assert capped is None
    else:
        assert rel_err(capped, torch.tanh(scale * x.double() / softcap)) < 1e-6
        assert capped.abs().max() <= 1.0
    d_z = grad_z.clone()
    d_x = transform.chain(d_z, capped, 0.25, row_scale)
    assert d_x.data_ptr() == d_z.data_ptr()  # in place on grad_z
    assert rel_err(d_x, want) < 1e-6, rel_err(d_x, want)
    # without a gradient scale: the plain chain rule
    assert rel_err(transform.chain(grad_z.clone(), capped), want_unscaled) < 1e-6
