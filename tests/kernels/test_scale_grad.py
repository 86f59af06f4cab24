"""The scale-grad kernel (Triton, interpreted on CPU) and its PyTorch twin against torch.mul by the factor as a
Python float (the host path of backward): bitwise, in every dtype, in place and out of place."""
import importlib

import pytest
import torch

from fused_lm_loss import torch_backend

from ..conftest import requires_triton

pytestmark = requires_triton
from fused_lm_loss.kernels import scale_grad  # noqa: E402

scale_grad_module = importlib.import_module("fused_lm_loss.kernels.scale_grad")

IMPLS = [scale_grad, torch_backend.scale_grad]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _factor(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64)


def _expected(x: torch.Tensor, value: float, out_dtype: torch.dtype) -> torch.Tensor:
    return torch.mul(x, value, out=torch.empty(x.shape, dtype=out_dtype))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [1.0, 0.37, 3.0, 1.0 + 2.0**-40, -2.5, 0.0])
def test_in_place_equals_torch_mul(impl, dtype, value):
    x = torch.randn(3, 1000, dtype=torch.float64).to(dtype)
    expected = _expected(x, value, dtype) if value != 1.0 else x.clone()
    impl(x, _factor(value), x)
    assert torch.equal(x, expected)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("dtype", "out_dtype"), [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                                  (torch.float32, torch.float32), (torch.float64, torch.float32)])
@pytest.mark.parametrize("value", [1.0, 0.37, 1e-3])
def test_out_of_place_rounds_once(impl, dtype, out_dtype, value):
    """fp32 gradients (dX, db kept wide) into the input's dtype: the product rounded once, as torch.mul(out=)."""
    x = torch.randn(5, 777, dtype=torch.float64).to(dtype) * 100
    out = torch.full(x.shape, float("nan"), dtype=out_dtype)
    expected = _expected(x, value, out_dtype)
    before = x.clone()
    impl(x, _factor(value), out)
    assert torch.equal(out, expected)
    assert torch.equal(x, before)


def test_programs_walk_several_blocks(monkeypatch):
    """More blocks than programs: each program loops (a grid capped at MAX_PROGRAMS), the tail block masked."""
    monkeypatch.setattr(scale_grad_module, "MAX_PROGRAMS", 3)
    n = 7 * scale_grad_module.BLOCK + 11
    x = torch.randn(n)
    expected = x * 0.5
    scale_grad(x, _factor(0.5), x)
    assert torch.equal(x, expected)


def test_nan_factor_reaches_every_element():
    """A NaN grad_output gives NaN gradients (as the host path's multiply), never the untouched ones."""
    x = torch.randn(100)
    scale_grad(x, _factor(float("nan")), x)
    assert torch.isnan(x).all()


@pytest.mark.parametrize("bad", ["strided_x", "float32_factor", "vector_factor", "shape"])
def test_bad_arguments_raise(bad):
    x, out, factor = torch.randn(8, 10), torch.empty(8, 10), _factor(2.0)
    if bad == "strided_x":
        x = torch.randn(10, 8).t()
    elif bad == "float32_factor":
        factor = factor.float()
    elif bad == "vector_factor":
        factor = torch.ones(2, dtype=torch.float64)
    else:
        out = torch.empty(8, 11)
    with pytest.raises(ValueError, match="scale_grad"):
        scale_grad(x, factor, out)
