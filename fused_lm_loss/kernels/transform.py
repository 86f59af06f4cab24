"""Triton helpers shared by the kernels: the logit transform (``transform.LogitTransform``) and its chain rule,
and the tanh of its softcap, to fp32 round-off.

Every kernel takes the transform as three scalars, ``LogitTransform.kernel_args()`` = (factor, u_per_x, cap), and
the constexpr flags HAS_SOFTCAP (``transform.has_softcap``) and HAS_FACTOR (factor != 1: the matmul epilogue
skips the multiply)::

    z = cap * tanh(x * u_per_x)          dz/dx = factor * (1 - tanh(x * u_per_x)**2)      (HAS_SOFTCAP)
    z = factor * x                       dz/dx = factor

``loss_space`` gives z (and the tanh, which ``chain_rule`` reads); ``transform_scalars`` casts the three scalars to
fp32 first (torch.compile passes Python floats as fp64, and all math must stay fp32).

``tanh(u)`` has two branches, both computed (they are cheap) and one selected per element:

- ``|u| < TANH_SMALL``: the odd polynomial ``u + u * s * P(s)``, ``s = u*u``, ``P`` of degree 4. Its
  coefficients were fitted here in float64 (minimax of the relative error on (0, TANH_SMALL], by
  Lawson's iteration; ``tests/kernels/test_transform.py`` refits them and checks that these are that fit).
  The fit's relative error is 4.4e-9; evaluated in fp32 the branch is within 0.70 ulp of tanh.
- ``|u| >= TANH_SMALL``: ``1 - 2 / (exp(2|u|) + 1)``. At the branch point 2 / (exp(2|u|) + 1) = 0.45, so
  the error of exp and of the division reaches tanh damped (by 0.8 at the branch point, e^(-2|u|) beyond):
  1.5 ulps with exactly rounded exp and division (the interpreter), 1.8 ulps measured on the H200 (ex2.approx,
  div.full; a dense grid, tests/kernels/test_transform.py). exp(2|u|) = inf gives exactly 1 (so +-inf gives +-1, and the softcap maps -inf to -c); NaN
  stays NaN.

The polynomial is odd in ``u``; the exp branch takes |u| and its sign back by a select. (tanh(-0.0) comes
out +0.0, which no loss, lse or gradient can tell from -0.0.) Written this way the matmul epilogue
(kernels/matmul_stats.py) fits its 128 x 256 tile in registers (copying the sign bit with integer ops spills).
A single formula ``1 - 2 / (exp(2u) + 1)`` would be off by up to ~1e-5 relative near 0 (benchmarks/NOTES.md).

The softcap takes ``tanh(x * u_per_x)`` with ``u_per_x = scale / softcap`` divided once on the host: one multiply
per element instead of a multiply and a division (div.full.f32 on NVIDIA), and one rounding of the argument
instead of two.
"""
import triton
import triton.language as tl

TANH_SMALL = tl.constexpr(0.625)
TWO_LOG2E = tl.constexpr(2.8853900817779268)  # 2 / ln 2: exp(2a) = exp2(a * TWO_LOG2E)
# tanh(u) ~ u + u^3 * (P0 + P1 s + P2 s^2 + P3 s^3 + P4 s^4), s = u^2, on |u| < TANH_SMALL (fitted, see above)
P0 = tl.constexpr(-0.3333328194185074)
P1 = tl.constexpr(0.13331442193643328)
P2 = tl.constexpr(-0.05373971469048181)
P3 = tl.constexpr(0.020639085894853963)
P4 = tl.constexpr(-0.0057049854167131745)


@triton.jit
def tanh(u):
    """tanh of fp32 ``u``, within a few fp32 ulps (relative) everywhere, exact at +-inf, NaN for NaN."""
    # Odd polynomial in u itself (no sign to restore); Horner with explicit FMAs, so that the accuracy above
    # does not depend on the compiler's FP contraction.
    s = u * u
    poly = tl.fma(s, tl.fma(s, tl.fma(s, tl.fma(s, P4, P3), P2), P1), P0)
    small = tl.fma(u * s, poly, u)
    a = tl.abs(u)
    big = 1.0 - 2.0 / (tl.exp2(a * TWO_LOG2E) + 1.0)
    big = tl.where(u < 0.0, -big, big)
    return tl.where(a < TANH_SMALL, small, big)  # NaN: big, which is NaN


@triton.jit
def transform_scalars(factor, u_per_x, cap):
    """The transform's three scalars as fp32, however they were passed."""
    return tl.cast(factor, tl.float32), tl.cast(u_per_x, tl.float32), tl.cast(cap, tl.float32)


@triton.jit
def loss_space(x, factor, u_per_x, cap, HAS_SOFTCAP: tl.constexpr, HAS_FACTOR: tl.constexpr):
    """(z, t) for fp32 raw logits x: the loss-space logits z, and t = tanh(x * u_per_x) for ``chain_rule`` (x
    itself without a softcap, unused)."""
    if HAS_SOFTCAP:
        t = tanh(x * u_per_x)
        z = cap * t
    elif HAS_FACTOR:
        t = x
        z = x * factor
    else:
        t = x
        z = x
    return z, t


@triton.jit
def chain_rule(grad_z, t, scale, HAS_SOFTCAP: tl.constexpr):
    """d/dx from d/dz: times ``scale`` (the transform's factor, times any gradient scale folded in by the caller),
    and times 1 - t**2 with a softcap (t from ``loss_space``)."""
    grad = grad_z * scale
    if HAS_SOFTCAP:
        grad = grad * (1.0 - t * t)
    return grad
