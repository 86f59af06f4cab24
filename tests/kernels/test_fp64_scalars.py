"""Float scalars passed as fp64, as torch.compile's Inductor passes Python floats when it re-compiles our
kernels: every kernel casts them to fp32 first, so it compiles (no "Loop-carried variable running_max has
initial type fp32 but is re-assigned to fp64") and all of its math stays fp32.

On CPU the interpreter cannot show it (it runs numpy and checks no types; Python floats arrive as Python
floats), so the first test compiles each kernel for sm90 with an explicit fp64 signature, which needs no GPU
(Triton's frontend), in a subprocess without TRITON_INTERPRET, and reads the Triton IR as written: f64 may
appear only in the signature and in the casts to f32 (and in the call that hands the transform's scalars to
``kernels/transform.transform_scalars``, which casts them). The GPU test runs each launcher under
torch.compile, which launches the Inductor-compiled kernels with fp64 scalars, against eager.

The logit transform's scalars are folded once on the host in float64 (``LogitTransform.kernel_args``:
factor = scale / T, cap = softcap / T, u_per_x = factor / cap), and reach the kernels as those float64 numbers,
rounded to fp32 only at the launch: checked against exact rational arithmetic, and on the launchers' arguments.
"""
import importlib
from fractions import Fraction

import numpy as np

import pytest
import torch

from fused_lm_loss.loss_terms import LossTerms
from fused_lm_loss.transform import LogitTransform

from ..conftest import requires_triton
from .compile_sm90 import run_script

pytestmark = requires_triton

# Each kernel with the constexpr switches that bring in all of its float math.
_COMPILE_AND_READ_IR = r"""
import importlib, json, sys
from tests.kernels.compile_sm90 import frontend_ir

FLOATS = {"factor", "u_per_x", "cap", "grad_scale", "smoothing_per_class", "target_weight", "z_loss"}
POINTERS = {"logits_ptr": "*bf16", "grad_ptr": "*bf16", "grad_lo_ptr": "*bf16", "e_ptr": "*bf16", "target_ptr": "*i64",
            "bias_ptr": "*fp16", "labels_ptr": "*i64", "positions_ptr": "*i64", "targets_ptr": "*i64",
            "summary_ptr": "*i64", "arg_ptr": "*i32"}
DESCRIPTORS = {"h_desc": "tensordesc<fp16[128, 64]>", "w_desc": "tensordesc<fp16[256, 64]>"}
KERNELS = [
    ("row_stats", "_segment_stats_kernel",
     dict(HAS_SOFTCAP=True, HAS_FACTOR=True, NEED_SUM=True, HAS_CLASS_WEIGHT=False, SEGMENT_COLS=16384,
          BLOCK_V=2048)),
    ("row_stats", "_segment_stats_kernel",
     dict(HAS_SOFTCAP=False, HAS_FACTOR=True, NEED_SUM=False, HAS_CLASS_WEIGHT=False, SEGMENT_COLS=16384,
          BLOCK_V=2048)),
    ("row_stats", "_segment_stats_kernel",
     dict(HAS_SOFTCAP=True, HAS_FACTOR=True, NEED_SUM=True, HAS_CLASS_WEIGHT=True, SEGMENT_COLS=16384,
          BLOCK_V=2048)),
    ("row_stats", "_merge_segments_kernel",
     dict(HAS_SUM=True, WRITE_LOSS=True, HAS_CLASS_WEIGHT=False, BASE2=False, BLOCK_ROWS=32, BLOCK_SEGMENTS=8)),
    ("row_stats", "_merge_segments_kernel",
     dict(HAS_SUM=True, WRITE_LOSS=True, HAS_CLASS_WEIGHT=True, BASE2=False, BLOCK_ROWS=32, BLOCK_SEGMENTS=8)),
    ("row_stats", "_merge_segments_kernel",
     dict(HAS_SUM=False, WRITE_LOSS=True, HAS_CLASS_WEIGHT=False, BASE2=True, BLOCK_ROWS=4, BLOCK_SEGMENTS=256)),
    ("grad_logits", "_grad_logits_kernel",
     dict(HAS_SOFTCAP=True, HAS_FACTOR=True, PER_ROW_SCALE=True, SPLIT=True, HAS_CLASS_WEIGHT=False,
          SMOOTH_WEIGHTS=False, BLOCK_V=2048)),
    ("grad_logits", "_grad_logits_kernel",
     dict(HAS_SOFTCAP=False, HAS_FACTOR=True, PER_ROW_SCALE=False, SPLIT=False, HAS_CLASS_WEIGHT=False,
          SMOOTH_WEIGHTS=False, BLOCK_V=2048)),
    ("grad_logits", "_grad_logits_kernel",
     dict(HAS_SOFTCAP=True, HAS_FACTOR=True, PER_ROW_SCALE=True, SPLIT=True, HAS_CLASS_WEIGHT=True,
          SMOOTH_WEIGHTS=True, BLOCK_V=2048)),
    ("grad_from_exp", "_grad_from_exp_kernel", dict(TILE_N=192, SUB_N=64, PER_ROW_SCALE=True, BLOCK_TILES=1024,
                                                    BLOCK_V=2048)),
    ("token_stats", "_token_segment_kernel",
     dict(HAS_SOFTCAP=True, HAS_FACTOR=True, NEED_ARGMAX=True, SEGMENT_COLS=16384, BLOCK_V=2048)),
    ("token_stats", "_token_segment_kernel",
     dict(HAS_SOFTCAP=False, HAS_FACTOR=True, NEED_ARGMAX=False, SEGMENT_COLS=16384, BLOCK_V=2048)),
    ("grad_logits", "_token_grad_kernel",
     dict(HAS_SOFTCAP=True, HAS_FACTOR=True, HAS_LOGPROB=True, HAS_ENTROPY=True, BLOCK_V=2048)),
    ("grad_logits", "_token_grad_kernel",
     dict(HAS_SOFTCAP=False, HAS_FACTOR=True, HAS_LOGPROB=False, HAS_ENTROPY=True, BLOCK_V=2048)),
    ("matmul_stats", "_matmul_stats_kernel",
     dict(HAS_BIAS=True, HAS_FACTOR=True, ROUND_TO_BF16=False, ROUND_TO_FP16=True, HAS_SOFTCAP=True, NEED_SUM=True,
          BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, NUM_PROGRAMS=132)),
    ("matmul_stats", "_matmul_stats_kernel",
     dict(HAS_BIAS=False, HAS_FACTOR=True, ROUND_TO_BF16=False, ROUND_TO_FP16=False, HAS_SOFTCAP=False, NEED_SUM=False,
          BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, NUM_PROGRAMS=132)),
]


results = []
for module, name, constexprs in KERNELS:
    fn = getattr(importlib.import_module("fused_lm_loss.kernels." + module), name)
    signature = {}
    for arg in fn.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in FLOATS:
            signature[arg] = "fp64"
        elif arg.endswith("_desc"):
            signature[arg] = DESCRIPTORS[arg]
        elif arg.endswith("_ptr"):
            signature[arg] = POINTERS.get(arg, "*fp32")
        else:
            signature[arg] = "i32"
    floats = sorted(FLOATS & set(fn.arg_names))
    try:
        text = frontend_ir(fn, signature, constexprs)
    except Exception as error:  # noqa: BLE001
        results.append(dict(kernel=name, floats=floats, error=f"{type(error).__name__}: {error}"))
        continue
    f64_lines = [line.strip() for line in text.splitlines() if "f64" in line]
    # f64 allowed: function signatures, the casts to f32, and calls that take f64 and return no f64 (the scalars
    # handed to kernels/transform.py's transform_scalars, whose body is in this IR too: only its casts)
    math = [line for line in f64_lines if not line.startswith("tt.func") and "arith.truncf" not in line
            and not (" tt.call " in line and "f64" not in line.rsplit("->", 1)[-1])]
    results.append(dict(kernel=name, floats=floats, error=None, f64_math=math))
print("RESULTS " + json.dumps(results))
"""


def test_kernels_compile_with_fp64_scalars_and_compute_in_fp32():
    pytest.importorskip("triton.tools.tensor_descriptor")  # (matmul_stats' TMA descriptors)
    results = run_script(_COMPILE_AND_READ_IR)
    assert len(results) == 16  # every kernel of the script's KERNELS
    for result in results:
        assert result["floats"], result  # the kernel has float scalars, and they were fp64
        assert result["error"] is None, result
        assert result["f64_math"] == [], result


# ---------------------------------------------------------------------------------------------------------------
# The transform's scalars: folded once in float64 on the host, handed to the kernels unrounded.

#: (scale, softcap, temperature)
TRANSFORMS = [
    (1.0, None, 1.0), (0.7, None, 1.0), (0.7, None, 1.9), (0.9, None, 0.9), (1.0, 30.0, 1.0), (0.7, 30.0, 1.0),
    (0.7, 30.0, 0.9), (0.5, 50.0, 0.7), (1 / 3, 7.0, 1.9), (2.5, 3.0, 0.3),
]


def _nearest_fp32(q: Fraction) -> float:
    """The fp32 number nearest to the rational q (exact: compares the neighbours of float(q) rationally)."""
    guess = np.float32(float(q))
    candidates = [guess, np.nextafter(guess, np.float32(np.inf)), np.nextafter(guess, np.float32(-np.inf))]
    return float(min(candidates, key=lambda c: abs(Fraction(float(c)) - q)))


def _ulp64(q: Fraction) -> Fraction:
    return Fraction(np.spacing(abs(float(q))))


@pytest.mark.parametrize("scale, softcap, temperature", TRANSFORMS)
def test_kernel_args_fold_the_transform_once_in_float64(scale, softcap, temperature):
    """factor = scale / T and cap = softcap / T are single float64 divisions (correctly rounded), u_per_x =
    factor / cap within 2 float64 ulps of scale / softcap; each is then the nearest fp32 number to its exact
    value once the launch rounds it. Without a temperature they are scale, softcap and scale / softcap exactly
    (the one host division of u_per_x); a factor that comes out 1 skips the multiply (HAS_FACTOR)."""
    transform = LogitTransform(scale=scale, softcap=softcap, temperature=temperature)
    args = transform.kernel_args()
    assert len(args) == 3 and all(type(value) is float for value in args), args  # Python floats: fp64 until launch
    factor, u_per_x, cap = args
    s, t = Fraction(scale), Fraction(temperature)
    assert factor == float(s / t)
    assert _nearest_fp32(Fraction(factor)) == _nearest_fp32(s / t)
    flags = transform.kernel_flags()
    assert flags == {"HAS_SOFTCAP": softcap is not None, "HAS_FACTOR": s / t != 1}, flags
    if softcap is None:
        assert (u_per_x, cap) == (1.0, 1.0)  # unused
    else:
        c = Fraction(softcap)
        assert cap == float(c / t)
        assert abs(Fraction(u_per_x) - s / c) <= 2 * _ulp64(s / c), (u_per_x, float(s / c))
        assert _nearest_fp32(Fraction(cap)) == _nearest_fp32(c / t)
        assert _nearest_fp32(Fraction(u_per_x)) == _nearest_fp32(s / c)
    if temperature == 1.0:
        assert factor == scale and (softcap is None or (cap == softcap and u_per_x == scale / softcap))


class _RecordLaunches:
    """Stands in for a jit kernel: records each launch's arguments by name, then launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append({**dict(zip(self.kernel.arg_names, args)), **kwargs})
            return self.kernel[grid](*args, **kwargs)

        return launch


def _record(monkeypatch, module: str, name: str) -> _RecordLaunches:
    module = importlib.import_module("fused_lm_loss.kernels." + module)
    recorder = _RecordLaunches(getattr(module, name))
    monkeypatch.setattr(module, name, recorder)
    return recorder


@pytest.mark.parametrize("scale, softcap, temperature", [(0.7, 30.0, 0.9), (0.7, None, 1.9), (1.0, 3.0, 1.0)])
def test_launchers_pass_the_float64_scalars_unrounded(scale, softcap, temperature, monkeypatch):
    """Every launcher hands its kernel the transform's (factor, u_per_x, cap) and flags as ``kernel_args`` /
    ``kernel_flags`` give them, and the loss terms' scalars as float64 (eps / V, 1 - eps, z_loss, grad_scale):
    nothing is rounded to fp32 (or folded again) on the host."""
    from fused_lm_loss.kernels import grad_logits, row_losses, row_stats, token_grad_logits, token_stats

    rows, vocab = 3, 300
    transform = LogitTransform(scale=scale, softcap=softcap, temperature=temperature)
    terms = LossTerms(label_smoothing=0.1, z_loss=1e-3, vocab_size=vocab)
    logits = torch.randn(rows, vocab) * 4
    target = torch.randint(0, vocab, (rows,))
    recorders = {
        name: _record(monkeypatch, module, name)
        for module, name in [("row_stats", "_segment_stats_kernel"), ("row_stats", "_merge_segments_kernel"),
                             ("grad_logits", "_grad_logits_kernel"), ("grad_logits", "_token_grad_kernel"),
                             ("token_stats", "_token_segment_kernel")]
    }
    loss, lse = torch.empty(rows), torch.empty(rows)
    row_losses(logits, target, loss, lse, transform=transform, terms=terms)
    row_stats(logits, target, transform=transform, terms=terms)
    grad_logits(logits, torch.empty_like(logits), target, lse, transform=transform, terms=terms, grad_scale=1 / 3,
                row_scale=None)
    logprob, entropy, lse2 = torch.empty(3, rows).unbind(0)
    token_stats(logits, target, logprob, entropy, lse2, None, transform=transform)
    token_grad_logits(logits, torch.empty_like(logits), target, lse2, entropy, torch.ones(rows), torch.ones(rows),
                      transform=transform)
    want = dict(zip(("factor", "u_per_x", "cap"), transform.kernel_args()), **transform.kernel_flags())
    for name in ("_segment_stats_kernel", "_grad_logits_kernel", "_token_grad_kernel", "_token_segment_kernel"):
        launches = recorders[name].launches
        assert launches, name
        for launch in launches:
            got = {key: launch[key] for key in want}
            assert got == want and all(type(launch[key]) is float for key in ("factor", "u_per_x", "cap")), (name, got)
    for name in ("_merge_segments_kernel", "_grad_logits_kernel"):
        for launch in recorders[name].launches:
            assert launch["smoothing_per_class"] == 0.1 / vocab and launch["target_weight"] == 1.0 - 0.1, name
            assert launch["z_loss"] == 1e-3, name
    assert recorders["_grad_logits_kernel"].launches[0]["grad_scale"] == 1 / 3


# ---------------------------------------------------------------------------------------------------------------
# On a GPU: the launchers under torch.compile, whose Inductor launches the re-compiled kernels with fp64 scalars.

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.compile of Triton kernels needs CUDA")


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="inductor")


@requires_cuda
def test_row_losses_and_grad_logits_under_torch_compile():
    from fused_lm_loss.kernels import grad_logits, row_losses, row_stats

    rows, vocab = 6, 3000
    logits = (torch.randn(rows, vocab, device="cuda") * 4).to(torch.bfloat16)
    target = torch.randint(0, vocab, (rows,), device="cuda")
    options = dict(transform=LogitTransform(scale=0.7, softcap=30.0, temperature=0.9),
                   terms=LossTerms(label_smoothing=0.1, z_loss=1e-3, vocab_size=vocab))

    def losses(logits, target):
        loss, lse = torch.empty(rows, device="cuda"), torch.empty(rows, device="cuda")
        row_losses(logits, target, loss, lse, **options)
        return loss, lse

    def grad(logits, target, lse):
        out = torch.empty_like(logits)
        grad_logits(logits, out, target, lse, grad_scale=0.25, row_scale=None, **options)
        return out

    def stats(logits, target):
        return row_stats(logits, target, **options)  # smoothing: with the logit sum

    eager_loss, eager_lse = losses(logits, target)
    got_loss, got_lse = _compiled(losses)(logits, target)
    torch.testing.assert_close(got_loss, eager_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_lse, eager_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(_compiled(grad)(logits, target, eager_lse), grad(logits, target, eager_lse), rtol=0, atol=0)
    for got, want in zip(_compiled(stats)(logits, target), stats(logits, target)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@requires_cuda
def test_matmul_partials_under_torch_compile():
    from fused_lm_loss.kernels import matmul_stats, merge_partials

    hidden = torch.randn(200, 64, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(700, 64, device="cuda", dtype=torch.bfloat16) * 0.5
    if not matmul_stats.supported(hidden, weight):
        pytest.skip("needs a TMA-capable GPU (sm90+) and a Triton with tensor descriptors")
    target = torch.randint(0, 700, (200,), device="cuda")

    def losses(hidden, weight, target):
        partial = matmul_stats.matmul_partials(hidden, weight, None, target, logits_dtype=torch.bfloat16,
                                               transform=LogitTransform(scale=0.7, softcap=30.0), need_sum=True)
        loss, lse = torch.empty(200, device="cuda"), torch.empty(200, device="cuda")
        merge_partials(partial, loss_out=loss, lse_out=lse,
                       terms=LossTerms(label_smoothing=0.1, z_loss=1e-3, vocab_size=700))
        return loss, lse

    for got, want in zip(_compiled(losses)(hidden, weight, target), losses(hidden, weight, target)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@requires_cuda
def test_token_stats_and_token_grad_logits_under_torch_compile():
    from fused_lm_loss.kernels import token_grad_logits, token_stats

    rows, vocab = 6, 3000
    logits = (torch.randn(rows, vocab, device="cuda") * 4).to(torch.bfloat16)
    target = torch.randint(0, vocab, (rows,), device="cuda")
    a, b = torch.randn(rows, device="cuda"), torch.randn(rows, device="cuda")
    transform = LogitTransform(scale=0.7, softcap=30.0, temperature=0.9)

    def stats(logits, target):
        logprob, entropy, lse = (torch.empty(rows, device="cuda") for _ in range(3))
        argmax = torch.empty(rows, dtype=torch.int64, device="cuda")
        token_stats(logits, target, logprob, entropy, lse, argmax, transform=transform)
        return logprob, entropy, lse, argmax

    def grad(logits, target, lse, entropy, a, b):
        out = torch.empty_like(logits)
        token_grad_logits(logits, out, target, lse, entropy, a, b, transform=transform)
        return out

    eager = stats(logits, target)
    for got, want in zip(_compiled(stats)(logits, target), eager):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    lse, entropy = eager[2], eager[1]
    args = (logits, target, lse, entropy, a, b)
    torch.testing.assert_close(_compiled(grad)(*args), grad(*args), rtol=0, atol=0)
