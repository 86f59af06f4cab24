"""The Hopper path's gradient kernel (kernels/grad_from_exp.py, Triton, interpreted on CPU) and its PyTorch twin,
against float64 math on the same E: G = f E after the kernel, for rows whose tiles share one offset (the common case:
only the target column is written) and rows whose tiles have their own (moved to one offset); rows of several
blocks, a tile that straddles two blocks, both tile widths."""
import math

import pytest
import torch

from fused_lm_loss import torch_backend
from fused_lm_loss.exp_epilogue import ExpStats
from fused_lm_loss.loss_terms import LossTerms

from ..conftest import TEST_DEVICE, requires_triton
from ..reference import rel_err

pytestmark = requires_triton
INTERPRETED = TEST_DEVICE == "cpu"  # the Triton interpreter rounds fp32 to bf16 toward zero; the GPU to nearest


def epilogue_outputs(rows: int, vocab: int, tile_n: int, shared: bool):
    """E, k and the target logit as the epilogue writes them, from fresh float64 logits; and the row's lse.
    ``shared``: every tile of a row takes one offset, except row 0's (its max 25 above the rest)."""
    z = torch.randn(rows, vocab, dtype=torch.float64) * 4
    z[0, -1] += 25  # a row whose maximum is in the last tile: every other tile's factor is tiny
    target = torch.randint(0, vocab, (rows,))
    target[1] = -1  # the target class in another vocab shard
    target[2] = vocab - 1
    tiles = z.view(rows, -1, tile_n)
    k = torch.round(tiles.amax(2) / math.log(2))
    if shared:
        k[1:] = k[1:].amax(1, keepdim=True) - 3  # (E up to 2^3.5: an offset below the max, as c_i is)
    e = torch.exp2(tiles / math.log(2) - k[:, :, None]).view(rows, vocab).to(torch.bfloat16)
    target_logit = z.gather(1, target.clamp(min=0)[:, None]).squeeze(1)
    stats = ExpStats(k=k.float(), sum_exp=torch.zeros_like(k, dtype=torch.float32), target_logit=target_logit.float(),
                     tile_n=tile_n)
    return e, stats, target, torch.logsumexp(z, 1)


@pytest.mark.parametrize("vocab, tile_n", [(384, 192), (2304, 192), (2560, 128)])  # one block; two, ragged
@pytest.mark.parametrize("z_loss, row_scaled", [(0.0, False), (1e-3, True)])
@pytest.mark.parametrize("shared", [False, True])
def test_grad_from_exp_against_float64(vocab, tile_n, z_loss, row_scaled, shared):
    from fused_lm_loss.kernels import grad_from_exp

    rows = 6
    e, stats, target, lse64 = epilogue_outputs(rows, vocab, tile_n, shared)
    lse = lse64.float()
    row_scale = torch.rand(rows) + 0.5 if row_scaled else None
    grad_scale = 0.37
    # float64 from the same bf16 E: p = E 2^(k - log2e lse), the target's p from the fp32 target logit
    factor = torch.exp2(stats.k.double() - lse.double()[:, None] / math.log(2)).repeat_interleave(tile_n, 1)
    p = e.double() * factor
    has = target >= 0
    p[has, target[has]] = torch.exp(stats.target_logit.double()[has] - lse.double()[has])
    want = p * (1 + 2 * z_loss * lse.double())[:, None]
    want[has, target[has]] -= 1
    want *= grad_scale * (row_scale.double()[:, None] if row_scaled else 1)
    terms = LossTerms(vocab_size=vocab, z_loss=z_loss)
    for launch in (grad_from_exp, torch_backend.grad_from_exp):
        out = e.clone()
        row_factor = launch(out, target, lse, stats, terms=terms, grad_scale=grad_scale, row_scale=row_scale)
        assert row_factor.shape == (rows,) and row_factor.dtype == torch.float32
        got = row_factor.double()[:, None] * out.double()
        # E moved by exact powers of two; the target column rounded once to bf16: 2^-8 relative at most (2^-7 where
        # the interpreter truncates), so no row's L2 error exceeds it (the rows ruled by one large element included)
        bound = 2**-7 if launch is grad_from_exp and INTERPRETED else 2**-8
        for row in range(rows):
            assert rel_err(got[row], want[row]) <= bound, (launch, row)
        if shared:  # the rows of one offset: only the target column rewritten
            same = torch.ones_like(out, dtype=torch.bool)
            same[has, target[has]] = False
            assert torch.equal(out[1:][same[1:]], e[1:][same[1:]]), launch


def test_a_zero_scale_gives_zero_gradients():
    """grad_scale 0 (a GradScaler's scaling of 0, say): f is 0 and the target column 0, not 0 / 0."""
    from fused_lm_loss.kernels import grad_from_exp

    e, stats, target, lse64 = epilogue_outputs(4, 384, 192, True)
    for launch in (grad_from_exp, torch_backend.grad_from_exp):
        out = e.clone()
        row_factor = launch(out, target, lse64.float(), stats, terms=LossTerms(vocab_size=384), grad_scale=0.0,
                            row_scale=None)
        assert torch.equal(row_factor, torch.zeros(4)) and torch.isfinite(out.float()).all(), launch


def test_a_zero_z_loss_factor_keeps_the_target_gradient():
    """z_loss 0.25 and lse -2: 1 + 2 zl lse is 0, so G is -s at the target and 0 elsewhere; with that 0 inside f
    the target's -s could not be carried (f = 0): f leaves it out there."""
    from fused_lm_loss.kernels import grad_from_exp

    e, stats, target, _ = epilogue_outputs(4, 384, 192, True)
    lse = torch.tensor([-2.0, 1.0, -2.0, 3.0])
    terms = LossTerms(vocab_size=384, z_loss=0.25)
    for launch in (grad_from_exp, torch_backend.grad_from_exp):
        out = e.clone()
        row_factor = launch(out, target, lse, stats, terms=terms, grad_scale=0.5, row_scale=None)
        got = row_factor.double()[:, None] * out.double()
        for row in (0, 2):
            want = torch.zeros(384, dtype=torch.float64)
            if target[row] >= 0:
                want[target[row]] = -0.5
            assert torch.count_nonzero(got[row]) == torch.count_nonzero(want), (launch, row)
            assert rel_err(got[row], want) <= 2**-7, (launch, row)  # (the target column rounded once to bf16)
