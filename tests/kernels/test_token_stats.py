"""token_stats and token_grad_logits (Triton, interpreted on CPU) and their PyTorch twins against float64 torch:
log_softmax, Categorical entropy, logsumexp, argmax, and autograd of sum(a * logprob + b * entropy)."""
import importlib

import pytest
import torch

from fused_lm_loss import torch_backend
from fused_lm_loss.transform import LogitTransform

from ..conftest import interpreter_numpy_warnings, requires_exact_fma, requires_triton
from ..reference import rel_err

pytestmark = [requires_triton, interpreter_numpy_warnings]
from fused_lm_loss.kernels import token_grad_logits, token_stats  # noqa: E402

token_stats_module = importlib.import_module("fused_lm_loss.kernels.token_stats")
NEG_INF = float("-inf")
LOGIT_SCALE = 0.7
STATS = (token_stats, torch_backend.token_stats)
GRADS = (token_grad_logits, torch_backend.token_grad_logits)


def _z(logits, logit_scale, softcap):
    z = logits.double() * logit_scale
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def _float64(logits, target, a=None, b=None, *, logit_scale=LOGIT_SCALE, softcap=None):
    """(logprob, entropy, lse, argmax) and d(sum a * logprob + b * entropy)/d(logits), float64 torch."""
    x = logits.double().requires_grad_(True)
    z = _z(x, logit_scale, softcap)
    logprob = torch.log_softmax(z, 1).gather(1, target[:, None]).squeeze(1)
    # the entropy is shift-invariant: both forms take z less its row max, so that neither cancels lse against
    # sum p z at |z| ~ 1e7, where float64's rounding of each (~1e-9) would decide the comparison below
    row_max = z.detach().amax(1, keepdim=True)
    shifted = z - torch.where(torch.isfinite(row_max), row_max, 0.0)
    entropy = torch.distributions.Categorical(logits=shifted.detach(), validate_args=False).entropy()
    # Categorical's own backward overflows at -inf logits (it clamps them to the most negative float64, times a
    # weight > 1 = -inf, times p = 0 = NaN): differentiate lse - sum p z with -inf logits' z taken as 0 instead
    differentiable_entropy = (torch.logsumexp(shifted, 1)
                              - (torch.softmax(shifted, 1) * torch.where(shifted.isinf(), 0.0, shifted)).sum(1))
    torch.testing.assert_close(differentiable_entropy.detach(), entropy, rtol=1e-9, atol=1e-9, equal_nan=True)
    objective = z.new_zeros(())
    if a is not None:
        objective = objective + (a.double() * logprob).sum()
    if b is not None:
        objective = objective + (b.double() * differentiable_entropy).sum()
    grad = torch.autograd.grad(objective, x)[0] if objective.requires_grad else torch.zeros_like(x)
    return logprob.detach(), entropy.detach(), torch.logsumexp(z, 1).detach(), z.detach().argmax(1), grad


def _run_stats(impl, logits, target, *, logit_scale=LOGIT_SCALE, softcap=None, argmax=True):
    rows = logits.shape[0]
    logprob, entropy, lse = torch.full((3, rows), 123.0).unbind(0)  # poisoned: every row must be written
    arg = torch.full((rows,), -7, dtype=torch.int64) if argmax else None
    impl(logits, target, logprob, entropy, lse, arg, transform=LogitTransform(scale=logit_scale, softcap=softcap))
    return logprob, entropy, lse, arg


def _assert_matches(actual, expected, tol, what):
    """NaN, +inf and -inf exactly where expected has them; finite values within tol (relative to the largest)."""
    actual, expected = actual.double().cpu(), expected.double().cpu()
    finite = torch.isfinite(expected)
    scale = expected[finite].abs().max().item() if finite.any() else 1.0
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * scale, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


def _assert_argmax(got, z, what, tol=1e-5):
    """got is the float64 argmax of z where the row's maximum is clear by tol; where fp32 cannot tell the top
    values apart (a saturated softcap: tanh rounds to 1), got's z is within tol of the maximum."""
    top = z.topk(min(2, z.shape[1]), dim=1).values
    slack = tol * top[:, 0].abs().clamp(min=1)
    clear = (top[:, 0] - top[:, -1] > slack) | (z.shape[1] == 1) | z.isinf().all(1)
    assert torch.equal(got[clear], z.argmax(1)[clear]), what
    assert (z.gather(1, got[:, None]).squeeze(1)[~clear] >= (top[:, 0] - slack)[~clear]).all(), what


def _random_logits(rows, vocab, dtype):
    """std-4 logits on a grid of 1/8 (exact in every dtype): near-ties of the maximum are exact ties, the same in
    fp32 and float64, so that argmax has one right answer."""
    return (torch.round(torch.randn(rows, vocab) * 32) / 8).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 300, 2500])  # one element, one block, two blocks of the online loop
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("segment_cols", [None, 256])  # None: the default (one segment here); 256: up to 10
def test_token_stats_against_float64(dtype, vocab, softcap, segment_cols, monkeypatch):
    if segment_cols is not None:
        monkeypatch.setattr(token_stats_module, "SEGMENT_COLS", segment_cols)
    rows = 6
    logits = _random_logits(rows, vocab, dtype)
    target = torch.randint(0, vocab, (rows,))
    target[1] = vocab - 1  # in the last segment
    logits[2, -1] += 20  # one row's maximum in the last segment: the merge must rescale the others
    logits[3] += 50  # large logits
    logits[4, : vocab // 2] -= 40  # probability mass only in the second half
    logprob, entropy, lse, _, _ = _float64(logits, target, softcap=softcap)
    for impl in STATS:
        got = _run_stats(impl, logits, target, softcap=softcap)
        for name, have, want in zip(("logprob", "entropy", "lse"), got, (logprob, entropy, lse)):
            assert have.dtype == torch.float32
            assert rel_err(have, want) < 1e-5, (impl.__module__, name)
        _assert_argmax(got[3], _z(logits, LOGIT_SCALE, softcap), impl.__module__)


@requires_exact_fma
def test_token_stats_entropy_of_large_logits_is_accurate():
    """The kernel's entropy = log s - w / s relative to the row maximum: no cancellation of lse against the mean
    logit at z ~ 1000 (in fp32 lse - E[z] is off by ~6e-5 there, more than a confident row's entropy), and
    logprob = (z_t - m) - log s does not round through lse."""
    logits = torch.randn(4, 3000) * 0.05 + 1000.0
    logits[1, 7] += 12.0  # a confident row: entropy ~ 0.1
    logits[2, 7] += 25.0  # entropy ~ 1e-6 (s = 1 + 4e-8 rounds to 1: log s is lost, 4e-8)
    target = torch.tensor([0, 7, 7, 2999])
    logprob, entropy, lse, _, _ = _float64(logits, target, logit_scale=1.0)
    assert entropy[2] < 2e-6
    got_logprob, got_entropy, got_lse, _ = _run_stats(token_stats, logits, target, logit_scale=1.0)
    # absolute slack: one fp32 ulp of s ~ 1 (1.2e-7), which log s inherits (the GPU's exp rounds differently)
    assert ((got_entropy - entropy).abs() <= 1e-5 * entropy + 1.2e-7).all(), got_entropy - entropy
    assert (got_logprob - logprob).abs().max() < 1e-5
    assert rel_err(got_lse, lse) < 1e-7


@pytest.mark.parametrize("impl", [pytest.param(token_stats, marks=requires_exact_fma), torch_backend.token_stats])
def test_token_stats_of_huge_logits_are_finite(impl):
    """Logits past |z| ~ 1.5e9, where fl(m LOG2E) is off from m LOG2E by >= 128 (2^128 overflows fp32), and past
    2^24 / LOG2E, where the reference's integer correction starts: what float64 gives, to fp32 resolution."""
    torch.manual_seed(0)
    logits = torch.randn(5, 700) * 1e9
    logits[1] = -3e9
    logits[1, [3, 50, 400, 699]] = 3000448000.0  # four exact ties on top (entropy log 4), fl(z LOG2E) off by 255.7
    logits[2] *= 1e21
    logits[3] = 2e7 + 2.0 * torch.randint(0, 4, (700,))  # magnitude 2e7, steps of one ulp's 2: a real entropy
    logits[4] = -logits[3]
    target = torch.randint(0, 700, (5,))
    target[1] = 50
    logprob, entropy, lse, argmax, _ = _float64(logits, target, logit_scale=1.0)
    got = _run_stats(impl, logits, target, logit_scale=1.0)
    for name, have, want in zip(("logprob", "entropy", "lse"), got, (logprob, entropy, lse)):
        assert torch.isfinite(have).all(), (name, have)
        # one fp32 ulp of each row's largest |z| (lse, logprob); entropy, a difference of logits, to 1e-5
        ulp = 2.0 ** (torch.frexp(logits.abs().amax(1)).exponent - 23).double()
        slack = 1e-5 if name == "entropy" else 2 * ulp
        assert ((have.double() - want).abs() <= slack).all(), (name, have, want)
    assert torch.equal(got[3], argmax)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("segment_cols", [None, 256])
def test_token_stats_argmax_ties_take_the_lowest_column(dtype, segment_cols, monkeypatch):
    """Ties within a block, across blocks of a segment, across segments; all equal; all -inf; no argmax asked."""
    if segment_cols is not None:
        monkeypatch.setattr(token_stats_module, "SEGMENT_COLS", segment_cols)
    rows, vocab = 9, 2500
    logits = (torch.rand(rows, vocab) * 4).to(dtype)
    ties = {0: [5, 200], 1: [2100, 2200], 2: [10, 2100], 3: [300, 700], 6: [999, 1500], 7: [2499], 8: [1, 2, 2400]}
    for row, columns in ties.items():
        logits[row, columns] = 9.0
    logits[4] = 1.25  # all equal: column 0
    logits[5] = NEG_INF  # all -inf: column 0, as torch.argmax
    logits[6, :999] = NEG_INF
    logits[6, 1000:1500] = NEG_INF
    target = torch.zeros(rows, dtype=torch.int64)
    expected = torch.tensor([5, 2100, 10, 300, 0, 0, 999, 2499, 1])
    assert torch.equal(logits.double().argmax(1), expected)
    for softcap in (None, 3.0):
        for impl in STATS:
            got = _run_stats(impl, logits, target, softcap=softcap)
            assert torch.equal(got[3], expected), (impl.__module__, softcap)
            without = _run_stats(impl, logits, target, softcap=softcap, argmax=False)
            for a, b in zip(got[:3], without[:3]):  # the statistics do not depend on the argmax being asked for
                torch.testing.assert_close(a, b, rtol=1e-6, atol=0, equal_nan=True)
            assert without[3] is None


def test_token_stats_merges_more_segments_than_one_block(monkeypatch):
    """75 segments of 8 columns per row, merged 64 at a time: maxima, ties and -inf across that boundary."""
    monkeypatch.setattr(token_stats_module, "SEGMENT_COLS", 8)
    rows, vocab = 5, 600
    logits = _random_logits(rows, vocab, torch.bfloat16)
    logits[0, 590] = 40.0  # the maximum in the second block of segments
    logits[1, [100, 595]] = 40.0  # tie across the boundary: the first block's
    logits[2, :520] = NEG_INF  # the first block of 64 segments all -inf
    logits[3, 520:] = NEG_INF  # the second block all -inf
    target = torch.tensor([590, 3, 599, 0, 300])
    logprob, entropy, lse, argmax, _ = _float64(logits, target)
    for impl in STATS:
        got = _run_stats(impl, logits, target)
        for name, have, want in zip(("logprob", "entropy", "lse"), got, (logprob, entropy, lse)):
            _assert_matches(have, want, 1e-5, (impl.__module__, name))
        assert torch.equal(got[3], argmax), impl.__module__


def _masked_logits(vocab, dtype):
    """One row per -inf case (vocab > 2048: two blocks of the online loop)."""
    rows = 8
    logits = _random_logits(rows, vocab, torch.float32)
    target = torch.randint(0, vocab, (rows,))
    # 0: no -inf (control)
    logits[1, :2048] = NEG_INF  # the first block (and first segments) all -inf
    target[1] = 2100
    logits[2, 100:1900] = NEG_INF  # a range aligned to no block or segment
    target[2] = 50
    logits[3] = NEG_INF  # all -inf but the target: logprob 0, entropy 0
    target[3] = 1200
    logits[3, 1200] = 1.5
    logits[4, target[4]] = NEG_INF  # the target logit is -inf: logprob -inf
    logits[5] = NEG_INF  # all -inf: lse -inf, logprob NaN, entropy -inf, argmax 0 (the twin's conventions)
    logits[6] = NEG_INF  # two finite logits, the larger in the last column
    target[6] = 5
    logits[6, 5], logits[6, vocab - 1] = -2.0, 3.0
    logits[7, : vocab - 1] = NEG_INF  # only the last column finite, not the target
    target[7] = 0
    return logits.to(dtype), target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("segment_cols", [None, 512])  # 512: 5 segments, some all -inf
def test_token_stats_with_neg_inf_logits(dtype, softcap, segment_cols, monkeypatch):
    if segment_cols is not None:
        monkeypatch.setattr(token_stats_module, "SEGMENT_COLS", segment_cols)
    vocab = 2048 + 300
    logits, target = _masked_logits(vocab, dtype)
    logprob, entropy, lse, argmax, _ = _float64(logits, target, softcap=softcap)
    if softcap is None:
        # the cases are there; Categorical gives NaN for the all -inf row, whose entropy is lse - 0 = -inf here
        assert logprob[3] == 0 and entropy[3] == 0 and logprob[4] == NEG_INF and logprob[7] == NEG_INF
        assert lse[5] == NEG_INF and torch.isnan(logprob[5]) and torch.isnan(entropy[5]) and argmax[5] == 0
        entropy[5] = NEG_INF
    for impl in STATS:
        got = _run_stats(impl, logits, target, softcap=softcap)
        for name, have, want in zip(("logprob", "entropy", "lse"), got, (logprob, entropy, lse)):
            _assert_matches(have, want, 1e-5, (impl.__module__, name))
        assert torch.equal(got[3], argmax), impl.__module__
        if softcap is None:  # p = 1 at the target: 0 to fp32 round-off (the kernel's s is 2^r 2^-r, r ~ 1e-8)
            assert got[0][3].abs() <= 2.5e-7 and got[1][3].abs() <= 2.5e-7, impl.__module__


@pytest.mark.parametrize("segment_cols", [None, 512])  # 512: the NaN in one of 5 segments
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_token_stats_of_a_row_with_a_nan_logit_are_nan(segment_cols, softcap, monkeypatch):
    """A NaN logit makes its row's log-probability, entropy and lse NaN, as eager's log_softmax: a max that dropped
    the NaN would have made it a zero probability and the row finite (an RL loss silently wrong). Other rows stay."""
    if segment_cols is not None:
        monkeypatch.setattr(token_stats_module, "SEGMENT_COLS", segment_cols)
    logits, target = torch.randn(4, 2348), torch.randint(0, 2348, (4,))
    logits[2, 1500] = float("nan")
    for impl in STATS:
        got = _run_stats(impl, logits, target, softcap=softcap)
        for name, values in zip(("logprob", "entropy", "lse"), got):
            assert values[2].isnan() and values[[0, 1, 3]].isfinite().all(), (impl.__module__, name, values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("segment_cols", [None, 256, 512])  # None: one segment; 256: 10; 512: 5, some all -inf
@pytest.mark.parametrize("masked", [False, True], ids=["finite", "neg_inf"])
@pytest.mark.parametrize("asked", ["both", "mean_logit", "log_sum_sq"])
def test_token_stats_mean_logit_and_log_sum_sq_probs(dtype, softcap, segment_cols, masked, asked, monkeypatch):
    """The optional outputs against float64 torch: z.mean(-1) and log sum softmax(z)^2 (NaN for an all -inf row,
    -inf mean for a row with a -inf logit, as torch); the other outputs are unchanged by asking for them."""
    if segment_cols is not None:
        monkeypatch.setattr(token_stats_module, "SEGMENT_COLS", segment_cols)
    if masked:
        logits, target = _masked_logits(2048 + 300, dtype)
    else:
        logits, target = _random_logits(6, 2500, dtype), torch.randint(0, 2500, (6,))
        logits[2, -1] += 20  # a maximum in the last segment
        logits[3] += 50
    z = _z(logits, LOGIT_SCALE, softcap)
    want_mean, want_sq = z.mean(1), torch.log((torch.softmax(z, 1) ** 2).sum(1))
    rows = logits.shape[0]
    for impl in STATS:
        mean_out, sq_out = torch.full((2, rows), 123.0).unbind(0)
        logprob, entropy, lse = torch.full((3, rows), 123.0).unbind(0)
        impl(logits, target, logprob, entropy, lse, None, transform=LogitTransform(scale=LOGIT_SCALE, softcap=softcap),
             mean_logit_out=mean_out if asked != "log_sum_sq" else None,
             log_sum_sq_out=sq_out if asked != "mean_logit" else None)
        if asked != "log_sum_sq":
            # a mean of values of either sign: its error is relative to the logits' size, not to the mean's
            finite_z = z[torch.isfinite(z)].abs().max().item()
            torch.testing.assert_close(mean_out.double(), want_mean, rtol=0, atol=2e-6 * finite_z, equal_nan=True)
        else:
            assert (mean_out == 123.0).all()
        if asked != "mean_logit":
            _assert_matches(sq_out, want_sq, 1e-5, (impl.__module__, "log_sum_sq"))
        else:
            assert (sq_out == 123.0).all()
        plain = _run_stats(impl, logits, target, softcap=softcap, argmax=False)
        for have, want in zip((logprob, entropy, lse), plain):
            torch.testing.assert_close(have, want, rtol=0, atol=0, equal_nan=True)


def test_token_stats_respects_row_stride():
    """The chunk loop passes row slices of a larger buffer: the kernels must use the row stride."""
    buffer = _random_logits(6, 400, torch.bfloat16)
    view = buffer[:, 30:330]
    target = torch.randint(0, 300, (6,))
    want = _run_stats(torch_backend.token_stats, view.contiguous(), target, softcap=3.0)
    got = _run_stats(token_stats, view, target, softcap=3.0)
    for a, b in zip(got[:3], want[:3]):
        assert rel_err(a, b) < 1e-6
    assert torch.equal(got[3], want[3])


def _weights(rows):
    """Per-row weights a, b: random, some zero, some negative."""
    a, b = torch.randn(rows), torch.randn(rows)
    a[0], b[1] = 0.0, 0.0
    a[2], b[2] = -abs(a[2]) - 0.5, -abs(b[2]) - 0.5
    return a, b


WEIGHTS = ["both", "logprob", "entropy", "none"]


def _select(which, a, b):
    return (a if which in ("both", "logprob") else None), (b if which in ("both", "entropy") else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 300, 2500])  # 2500: two column blocks, the second partial
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("which", WEIGHTS)
def test_token_grad_logits_against_float64(dtype, vocab, softcap, which):
    rows = 5
    logits = _random_logits(rows, vocab, dtype)
    logits[3] += 50  # large logits
    target = torch.randint(0, vocab, (rows,))
    a, b = _select(which, *_weights(rows))
    _, entropy, lse, _, want = _float64(logits, target, a, b, softcap=softcap)
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # the gradient is stored in the logits dtype
    for impl in GRADS:
        out = torch.full_like(logits, float("nan"))  # poisoned: every element must be written
        impl(logits, out, target, lse.float(), entropy.float(), a, b,
             transform=LogitTransform(scale=LOGIT_SCALE, softcap=softcap))
        assert out.dtype == dtype
        assert torch.isfinite(out).all(), impl.__module__
        if which == "none":
            assert (out == 0).all(), impl.__module__
        else:
            assert rel_err(out, want) < tol, (impl.__module__, rel_err(out, want))


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_token_grad_logits_in_place_and_strided(softcap):
    """out may alias the logits (the chunk loop's in-place reuse); both may be row slices of larger buffers."""
    rows, vocab = 4, 300
    buffer = _random_logits(rows, vocab + 50, torch.bfloat16)
    logits = buffer[:, 20 : 20 + vocab]
    target = torch.randint(0, vocab, (rows,))
    a, b = _weights(rows)
    _, entropy, lse, _, want = _float64(logits, target, a, b, softcap=softcap)
    expected = torch.empty(rows, vocab, dtype=torch.bfloat16)
    transform = LogitTransform(scale=LOGIT_SCALE, softcap=softcap)
    torch_backend.token_grad_logits(logits.contiguous(), expected, target, lse.float(), entropy.float(), a, b,
                                    transform=transform)
    before = buffer.clone()
    token_grad_logits(logits, logits, target, lse.float(), entropy.float(), a, b, transform=transform)
    assert torch.equal(buffer[:, :20], before[:, :20]) and torch.equal(buffer[:, 20 + vocab :], before[:, 20 + vocab :])
    assert rel_err(logits, want) < 8e-3
    assert rel_err(logits, expected) < 8e-3
    strided_out = torch.full((rows, vocab + 7), 5.0)[:, 3 : 3 + vocab]  # fp32 output of bf16 logits
    token_grad_logits(before[:, 20 : 20 + vocab], strided_out, target, lse.float(), entropy.float(), a, b,
                      transform=transform)
    assert rel_err(strided_out, want) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("which", WEIGHTS[:3])
def test_token_grad_logits_with_neg_inf_logits(dtype, softcap, which):
    """-inf logits get 0 (p = 0: no 0 * inf), but a -inf target gets a (d logprob / dz_t = 1 - p_t = 1); rows with a
    finite lse match float64 autograd, and the all -inf row gets the twin's NaN (from the a term) or 0 (the b term
    alone)."""
    vocab = 2048 + 300
    logits, target = _masked_logits(vocab, dtype)
    a, b = _select(which, *_weights(8))
    _, _, _, _, want = _float64(logits, target, a, b, softcap=softcap)
    # the statistics as token_stats gives them (the all -inf row: lse -inf, entropy -inf)
    _, entropy, lse, _ = _run_stats(token_stats, logits, target, softcap=softcap, argmax=False)
    finite_rows = [0, 1, 2, 3, 4, 6, 7] if softcap is None else list(range(8))  # softcap: -inf is -c, finite
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    outs = []
    for impl in GRADS:
        out = torch.full_like(logits, 123.0)
        impl(logits, out, target, lse, entropy, a, b, transform=LogitTransform(scale=LOGIT_SCALE, softcap=softcap))
        outs.append(out)
        _assert_matches(out[finite_rows], want[finite_rows], tol, impl.__module__)
        if softcap is None:
            masked = torch.isinf(logits)
            masked[5] = False
            if a is not None:
                for row in (4, 7):  # -inf targets
                    masked[row, target[row]] = False
                    error = abs(out[row, target[row]].item() - a[row].item() * LOGIT_SCALE)
                    assert error <= tol * abs(a[row].item()), impl.__module__
                assert torch.isnan(out[5]).all(), impl.__module__
            else:
                assert (out[5] == 0).all(), impl.__module__
            assert (out[masked] == 0).all(), impl.__module__  # no gradient into a -inf logit
    _assert_matches(outs[0], outs[1].double(), tol, "kernel against twin")
