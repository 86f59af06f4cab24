"""The Hopper epilogue's shared row offset (kernels/row_offset.py, Triton, interpreted on CPU) and its PyTorch twin,
against float64: floor(log2e h . W[target]), a lower bound of the row's max in log2 units; -inf where not finite."""
import math

import pytest
import torch

from fused_lm_loss.kernels.row_offset import row_offset_reference

from ..conftest import BACKENDS


@pytest.mark.parametrize("hidden_size", [40, 1536])  # one block; two, ragged
@pytest.mark.parametrize("backend", BACKENDS)
def test_row_offset_against_float64(hidden_size, backend):
    if backend == "triton":
        from fused_lm_loss.kernels.row_offset import row_offset as launch
    else:
        launch = row_offset_reference
    rows, vocab = 9, 50
    hidden = torch.randn(rows, hidden_size).bfloat16()
    weight = (torch.randn(vocab, hidden_size) * 0.3).bfloat16()
    target = torch.randint(0, vocab, (rows,))
    target[0] = -1  # (another shard's class: column 0 stands in, any logit bounds the max)
    hidden[1, 3] = float("nan")
    weight[target[2], 0] = float("inf")
    z = hidden.double() @ weight.double().T
    exact = z.gather(1, target.clamp(min=0)[:, None]).squeeze(1) / math.log(2)
    got = launch(hidden, weight, target)
    assert got.dtype == torch.float32 and got.shape == (rows,)
    finite = torch.isfinite(exact)
    assert not finite[1] and not finite[2]
    assert torch.equal(got[~finite], torch.full_like(got[~finite], -math.inf))
    assert torch.equal(got[finite], got[finite].floor())
    # floor of the fp32 dot: at most 1 below the float64 value, and not above it beyond fp32 round-off
    assert ((got[finite] - exact[finite]) <= 1e-3).all() and ((exact[finite] - got[finite]) < 1 + 1e-3).all()
    assert (got[finite] <= (z[finite].amax(1) / math.log(2)) + 1e-3).all()  # never above the row's max
