import os

# The same suite runs on a GPU (the device tool's H200) with FUSED_LM_LOSS_TEST_DEVICE=cuda. On CPU the
# Triton interpreter must be chosen before triton is first imported: it lets the kernels run on CPU tensors.
TEST_DEVICE = os.environ.get("FUSED_LM_LOSS_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import fused_lm_loss  # noqa: E402

if TEST_DEVICE != "cpu":
    torch.set_default_device(TEST_DEVICE)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not _triton_available(), reason="no triton"))]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Run the test once with the PyTorch kernels and once with the Triton kernels (interpreted on CPU)."""
    with fused_lm_loss.use_backend(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
