"""Float scalars passed as fp64, as torch.compile's Inductor passes Python floats when it re-compiles our
kernels: every kernel casts them to fp32 first, so it compiles (no "Loop-carried variable running_max has
initial type fp32 but is re-assigned to fp64") and all of its math stays fp32.

On CPU the interpreter cannot show it (it runs numpy and checks no types; Python floats arrive as Python
floats), so the first test compiles each kernel for sm90 with an explicit fp64 signature, which needs no GPU
(Triton's frontend), in a subprocess without TRITON_INTERPRET, and reads the Triton IR as written: f64 may
appear only in the signature and in the casts to f32. The GPU test runs each launcher under
torch.compile, which launches the Inductor-compiled kernels with fp64 scalars, against eager.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ..conftest import requires_triton

pytestmark = requires_triton

# Each kernel with the constexpr switches that bring in all of its float math.
_COMPILE_AND_READ_IR = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

FLOATS = {"logit_scale", "u_per_x", "softcap", "grad_scale", "smoothing_per_class", "target_weight", "z_loss"}
POINTERS = {"logits_ptr": "*bf16", "grad_ptr": "*bf16", "grad_lo_ptr": "*bf16", "target_ptr": "*i64",
            "bias_ptr": "*fp16", "labels_ptr": "*i64", "positions_ptr": "*i64", "targets_ptr": "*i64",
            "summary_ptr": "*i64", "arg_ptr": "*i32"}
DESCRIPTORS = {"h_desc": "tensordesc<fp16[128, 64]>", "w_desc": "tensordesc<fp16[256, 64]>"}
KERNELS = [
    ("row_stats", "_segment_stats_kernel",
     dict(HAS_SOFTCAP=True, NEED_SUM=True, HAS_CLASS_WEIGHT=False, SEGMENT_COLS=16384, BLOCK_V=2048)),
    ("row_stats", "_segment_stats_kernel",
     dict(HAS_SOFTCAP=False, NEED_SUM=False, HAS_CLASS_WEIGHT=False, SEGMENT_COLS=16384, BLOCK_V=2048)),
    ("row_stats", "_segment_stats_kernel",
     dict(HAS_SOFTCAP=True, NEED_SUM=True, HAS_CLASS_WEIGHT=True, SEGMENT_COLS=16384, BLOCK_V=2048)),
    ("row_stats", "_merge_segments_kernel",
     dict(HAS_SUM=True, WRITE_LOSS=True, HAS_CLASS_WEIGHT=False, BLOCK_ROWS=32, BLOCK_SEGMENTS=8)),
    ("row_stats", "_merge_segments_kernel",
     dict(HAS_SUM=True, WRITE_LOSS=True, HAS_CLASS_WEIGHT=True, BLOCK_ROWS=32, BLOCK_SEGMENTS=8)),
    ("grad_logits", "_grad_logits_kernel",
     dict(HAS_SOFTCAP=True, PER_ROW_SCALE=True, SPLIT=True, HAS_CLASS_WEIGHT=False, SMOOTH_WEIGHTS=False,
          BLOCK_V=2048)),
    ("grad_logits", "_grad_logits_kernel",
     dict(HAS_SOFTCAP=False, PER_ROW_SCALE=False, SPLIT=False, HAS_CLASS_WEIGHT=False, SMOOTH_WEIGHTS=False,
          BLOCK_V=2048)),
    ("grad_logits", "_grad_logits_kernel",
     dict(HAS_SOFTCAP=True, PER_ROW_SCALE=True, SPLIT=True, HAS_CLASS_WEIGHT=True, SMOOTH_WEIGHTS=True,
          BLOCK_V=2048)),
    ("token_stats", "_token_segment_kernel",
     dict(HAS_SOFTCAP=True, NEED_ARGMAX=True, SEGMENT_COLS=16384, BLOCK_V=2048)),
    ("token_stats", "_token_segment_kernel",
     dict(HAS_SOFTCAP=False, NEED_ARGMAX=False, SEGMENT_COLS=16384, BLOCK_V=2048)),
    ("grad_logits", "_token_grad_kernel",
     dict(HAS_SOFTCAP=True, HAS_LOGPROB=True, HAS_ENTROPY=True, BLOCK_V=2048)),
    ("grad_logits", "_token_grad_kernel",
     dict(HAS_SOFTCAP=False, HAS_LOGPROB=False, HAS_ENTROPY=True, BLOCK_V=2048)),
    ("matmul_stats", "_matmul_stats_kernel",
     dict(HAS_BIAS=True, HAS_SCALE=True, ROUND_TO_BF16=False, ROUND_TO_FP16=True, HAS_SOFTCAP=True, NEED_SUM=True,
          BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, NUM_PROGRAMS=132)),
    ("matmul_stats", "_matmul_stats_kernel",
     dict(HAS_BIAS=False, HAS_SCALE=True, ROUND_TO_BF16=False, ROUND_TO_FP16=False, HAS_SOFTCAP=False, NEED_SUM=False,
          BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, NUM_PROGRAMS=132)),
]


def frontend_ir(fn, signature, constexprs):
    # The kernel's Triton IR as its frontend writes it (where loop-carried types are checked), before any
    # pass; the full compile's TTIR when this Triton's internals differ.
    import inspect

    from triton._C.libtriton import ir
    from triton.compiler.compiler import make_backend

    source = ASTSource(fn, signature, constexprs=constexprs)
    target = GPUTarget("cuda", 90, 32)
    try:
        backend = make_backend(target)
        options = backend.parse_options({})
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        available = dict(target=target, options=options, codegen_fns=backend.get_codegen_implementation(options),
                         module_map=backend.get_module_map(), context=context)
        parameters = inspect.signature(source.make_ir).parameters
        make_ir = lambda: source.make_ir(**{name: available[name] for name in parameters})  # noqa: E731
    except (AttributeError, KeyError, TypeError):
        return triton.compile(source, target=target).asm["ttir"]
    return str(make_ir())


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
    math = [line for line in f64_lines if not line.startswith("tt.func") and "arith.truncf" not in line]
    results.append(dict(kernel=name, floats=floats, error=None, f64_math=math))
print("RESULTS " + json.dumps(results))
"""


def _triton_compiles_for_sm90_here() -> str | None:
    """Why the compile test cannot run with this Triton, or None."""
    try:
        import inspect

        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError as error:
        return f"this Triton lacks {error.name}"
    if "constexprs" not in inspect.signature(ASTSource).parameters:
        return "this Triton's ASTSource predates the constexprs= signature (triton < 3.3)"
    return None


def test_kernels_compile_with_fp64_scalars_and_compute_in_fp32():
    reason = _triton_compiles_for_sm90_here()
    if reason:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, "-c", _COMPILE_AND_READ_IR], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULTS ")]
    if run.returncode != 0 or not lines:
        pytest.fail(f"the compile script failed:\n{run.stderr[-4000:]}")
    results = json.loads(lines[0][len("RESULTS "):])
    assert len(results) == 14
    for result in results:
        assert result["floats"], result  # the kernel has float scalars, and they were fp64
        assert result["error"] is None, result
        assert result["f64_math"] == [], result


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
    options = dict(logit_scale=0.7, softcap=30.0, label_smoothing=0.1, z_loss=1e-3, vocab_size=vocab)

    def losses(logits, target):
        loss, lse = torch.empty(rows, device="cuda"), torch.empty(rows, device="cuda")
        row_losses(logits, target, loss, lse, **options)
        return loss, lse

    def grad(logits, target, lse):
        out = torch.empty_like(logits)
        grad_logits(logits, out, target, lse, grad_scale=0.25, row_scale=None, **options)
        return out

    def stats(logits, target):
        return row_stats(logits, target, logit_scale=0.7, softcap=30.0, need_sum=True)

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
                                               logit_scale=0.7, softcap=30.0, need_sum=True)
        loss, lse = torch.empty(200, device="cuda"), torch.empty(200, device="cuda")
        merge_partials(partial, need_sum=True, loss_out=loss, lse_out=lse, label_smoothing=0.1, z_loss=1e-3, vocab_size=700)
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

    def stats(logits, target):
        logprob, entropy, lse = (torch.empty(rows, device="cuda") for _ in range(3))
        argmax = torch.empty(rows, dtype=torch.int64, device="cuda")
        token_stats(logits, target, logprob, entropy, lse, argmax, logit_scale=0.7, softcap=30.0)
        return logprob, entropy, lse, argmax

    def grad(logits, target, lse, entropy, a, b):
        out = torch.empty_like(logits)
        token_grad_logits(logits, out, target, lse, entropy, a, b, logit_scale=0.7, softcap=30.0)
        return out

    eager = stats(logits, target)
    for got, want in zip(_compiled(stats)(logits, target), eager):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    lse, entropy = eager[2], eager[1]
    args = (logits, target, lse, entropy, a, b)
    torch.testing.assert_close(_compiled(grad)(*args), grad(*args), rtol=0, atol=0)
