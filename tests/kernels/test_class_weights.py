"""Class weights (F.cross_entropy's weight=) in the stats, loss and gradient kernels (Triton, interpreted on
CPU) and their PyTorch twins, against float64 references written here: the loss is
F.cross_entropy(z, target, weight=w, label_smoothing=eps, reduction="none") + z_loss * lse**2, the gradient
its float64 autograd (times per-row scales), the weighted logit sum sum_j w_j z_j.

-inf logits: a class of weight 0 adds nothing to the smoothing sum, even at a -inf logit, where
F.cross_entropy's forward computes 0 * -inf = NaN (its gradient is finite there, and the kernels' gradient
equals it); everything else is what F.cross_entropy gives, NaN and +inf included."""
import importlib

import pytest
import torch
import torch.nn.functional as F

from fused_lm_loss import torch_backend
from fused_lm_loss.loss_terms import LossTerms
from fused_lm_loss.transform import LogitTransform

from ..conftest import interpreter_numpy_warnings, requires_triton
from ..reference import rel_err

pytestmark = [requires_triton, interpreter_numpy_warnings]
from fused_lm_loss.kernels import grad_logits, row_losses, row_stats  # noqa: E402

from .test_neg_inf import _assert_matches  # noqa: E402  (NaN and infinities where expected, finite values close)

row_stats_module = importlib.import_module("fused_lm_loss.kernels.row_stats")
NEG_INF = float("-inf")
LOGIT_SCALE = 0.7


def _class_weights(vocab: int) -> torch.Tensor:
    """Positive weights in (0, 2) and zeros: every 7th class, and one run across a 256-column segment edge."""
    w = torch.rand(vocab) * 2
    w[::7] = 0.0
    w[250:270] = 0.0
    return w


def _loss_space64(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    z = logits.double() * LOGIT_SCALE
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def _reference(logits, target, w, *, softcap, label_smoothing, z_loss, row_scale=None):
    """(loss, lse, d(sum_i row_scale_i loss_i)/d(logits)) in float64: F.cross_entropy with weight= + z-loss."""
    x = logits.double().requires_grad_(True)
    z = x * LOGIT_SCALE
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    lse = torch.logsumexp(z, 1)
    loss = F.cross_entropy(z, target, weight=w.double(), label_smoothing=label_smoothing, reduction="none")
    loss = loss + z_loss * lse**2
    scale = torch.ones_like(lse) if row_scale is None else row_scale.double()
    (loss * scale).sum().backward()
    return loss.detach(), lse.detach(), x.grad


def _inputs(rows: int, vocab: int, dtype: torch.dtype):
    logits = (torch.randn(rows, vocab) * 4).to(dtype)
    target = torch.randint(0, vocab, (rows,))
    w = _class_weights(vocab)
    target[0] = 7  # a class of weight 0: only the smoothing term (and the z-loss) remains
    target[1] = vocab - 1  # in the last segment
    logits[2, -1] += 20  # one row's maximum in the last segment: the merge must rescale the others
    return logits, target, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("segment_cols", [None, 256])  # None: one segment, two blocks of the online loop; 256: 10
def test_row_stats_weighted_sum(dtype, softcap, segment_cols, monkeypatch):
    if segment_cols is not None:
        monkeypatch.setattr(row_stats_module, "SEGMENT_COLS", segment_cols)
    logits, target, w = _inputs(5, 2048 + 300, dtype)
    target[3] = -1  # the target class lives in another vocab shard
    z = _loss_space64(logits, softcap)
    expected_max = z.amax(1)
    expected = {
        "max": expected_max,
        "sumexp": torch.exp(z - expected_max[:, None]).sum(1),
        "target": torch.where(target >= 0, z.gather(1, target.clamp(min=0)[:, None]).squeeze(1), 0.0),
        "sum": (z * w.double()).sum(1),
    }
    terms = LossTerms(label_smoothing=0.1, vocab_size=logits.shape[1], class_weight=w)  # smoothing: the sum
    for impl in (row_stats, torch_backend.row_stats):
        got = impl(logits, target, transform=LogitTransform(scale=LOGIT_SCALE, softcap=softcap), terms=terms)
        for (name, want), have in zip(expected.items(), got):
            assert have.dtype == torch.float32
            assert rel_err(have, want) < 1e-5, (impl.__module__, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("label_smoothing, z_loss", [(0.0, 0.0), (0.2, 1e-2)])  # (the z-loss adds per row)
@pytest.mark.parametrize("segment_cols", [None, 256])
def test_row_losses_with_class_weights(dtype, softcap, label_smoothing, z_loss, segment_cols, monkeypatch):
    if segment_cols is not None:
        monkeypatch.setattr(row_stats_module, "SEGMENT_COLS", segment_cols)
    rows, vocab = 40, 2048 + 300  # more rows than one merge program takes (32)
    logits, target, w = _inputs(rows, vocab, dtype)
    loss, lse, _ = _reference(logits, target, w, softcap=softcap, label_smoothing=label_smoothing, z_loss=z_loss)
    for impl in (row_losses, torch_backend.row_losses):
        got_loss, got_lse = torch.full((2, rows), float("nan")).unbind(0)
        impl(logits, target, got_loss, got_lse, transform=LogitTransform(scale=LOGIT_SCALE, softcap=softcap),
             terms=LossTerms(label_smoothing=label_smoothing, z_loss=z_loss, vocab_size=vocab, class_weight=w))
        assert rel_err(got_loss, loss) < 1e-5, impl.__module__
        assert rel_err(got_lse, lse) < 1e-6, impl.__module__


def test_row_losses_with_class_weights_and_a_target_elsewhere():
    """A target of -1 (its class on another vocab shard) has w_t = 0 in both implementations (the PyTorch twin read
    weight[-1], the last class's): loss = (eps / V)(W lse - sum_j w_j z_j) + z_loss lse^2, in float64."""
    rows, vocab, eps, z_loss = 6, 300, 0.1, 1e-3
    logits, target, w = _inputs(rows, vocab, torch.float32)
    target[[0, 3]] = -1
    z = logits.double() * LOGIT_SCALE
    lse = torch.logsumexp(z, 1)
    w_t = torch.where(target >= 0, w.double()[target.clamp(min=0)], 0.0)
    z_t = z.gather(1, target.clamp(min=0)[:, None]).squeeze(1)
    want = (1 - eps) * w_t * (lse - z_t) + eps / vocab * (w.double().sum() * lse - z @ w.double()) + z_loss * lse**2
    for impl in (row_losses, torch_backend.row_losses):
        got_loss, got_lse = torch.full((2, rows), float("nan")).unbind(0)
        impl(logits, target, got_loss, got_lse, transform=LogitTransform(scale=LOGIT_SCALE),
             terms=LossTerms(label_smoothing=eps, z_loss=z_loss, vocab_size=vocab, class_weight=w))
        assert rel_err(got_loss, want) < 1e-5, impl.__module__


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("label_smoothing, z_loss", [(0.0, 0.0), (0.2, 0.0), (0.2, 1e-2)])
def test_grad_logits_with_class_weights(dtype, softcap, label_smoothing, z_loss):
    rows, vocab = 7, 2048 + 300  # two column blocks, the second partial
    logits, target, w = _inputs(rows, vocab, dtype)
    row_scale = torch.rand(rows) + 0.5
    grad_scale = 3.0
    _, lse, want = _reference(logits, target, w, softcap=softcap, label_smoothing=label_smoothing, z_loss=z_loss,
                              row_scale=row_scale * grad_scale)
    for impl in (grad_logits, torch_backend.grad_logits):
        for per_row in (True, False):
            out = torch.full_like(logits, float("nan"))  # poisoned: every element must be written
            impl(logits, out, target, lse.float(), grad_scale=grad_scale * (1.0 if per_row else 2.0),
                 row_scale=row_scale if per_row else None,
                 transform=LogitTransform(scale=LOGIT_SCALE, softcap=softcap),
                 terms=LossTerms(label_smoothing=label_smoothing, z_loss=z_loss, vocab_size=vocab, class_weight=w))
            expected = want if per_row else want / row_scale[:, None] * 2.0
            assert torch.isfinite(out).all(), impl.__module__
            assert rel_err(out, expected) < (1e-5 if dtype == torch.float32 else 8e-3), (impl.__module__, per_row)


def test_grad_logits_with_class_weights_in_place_split_and_target_elsewhere():
    """out aliasing the logits, the hi + lo split, and target -1 (the class on another vocab shard: w_t = 0,
    only the smoothing and z-loss terms), the kernel against its twin."""
    rows, vocab = 6, 1000
    logits = torch.randn(rows, vocab) * 4
    target = torch.randint(0, vocab, (rows,))
    target[[1, 4]] = -1
    w = _class_weights(vocab)
    lse = torch.logsumexp(logits * LOGIT_SCALE, 1)
    kwargs = dict(grad_scale=0.5, row_scale=None, transform=LogitTransform(scale=LOGIT_SCALE),
                  terms=LossTerms(label_smoothing=0.1, z_loss=1e-3, vocab_size=vocab, class_weight=w))
    want = torch.empty_like(logits)
    torch_backend.grad_logits(logits, want, target, lse, **kwargs)
    p = torch.softmax(logits.double() * LOGIT_SCALE, 1)
    # rows with no target here: dz = p (eps W / V + 2 zl lse) - (eps / V) w
    other_shard = p * (0.1 * w.double().sum() / vocab + 2e-3 * lse.double()[:, None]) - 0.1 / vocab * w.double()
    assert rel_err(want[[1, 4]], 0.5 * LOGIT_SCALE * other_shard[[1, 4]]) < 1e-6
    hi, lo = torch.empty_like(logits, dtype=torch.bfloat16), torch.empty_like(logits, dtype=torch.bfloat16)
    grad_logits(logits, hi, target, lse, out_lo=lo, **kwargs)
    assert rel_err(hi.double() + lo.double(), want) < 2e-5  # ~16 significant bits (test_grad_logits.py)
    in_place = logits.clone()
    grad_logits(in_place, in_place, target, lse, **kwargs)
    assert rel_err(in_place, want) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("label_smoothing, z_loss", [(0.0, 0.0), (0.2, 1e-3)])
@pytest.mark.parametrize("segment_cols", [None, 1024])  # None: one segment; 1024: 5 segments, 2 of them -inf in row 1
def test_class_weights_with_neg_inf_logits(dtype, softcap, label_smoothing, z_loss, segment_cols, monkeypatch):
    if segment_cols is not None:
        monkeypatch.setattr(row_stats_module, "SEGMENT_COLS", segment_cols)
    vocab = 4096 + 37
    logits = torch.randn(8, vocab) * 4
    target = torch.randint(3000, vocab, (8,))
    w = torch.rand(vocab) + 0.5
    w[100:3000] = 0.0  # a masked vocabulary range: weight 0 ...
    # 0: no -inf (control)
    logits[1, 100:3000] = NEG_INF  # ... and -inf logits: finite loss (F.cross_entropy with smoothing: NaN)
    logits[2, 3100:3500] = NEG_INF  # -inf logits of positive weight: +inf with smoothing, as F.cross_entropy
    target[2] = 3050
    logits[3, target[3]] = NEG_INF  # a -inf target of positive weight: +inf
    target[4] = 200  # a target of weight 0 (finite logit): the smoothing term only
    logits[5] = NEG_INF  # the whole row: NaN
    logits[6, 100:3000] = NEG_INF  # the masked range -inf, and the target in it: 0 * inf = NaN, as F.cross_entropy
    target[6] = 150
    logits[7, :3000] = NEG_INF  # -inf logits of weight 0 and of positive weight (0:100): +inf with smoothing
    logits = logits.to(dtype)
    options = dict(softcap=softcap, label_smoothing=label_smoothing, z_loss=z_loss)
    pytorch_loss, lse, grad = _reference(logits, target, w, **options)
    transform = LogitTransform(scale=LOGIT_SCALE, softcap=softcap)
    terms = LossTerms(label_smoothing=label_smoothing, z_loss=z_loss, vocab_size=vocab, class_weight=w)
    # The rows where F.cross_entropy's forward computes 0 * -inf in its smoothing term (softcap makes -inf
    # finite), and what it means: the same formula with those terms 0 (its gradient, finite, already is this
    # loss's gradient)
    zero_weight_neg_inf = [1, 7] if label_smoothing > 0 and softcap is None else []
    if zero_weight_neg_inf:
        assert torch.isnan(pytorch_loss[zero_weight_neg_inf]).all()
        assert torch.isfinite(grad[zero_weight_neg_inf]).all()
    z = _loss_space64(logits, softcap)
    logp = z - lse[:, None]
    smooth = -torch.where(w.double() != 0, w.double() * logp, 0.0).sum(1)
    nll = -w.double()[target] * logp.gather(1, target[:, None]).squeeze(1)
    loss = (1 - label_smoothing) * nll + z_loss * lse**2
    if label_smoothing > 0:  # (no 0 * inf without smoothing)
        loss = loss + label_smoothing / vocab * smooth
    unaffected = [row for row in range(8) if row not in zero_weight_neg_inf]
    _assert_matches(loss[unaffected], pytorch_loss[unaffected], 1e-12, "the reference")
    if softcap is None:  # the cases are there
        assert torch.isnan(loss[[5, 6]]).all() and torch.isinf(loss[3]) and torch.isfinite(loss[1])
        assert torch.isinf(loss[[2, 7]]).all() if label_smoothing > 0 else torch.isfinite(loss[[2, 7]]).all()
    grad_tol = 1e-5 if dtype == torch.float32 else 8e-3
    for losses_fn, grad_fn in ((row_losses, grad_logits), (torch_backend.row_losses, torch_backend.grad_logits)):
        got_loss, got_lse = torch.full((2, 8), 123.0).unbind(0)
        losses_fn(logits, target, got_loss, got_lse, transform=transform, terms=terms)
        _assert_matches(got_loss, loss, 1e-5, (losses_fn.__module__, "loss"))
        _assert_matches(got_lse, lse, 1e-5, (losses_fn.__module__, "lse"))
        got_grad = torch.full_like(logits, 123.0)
        grad_fn(logits, got_grad, target, got_lse, grad_scale=1.0, row_scale=None, transform=transform, terms=terms)
        _assert_matches(got_grad, grad, grad_tol, (grad_fn.__module__, "grad"))


def test_launchers_refuse_class_weights_they_cannot_read():
    logits = torch.randn(3, 50)
    target = torch.randint(0, 50, (3,))
    out = torch.empty(2, 3)
    for bad in (torch.rand(49), torch.rand(50, dtype=torch.float64), torch.rand(100)[::2]):
        terms = LossTerms(label_smoothing=0.1, vocab_size=50, class_weight=bad)
        with pytest.raises(ValueError, match="class_weight"):
            row_losses(logits, target, out[0], out[1], transform=LogitTransform(), terms=terms)
        with pytest.raises(ValueError, match="class_weight"):
            grad_logits(logits, torch.empty_like(logits), target, out[1], grad_scale=1.0, row_scale=None,
                        transform=LogitTransform(), terms=terms)
        with pytest.raises(ValueError, match="class_weight"):
            row_stats(logits, target, transform=LogitTransform(), terms=terms)
