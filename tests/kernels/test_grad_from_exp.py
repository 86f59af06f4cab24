"""The Hopper path's gradient kernel (kernels/grad_from_exp.py, Triton, interpreted on CPU) and its PyTorch twin,
against float64 math on the same E: rows of several blocks, a tile that straddles two blocks, both tile widths."""
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


def epilogue_outputs(rows: int, vocab: int, tile_n: int):
    """E, k and the target logit as the epilogue writes them, from fresh float64 logits; and the row's lse."""
    z = torch.randn(rows, vocab, dtype=torch.float64) * 4
    z[0, -1] += 25  # a row whose maximum is in the last tile: every other tile's factor is tiny
    target = torch.randint(0, vocab, (rows,))
    target[1] = -1  # the target class in another vocab shard
    target[2] = vocab - 1
    tiles = z.view(rows, -1, tile_n)
    k = torch.round(tiles.amax(2) / math.log(2))
    e = torch.exp2(tiles / math.log(2) - k[:, :, None]).view(rows, vocab).to(torch.bfloat16)
    target_logit = z.gather(1, target.clamp(min=0)[:, None]).squeeze(1)
    stats = ExpStats(k=k.float(), sum_exp=torch.zeros_like(k, dtype=torch.float32), target_logit=target_logit.float(),
                     tile_n=tile_n)
    return e, stats, target, torch.logsumexp(z, 1)


@pytest.mark.parametrize("vocab, tile_n", [(384, 192), (2304, 192), (2560, 128)])  # one block; two, ragged
@pytest.mark.parametrize("z_loss, row_scaled", [(0.0, False), (1e-3, True)])
@pytest.mark.parametrize("in_place", [False, True])
def test_grad_from_exp_against_float64(vocab, tile_n, z_loss, row_scaled, in_place):
    from fused_lm_loss.kernels import grad_from_exp

    rows = 6
    e, stats, target, lse64 = epilogue_outputs(rows, vocab, tile_n)
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
        source = e.clone()
        out = source if in_place else torch.empty_like(e)
        launch(source, out, target, lse, stats, terms=terms, grad_scale=grad_scale, row_scale=row_scale)
        # one rounding to bf16: 2^-8 relative at most per element (2^-7 where the interpreter truncates), so no
        # row's L2 error exceeds it: the rows ruled by one large element (the large maximum, a target) included
        bound = 2**-7 if launch is grad_from_exp and INTERPRETED else 2**-8
        for row in range(rows):
            assert rel_err(out[row], want[row]) <= bound, (launch, row)
