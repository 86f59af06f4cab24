import os

import torch

# The same suite runs on a GPU (the device tool's H200) with FUSED_LM_LOSS_TEST_DEVICE=cuda. Without a GPU,
# the Triton interpreter runs the kernels on CPU tensors; it must be chosen before triton is first imported
# (importing torch does not import triton).
TEST_DEVICE = os.environ.get("FUSED_LM_LOSS_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu" and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import fused_lm_loss  # noqa: E402

if TEST_DEVICE != "cpu":
    torch.set_default_device(TEST_DEVICE)


def triton_kernels_can_run() -> bool:
    """Triton installed, and either a GPU test run or the interpreter for CPU tensors."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return TEST_DEVICE != "cpu" or os.environ.get("TRITON_INTERPRET") == "1"


requires_triton = pytest.mark.skipif(
    not triton_kernels_can_run(), reason="Triton kernels need triton and a GPU run or TRITON_INTERPRET=1"
)
BACKENDS = ["torch", pytest.param("triton", marks=requires_triton)]


def interpreter_rounds_fma_twice() -> bool:
    """Whether ``tl.fma`` rounds the product before the sum here, as Triton 3.1's interpreter does (a GPU's fma
    rounds once). Probe: (1 + 2^-12)^2 - (1 + 2^-11) is 2^-24 exactly, 0 when the product is rounded first."""
    if TEST_DEVICE != "cpu" or not triton_kernels_can_run():
        return False
    from .kernels.fma_probe import fma_of
    return fma_of(1.0 + 2.0**-12, 1.0 + 2.0**-12, -(1.0 + 2.0**-11)) != 2.0**-24


#: For tests of kernels whose accuracy rests on an exact fma (a rounding residual, kernels/token_stats.py).
requires_exact_fma = pytest.mark.skipif(
    interpreter_rounds_fma_twice(), reason="this Triton interpreter rounds tl.fma twice; a GPU rounds once"
)

#: Tests of -inf, NaN and overflowing logits: the Triton interpreter's numpy warns about exactly what they check
#: (log(0) = -inf for an all -inf row, -inf - -inf, the overflow of tanh's discarded polynomial branch at -inf).
#: A GPU raises nothing.
interpreter_numpy_warnings = pytest.mark.filterwarnings(
    "ignore:overflow encountered:RuntimeWarning",
    "ignore:invalid value encountered:RuntimeWarning",
    "ignore:divide by zero encountered:RuntimeWarning",
)


def pytest_configure(config):
    config.addinivalue_line("markers", "runs_last: run after every other test (it reads what they recorded)")
    if TEST_DEVICE == "cpu" and triton_kernels_can_run():  # record the interpreter's launches for sm90 compiles
        from .kernels import launches

        launches.start_recording()


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.get_closest_marker("runs_last") is not None)  # (a stable sort)


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Run the test once with the PyTorch kernels and once with the Triton kernels (interpreted on CPU)."""
    with fused_lm_loss.use_backend(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fp32_matmuls_stay_fp32():
    """Restore TF32 settings after each test: ``TrainingArguments(torch_compile=True)`` turns TF32 on for the
    whole process on CUDA, and every later fp32 comparison would then measure TF32 round-off (~1e-3)."""
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags[:2]
    torch.set_float32_matmul_precision(flags[2])
