"""The launchers refuse targets that their kernels would misread (they load int64 from a contiguous (rows,)
buffer): another dtype, another shape or length, a non-contiguous view. Checked before any launch. So are the
per-row fp32 vectors (lse, row_scale, loss outputs) and the row-by-row outputs a kernel reads or writes."""
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


def _per_row_cases():
    good = torch.zeros(2 * ROWS)
    return {"strided": good[::2], "too short": good[: ROWS - 1], "fp64": good[:ROWS].double(), "2-d": good.view(2, -1)}


@pytest.mark.parametrize("case", list(_per_row_cases()))
def test_launchers_refuse_bad_per_row_vectors_and_outputs(case):
    """A strided or short lse / row_scale / loss output was read or written as if contiguous and long enough: a
    wrong gradient silently, or an out-of-bounds write; each launcher now raises, naming the argument."""
    from fused_lm_loss.exp_epilogue import ExpStats
    from fused_lm_loss.kernels import grad_from_exp, merge_exp_stats

    bad = _per_row_cases()[case]
    logits, target = torch.randn(ROWS, VOCAB), torch.randint(0, VOCAB, (ROWS,))
    good = torch.zeros(ROWS)
    kw = dict(transform=LogitTransform(), terms=LossTerms(vocab_size=VOCAB))
    grad = dict(kw, grad_scale=1.0)
    stats = ExpStats(k=torch.zeros(ROWS, 1), sum_exp=torch.ones(ROWS, 1), target_logit=torch.zeros(ROWS), tile_n=VOCAB)
    calls = {
        "lse": lambda: grad_logits(logits, torch.empty_like(logits), target, bad, row_scale=None, **grad),
        "row_scale": lambda: grad_logits(logits, torch.empty_like(logits), target, good, row_scale=bad, **grad),
        "loss_out": lambda: row_losses(logits, target, bad, good.clone(), **kw),
        "lse_out": lambda: merge_exp_stats(stats, good.clone(), bad, terms=kw["terms"]),
        "exp lse": lambda: grad_from_exp(logits, target, bad, stats, terms=kw["terms"], grad_scale=1.0,
                                         row_scale=None),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=name.split()[-1]):
            call()
    with pytest.raises(ValueError, match="out"):  # an output of fewer rows: written past its end
        grad_logits(logits, torch.empty(ROWS - 1, VOCAB), target, good, row_scale=None, **grad)
