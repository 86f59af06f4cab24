"""divergence_rows (Triton, interpreted on CPU) and its PyTorch twin against float64 torch: KL(p_t || p_s),
KL(p_s || p_t) and the generalized JSD of two logits chunks, the student's entropy, and autograd of
sum_i w_i div_i w.r.t. the student's raw logits."""
import inspect
import math

import pytest
import torch

from fused_lm_loss import torch_backend
from fused_lm_loss.transform import LogitTransform

from ..conftest import interpreter_numpy_warnings, requires_exact_fma, requires_triton
from ..reference import rel_err

pytestmark = [requires_triton, interpreter_numpy_warnings]
from fused_lm_loss.kernels import divergence_rows  # noqa: E402

IMPLS = (divergence_rows, torch_backend.divergence_rows)
NEG_INF = float("-inf")
BETAS = [0.0, 1.0, 0.35]
#: (student, teacher) transforms: every side different, with and without softcap
TRANSFORMS = {
    "scale": (LogitTransform(scale=0.7), LogitTransform()),
    "softcap": (LogitTransform(scale=1.3, softcap=3.0, temperature=0.8), LogitTransform(scale=0.9, temperature=0.8)),
    "temperature": (LogitTransform(temperature=2.0), LogitTransform(scale=1.1, softcap=5.0, temperature=2.0)),
}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
#: where the float64 reference puts a -inf logit: exp underflows to exactly 0 (p = 0, p log p = 0 * finite), a
#: softcap's tanh is exactly -1, and autograd stays finite
FLOAT64_NEG_INF = -1e30
#: an fp32 logit whose fl(z LOG2E) is off z LOG2E by -255.7: 2^255.7 overflows fp32
HUGE = 3000448000.0


def _z(x, transform):
    """float64 loss-space logits, written from the definition: softcap * tanh(scale * x / softcap) / temperature."""
    x = x * transform.scale
    if transform.softcap is not None:
        x = transform.softcap * torch.tanh(x / transform.softcap)
    return x / transform.temperature


def _float64(student_logits, teacher_logits, beta, transforms, row_weight=None):
    """(divergence, student entropy, d sum_i w_i div_i / d student_logits, max |finite z|) in float64, from the
    same (rounded) logits the kernels see."""
    student, teacher = transforms
    x_s = student_logits.double().nan_to_num(neginf=FLOAT64_NEG_INF).requires_grad_(True)
    x_t = teacher_logits.double().nan_to_num(neginf=FLOAT64_NEG_INF)
    log_ps, log_pt = torch.log_softmax(_z(x_s, student), 1), torch.log_softmax(_z(x_t, teacher), 1)
    p_s, p_t = log_ps.exp(), log_pt.exp()

    def kl(p, log_p, log_q):
        return (p * (log_p - log_q)).sum(1)

    if beta == 0.0:
        value = kl(p_t, log_pt, log_ps)
    elif beta == 1.0:
        value = kl(p_s, log_ps, log_pt)
    else:
        # log(beta p_t + (1 - beta) p_s), finite where both p are 0 (their stand-in logits are finite)
        log_m = torch.logaddexp(log_pt + math.log(beta), log_ps + math.log1p(-beta))
        value = beta * kl(p_t, log_pt, log_m) + (1.0 - beta) * kl(p_s, log_ps, log_m)
    entropy = -(p_s * log_ps).sum(1)
    weight = torch.ones_like(value) if row_weight is None else row_weight.double()
    grad = torch.autograd.grad((weight * value).sum(), x_s)[0]
    z = torch.cat([_z(student_logits.double(), student), _z(teacher_logits.double(), teacher)], 1)
    z_max = z[torch.isfinite(z)].abs().max().item() if torch.isfinite(z).any() else 0.0
    return value.detach(), entropy.detach(), grad, z_max


def _run(impl, student_logits, teacher_logits, beta, transforms, *, entropy=True, grad_out=None, row_weight=None):
    """(divergence, entropy or None); the outputs poisoned first: every row must be written."""
    rows = student_logits.shape[0]
    divergence = torch.full((rows,), 123.0)
    entropy_out = torch.full((rows,), 123.0) if entropy else None
    impl(student_logits, teacher_logits, divergence, entropy_out, grad_out, row_weight, student=transforms[0],
         teacher=transforms[1], beta=beta)
    return divergence, entropy_out


def _assert_values(got, want, z_max, what):
    """fp32 values against float64: 1e-6 relative, and 1e-6 of the logits' size absolute (a divergence between
    close distributions is small next to the terms it is made of)."""
    assert got.dtype == torch.float32, what
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6 * (1.0 + z_max), msg=lambda m: f"{what}: {m}")


def _assert_grad(got, want, what):
    """fp32: rel_err <= 1e-5; bf16: each element within one bf16 ulp of float64 (rel 8e-3), on an absolute floor of
    1e-5 of the largest."""
    if got.dtype == torch.float32:
        assert rel_err(got, want) <= 1e-5, (what, rel_err(got, want))
    else:
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, rtol=8e-3, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")


def _logits(rows, vocab, dtype, offset=50.0):
    """std-3 logits; row 3 (when there) shifted by ``offset``: large logits (the divergence does not move)."""
    x = torch.randn(rows, vocab) * 3
    if rows > 3:
        x[3] += offset
    return x.to(dtype)


def _row_weight(rows):
    """Random per-row weights, one zero and one negative."""
    w = torch.randn(rows)
    w[0], w[1] = 0.0, -abs(w[1].item()) - 0.5
    return w


def test_signature_matches_the_torch_twin():
    """backends dispatches to either module: the same parameters, positional and keyword-only alike."""
    def parameters(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert parameters(divergence_rows) == parameters(torch_backend.divergence_rows)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("transforms", TRANSFORMS)
@pytest.mark.parametrize("dtypes", ["f32-f32", "bf16-f32", "f32-bf16"])  # student-teacher
@pytest.mark.parametrize("vocab", [1, 300, 2500])  # 2500: two column blocks, the second partial
def test_divergence_rows_against_float64(beta, transforms, dtypes, vocab):
    rows = 5
    student_dtype, teacher_dtype = (DTYPES[name] for name in dtypes.split("-"))
    transforms = TRANSFORMS[transforms]
    student_logits = _logits(rows, vocab, student_dtype)
    teacher_logits = _logits(rows, vocab, teacher_dtype, offset=30.0)
    row_weight = _row_weight(rows)
    value, entropy, grad, z_max = _float64(student_logits, teacher_logits, beta, transforms, row_weight)
    for impl in IMPLS:
        grad_out = torch.full((rows, vocab), float("nan"))  # fp32, poisoned
        got, got_entropy = _run(impl, student_logits, teacher_logits, beta, transforms, grad_out=grad_out,
                                row_weight=row_weight)
        _assert_values(got, value, z_max, (impl.__module__, "divergence"))
        _assert_values(got_entropy, entropy, z_max, (impl.__module__, "entropy"))
        _assert_grad(grad_out, grad, impl.__module__)


GRAD_OUTS = ["none", "f32", "bf16", "in_place_f32", "in_place_bf16"]


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("grad", GRAD_OUTS)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("entropy", [False, True], ids=["no_entropy", "entropy"])
def test_divergence_rows_optional_outputs(beta, grad, weighted, entropy):
    """grad_out None, a separate buffer (fp32 or bf16 from fp32 logits), or the student's logits themselves (every
    logit read before its gradient is written); row_weight None (1) or per row; entropy_out None or given. The
    divergence does not depend on what else is asked."""
    rows, vocab = 4, 2100
    transforms = TRANSFORMS["softcap"]
    student_dtype = torch.bfloat16 if grad == "in_place_bf16" else torch.float32
    student_logits = _logits(rows, vocab, student_dtype)
    teacher_logits = _logits(rows, vocab, torch.float32)
    row_weight = _row_weight(rows) if weighted else None
    value, want_entropy, want_grad, z_max = _float64(student_logits, teacher_logits, beta, transforms, row_weight)
    for impl in IMPLS:
        logits = student_logits.clone()
        grad_out = {"none": None, "f32": torch.full((rows, vocab), float("nan")),
                    "bf16": torch.full((rows, vocab), float("nan"), dtype=torch.bfloat16)}.get(grad, logits)
        got, got_entropy = _run(impl, logits, teacher_logits, beta, transforms, entropy=entropy, grad_out=grad_out,
                                row_weight=row_weight)
        _assert_values(got, value, z_max, impl.__module__)
        if entropy:
            _assert_values(got_entropy, want_entropy, z_max, (impl.__module__, "entropy"))
        else:
            assert got_entropy is None
        if grad_out is None:
            assert torch.equal(logits, student_logits), impl.__module__
        else:
            assert grad_out.dtype == (student_dtype if grad.startswith("in_place") else DTYPES[grad])
            _assert_grad(grad_out, want_grad, (impl.__module__, grad))
        plain, _ = _run(impl, student_logits, teacher_logits, beta, transforms)
        torch.testing.assert_close(got, plain, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("transforms", ["scale", "softcap"])
def test_divergence_rows_respects_row_stride(beta, transforms):
    """The chunk loop passes row slices of larger buffers: both logits, the gradient in place into the student's
    slice (nothing outside it touched), or into a strided fp32 slice of its own."""
    rows, vocab = 4, 300
    transforms = TRANSFORMS[transforms]
    student_buffer = _logits(rows, vocab + 50, torch.bfloat16)
    teacher_buffer = _logits(rows, vocab + 9, torch.float32)
    student_logits, teacher_logits = student_buffer[:, 20 : 20 + vocab], teacher_buffer[:, 9:]
    row_weight = _row_weight(rows)
    value, entropy, grad, z_max = _float64(student_logits, teacher_logits, beta, transforms, row_weight)
    strided_out = torch.full((rows, vocab + 7), 5.0)[:, 3 : 3 + vocab]
    got, got_entropy = _run(divergence_rows, student_logits, teacher_logits, beta, transforms, grad_out=strided_out,
                            row_weight=row_weight)
    _assert_values(got, value, z_max, "divergence")
    _assert_values(got_entropy, entropy, z_max, "entropy")
    _assert_grad(strided_out, grad, "strided fp32")
    before = student_buffer.clone()
    got, got_entropy = _run(divergence_rows, student_logits, teacher_logits, beta, transforms,
                            grad_out=student_logits, row_weight=row_weight)
    assert torch.equal(student_buffer[:, :20], before[:, :20])
    assert torch.equal(student_buffer[:, 20 + vocab :], before[:, 20 + vocab :])
    _assert_values(got, value, z_max, "divergence, in place")
    _assert_values(got_entropy, entropy, z_max, "entropy, in place")
    _assert_grad(student_logits, grad, "in place bf16")


def _masked_logits(vocab, dtype):
    """(student, teacher) with one -inf case a row (vocab > 2048: two blocks)."""
    rows = 6
    student, teacher = _logits(rows, vocab, torch.float32), _logits(rows, vocab, torch.float32)
    # 0: no -inf (control)
    teacher[1, 100:1900] = NEG_INF  # across the block boundary
    student[1, 100:1000] = NEG_INF  # where the teacher is -inf too; 1000:1900 the teacher's alone
    teacher[2, :2048] = NEG_INF  # the first block all -inf on both sides
    student[2, :2048] = NEG_INF
    kept = [5, 2100, vocab - 1]
    teacher[3] = NEG_INF  # the teacher finite in 3 columns only
    teacher[3, kept] = 1.0
    student[3, : vocab // 2] = NEG_INF  # the student in the second half, and at column 5
    student[3, 5] = 2.0
    every_seventh = torch.arange(0, vocab, 7)
    teacher[4, every_seventh] = NEG_INF  # scattered, on both sides
    student[4, every_seventh] = NEG_INF
    teacher[5, student[5].argmax()] = NEG_INF  # the student's likeliest column gets p_t = 0
    return student.to(dtype), teacher.to(dtype)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("softcap", [None, "student", "teacher"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_divergence_rows_with_neg_inf_logits(beta, softcap, dtype):
    """-inf teacher logits (p_t = 0) give finite values and gradients, except KL(p_s || p_t) = +inf in a row where
    p_s > 0 there (the twin's inf, and a gradient that is not finite); -inf student logits where the teacher is -inf
    too carry nothing (gradient exactly 0 there). A softcap maps -inf to -softcap / T: finite; with the teacher's,
    the student's -inf logits face p_t > 0, and KL(p_t || p_s) = +inf with the finite gradient p_s - p_t."""
    vocab = 2048 + 300
    student_logits, teacher_logits = _masked_logits(vocab, dtype)
    transforms = (LogitTransform(scale=0.8, softcap=4.0 if softcap == "student" else None),
                  LogitTransform(scale=1.2, softcap=6.0 if softcap == "teacher" else None))
    row_weight = _row_weight(student_logits.shape[0])
    value, entropy, grad, z_max = _float64(student_logits, teacher_logits, beta, transforms, row_weight)
    z_s, z_t = _z(student_logits.double(), transforms[0]), _z(teacher_logits.double(), transforms[1])
    student_only = (torch.isinf(z_s) & torch.isfinite(z_t)).any(1)  # p_s = 0 < p_t in some column
    teacher_only = (torch.isinf(z_t) & torch.isfinite(z_s)).any(1)  # p_t = 0 < p_s in some column
    assert teacher_only[[1, 3, 5]].all() if softcap != "teacher" else student_only[1:5].all()  # the cases are there
    no_rows = torch.zeros_like(student_only)
    infinite = {0.0: student_only, 1.0: teacher_only}.get(beta, no_rows)
    finite_grad = ~teacher_only if beta == 1.0 else ~no_rows
    value[infinite] = float("inf")  # (the reference's stand-in for -inf makes these ~1e30)
    for impl in IMPLS:
        grad_out = torch.full(student_logits.shape, float("nan"))
        got, got_entropy = _run(impl, student_logits, teacher_logits, beta, transforms, grad_out=grad_out,
                                row_weight=row_weight)
        assert torch.isfinite(got[~infinite]).all() and (got[infinite] == float("inf")).all(), impl.__module__
        assert torch.isfinite(grad_out[finite_grad]).all(), impl.__module__
        assert not torch.isfinite(grad_out[~finite_grad & (row_weight != 0)]).all(1).any(), impl.__module__
        _assert_values(got, value, z_max, (impl.__module__, "divergence"))
        _assert_values(got_entropy, entropy, z_max, (impl.__module__, "entropy"))
        _assert_grad(grad_out[finite_grad], grad[finite_grad], impl.__module__)
        if softcap is None:  # no gradient into a -inf student logit
            assert (grad_out[torch.isinf(student_logits) & finite_grad[:, None]] == 0).all(), impl.__module__


@interpreter_numpy_warnings
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("side", ["student", "teacher"])
def test_a_nan_logit_gives_a_nan_row(beta, side):
    """A NaN logit on either side makes its row's divergence, entropy (student) and gradient NaN, as eager's
    log_softmax would, in both implementations; the other rows are untouched."""
    student_logits, teacher_logits = torch.randn(3, 300), torch.randn(3, 300)
    (student_logits if side == "student" else teacher_logits)[1, 7] = float("nan")
    for impl in IMPLS:
        grad_out = torch.empty(3, 300)
        got, entropy = _run(impl, student_logits, teacher_logits, beta, (LogitTransform(), LogitTransform()),
                            grad_out=grad_out)
        assert got[1].isnan() and got[[0, 2]].isfinite().all(), (impl.__module__, got)
        assert entropy[[0, 2]].isfinite().all() and (entropy[1].isnan() or side == "teacher"), impl.__module__
        assert grad_out[1].isnan().any() and grad_out[[0, 2]].isfinite().all(), impl.__module__


@requires_exact_fma
@pytest.mark.parametrize("beta", BETAS)
def test_divergence_rows_of_close_distributions_is_accurate(beta):
    """Teacher = student + noise of 1e-3..1e-1 (divergences ~1e-7..1e-2), one row at logits ~100: the kernel's
    divergence is a difference of logit differences (E[d] - D, module docstring): within 1e-6 absolute (~2e-7
    measured in the interpreter, the rounding of the two sum-exps), where the terms are ~10 and the generic tolerance
    would allow ~1e-4."""
    rows, vocab = 6, 2500
    transforms = (LogitTransform(), LogitTransform())
    student_logits = torch.randn(rows, vocab) * 3
    student_logits[1] += 100.0
    noise = torch.tensor([1e-3, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1])[:, None]
    teacher_logits = student_logits + noise * torch.randn(rows, vocab)
    value, entropy, grad, z_max = _float64(student_logits, teacher_logits, beta, transforms)
    assert value.max() < 1e-2 and value.min() > 0
    got, got_entropy = _run(divergence_rows, student_logits, teacher_logits, beta, transforms)
    assert (got.double() - value).abs().max() <= 1e-6, got.double() - value
    _assert_values(got_entropy, entropy, z_max, "entropy")
    got, _ = _run(torch_backend.divergence_rows, student_logits, teacher_logits, beta, transforms)
    _assert_values(got, value, z_max, "twin")


@requires_exact_fma  # (the base-2 exponents of logits at 3000 through an fma that rounds twice: ~3e-4 each)
@pytest.mark.parametrize("beta", BETAS)
def test_divergence_rows_of_close_distributions_at_an_offset_is_accurate(beta):
    """Teacher = student + noise + an offset c per row (two models' logits often differ in their mean; the
    softmax does not see it): the divergence, ~5e-3, and its gradient as exact as without the offset. d taken as
    z_t - z_s carried ulp(c) into every column: 5e-2 relative at c = 3000, 7e-4 at c = 30."""
    rows, vocab = 4, 2000
    transforms = (LogitTransform(), LogitTransform())
    student_logits = torch.randn(rows, vocab) * 2
    teacher_logits = student_logits + 0.1 * torch.randn(rows, vocab)
    teacher_logits += torch.tensor([0.0, 30.0, -300.0, 3000.0])[:, None]
    value, _, grad, _ = _float64(student_logits, teacher_logits, beta, transforms)
    for impl in IMPLS:
        grad_out = torch.empty(rows, vocab)
        got, _ = _run(impl, student_logits, teacher_logits, beta, transforms, grad_out=grad_out)
        assert ((got.double() - value).abs() / value).max() <= 2e-4, (impl.__module__, got.double() / value - 1)
        assert rel_err(grad_out, grad) <= 1e-5, impl.__module__


@requires_exact_fma
@pytest.mark.parametrize("beta", BETAS)
def test_divergence_rows_of_huge_logits(beta):
    """Logits at 2e7 (past 2^24 / LOG2E: the base-2 reference's integer correction, online.base2_reference) and at
    3e9, where fl(m LOG2E) is 255.7 off m LOG2E (2^255.7 overflows fp32): what float64 gives, to 1e-5."""
    vocab = 700
    transforms = (LogitTransform(), LogitTransform())
    student_logits, teacher_logits = (2e7 + 2.0 * torch.randint(0, 4, (4, vocab)).float() for _ in range(2))
    student_logits[1], teacher_logits[1] = -student_logits[1], -teacher_logits[1]
    student_logits[2:], teacher_logits[2:] = -3e9, -3e9
    student_logits[2:, [3, 50, 400, 699]] = HUGE  # four exact ties on top; the teacher's three of them
    teacher_logits[2:, [3, 50, 400]] = HUGE
    teacher_logits[3, 699] = HUGE - 256.0  # one ulp below: no mass, no infinity
    value, entropy, grad, _ = _float64(student_logits, teacher_logits, beta, transforms)
    for impl in IMPLS:
        grad_out = torch.full((4, vocab), float("nan"))
        got, got_entropy = _run(impl, student_logits, teacher_logits, beta, transforms, grad_out=grad_out)
        for what, have, want in (("divergence", got, value), ("entropy", got_entropy, entropy), ("grad", grad_out, grad)):
            torch.testing.assert_close(have.double(), want, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{impl.__module__} {what}: {m}")


def test_divergence_rows_checks_its_arguments():
    """No rows: nothing to do; shapes that do not match: a ValueError before any launch."""
    transforms = dict(student=LogitTransform(), teacher=LogitTransform())
    empty = torch.empty(0, 300)
    divergence_rows(empty, empty, torch.empty(0), torch.empty(0), empty, torch.empty(0), beta=0.5, **transforms)
    student, teacher = torch.randn(3, 300), torch.randn(3, 300)
    out = torch.empty(3)
    bad_calls = [
        ((student, torch.randn(3, 301), out, None, None, None), 0.0),  # teacher's vocabulary differs
        ((student, torch.randn(2, 300), out, None, None, None), 0.0),  # teacher's rows differ
        ((student, teacher, torch.empty(4), None, None, None), 0.0),  # divergence_out of another length
        ((student, teacher, out, torch.empty(3, 1), None, None), 0.0),  # entropy_out of another shape
        ((student, teacher, out, None, torch.empty(3, 299), None), 0.0),  # grad_out of another shape
        ((student, teacher, out, None, torch.empty(3, 300), torch.empty(2)), 0.0),  # row_weight of another length
        ((student, teacher, out, None, None, None), 1.5),  # beta outside [0, 1]
        ((torch.randn(3, 600)[:, ::2], teacher, out, None, None, None), 0.0),  # no unit column stride
    ]
    for args, beta in bad_calls:
        with pytest.raises(ValueError, match="divergence_rows"):
            divergence_rows(*args, beta=beta, **transforms)
