"""The launchers refuse targets that their kernels would misread (they load int64 from a contiguous (rows,)
buffer): another dtype, another shape or length, a non-contiguous view. Checked before any launch."""
import pytest
import torch

from fused_lm_loss.loss_terms import LossTerms
from fused_lm_loss.transform import LogitTransform

from ..conftest import requires_triton

pytestmark = requires_triton
from fused_lm_loss.kernels import (  # noqa: E402
    grad_logits, matmul_stats, row_losses, row_stats, token_grad_logits, token_stats,
)

ROWS, VOCAB = 4, 32


def _bad_targets():
    good = torch.randint(0, VOCAB, (2 * ROWS,))
    return {
        "int32": good[:ROWS].int(),
        "uint8": good[:ROWS].to(torch.uint8),
        "2-d": good[:ROWS].view(ROWS, 1),
        "strided": good[::2],
        "expanded": good[:1].expand(ROWS),
        "too short": good[: ROWS - 1],
        "too long": good,
    }


def _launchers():
    logits = torch.randn(ROWS, VOCAB)
    loss, lse = torch.empty(ROWS), torch.zeros(ROWS)
    transform = LogitTransform()
    losses = dict(transform=transform, terms=LossTerms(vocab_size=VOCAB))
    yield "row_stats", lambda t: row_stats(logits, t, **losses)
    yield "row_losses", lambda t: row_losses(logits, t, loss, lse, **losses)
    yield "grad_logits", lambda t: grad_logits(logits, torch.empty_like(logits), t, lse, grad_scale=1.0,
                                               row_scale=None, **losses)
    stats = torch.empty(3, ROWS)
    yield "token_stats", lambda t: token_stats(logits, t, stats[0], stats[1], stats[2],
                                               torch.empty(ROWS, dtype=torch.int64), transform=transform)
    weights = torch.ones(ROWS)
    yield "token_grad_logits", lambda t: token_grad_logits(logits, torch.empty_like(logits), t, lse, torch.zeros(ROWS),
                                                           weights, weights, transform=transform)
    hidden, weight = torch.randn(ROWS, 64, dtype=torch.float16), torch.randn(VOCAB, 64, dtype=torch.float16)
    if matmul_stats.supported(hidden, weight):
        yield "matmul_partials", lambda t: matmul_stats.matmul_partials(
            hidden, weight, None, t, logits_dtype=torch.float16, transform=transform, need_sum=False)


@pytest.mark.parametrize("case", list(_bad_targets()))
def test_launchers_refuse_bad_targets(case):
    target = _bad_targets()[case]
    names = []
    for name, launch in _launchers():
        names.append(name)
        with pytest.raises(ValueError, match=f"{name}: target must be a contiguous 1-d int64 tensor of {ROWS} rows"):
            launch(target)
    assert {"row_stats", "row_losses", "grad_logits", "token_stats", "token_grad_logits"} <= set(names)


def test_launchers_take_good_targets():
    """The same launches with a contiguous int64 target run (so the refusals above are about the target)."""
    target = torch.randint(0, VOCAB, (ROWS,))
    for _, launch in _launchers():
        launch(target)
