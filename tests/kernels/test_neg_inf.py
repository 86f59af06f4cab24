"""-inf logits (masked vocabulary ranges, -inf biases) through every kernel and PyTorch twin, against
F.cross_entropy and autograd in float64 on the same logits: finite where PyTorch is finite, +inf where it
gives +inf (a -inf target logit; label smoothing over any -inf logit), NaN where it gives NaN (a row that
is all -inf; label smoothing 1 with a -inf target, 0 * inf)."""
import importlib

import pytest
import torch
import torch.nn.functional as F

from fused_lm_loss import torch_backend
from fused_lm_loss.loss_terms import LossTerms
from fused_lm_loss.transform import LogitTransform

from ..conftest import interpreter_numpy_warnings, requires_triton

pytestmark = [requires_triton, interpreter_numpy_warnings]
from fused_lm_loss.kernels import grad_logits, matmul_stats, merge_partials, row_losses, row_stats  # noqa: E402

row_stats_module = importlib.import_module("fused_lm_loss.kernels.row_stats")
NEG_INF = float("-inf")


def _masked_logits(vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One row per case (vocab > 4096: the kernels' blocks are 2048 columns)."""
    logits = torch.randn(9, vocab) * 4
    target = torch.randint(0, vocab, (9,))
    # 0: no -inf (control)
    logits[1, :2048] = NEG_INF  # the row's first block (and first segments) all -inf
    target[1] = 3000
    logits[2, 2048:4096] = NEG_INF  # a later block
    target[2] = 7
    logits[3] = NEG_INF  # all -inf but the target
    target[3] = 2500
    logits[3, 2500] = 1.5
    logits[4, target[4]] = NEG_INF  # the target logit is -inf: loss +inf
    logits[5] = NEG_INF  # the whole row: NaN
    logits[6, 100:3000] = NEG_INF  # a range that is not aligned to blocks or segments
    target[6] = 50
    logits[7] = NEG_INF  # two finite logits, the larger in the last columns
    target[7] = 5
    logits[7, 5], logits[7, vocab - 1] = -2.0, 3.0
    logits[8, : vocab - 1] = NEG_INF  # only the last column finite, and it is not the target
    target[8] = 0
    return logits.to(dtype), target


def _expected(logits, target, *, logit_scale, softcap, label_smoothing, z_loss):
    """Per-row loss and lse, and d(sum of losses)/d(logits): F.cross_entropy (+ z_loss * lse**2) by float64
    autograd on the same logits."""
    x = logits.double().requires_grad_(True)
    z = x * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    lse = torch.logsumexp(z, 1)
    loss = F.cross_entropy(z, target, reduction="none", label_smoothing=label_smoothing)
    if z_loss:
        loss = loss + z_loss * lse**2
    loss.sum().backward()
    return loss.detach(), lse.detach(), x.grad


def _assert_matches(actual: torch.Tensor, expected: torch.Tensor, tol: float, what) -> None:
    """NaN, +inf and -inf exactly where expected has them; finite values within tol (relative to the largest)."""
    actual, expected = actual.double().cpu(), expected.cpu()
    scale = expected[torch.isfinite(expected)].abs().max().item() if torch.isfinite(expected).any() else 1.0
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * scale, equal_nan=True, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("label_smoothing, z_loss", [(0.0, 0.0), (0.1, 1e-3), (1.0, 0.0)])
@pytest.mark.parametrize("segment_cols", [None, 1024])  # None: one segment; 1024: 5 segments, 2 of them -inf
def test_losses_and_gradient_with_neg_inf_logits(dtype, softcap, label_smoothing, z_loss, segment_cols, monkeypatch):
    if segment_cols is not None:
        monkeypatch.setattr(row_stats_module, "SEGMENT_COLS", segment_cols)
    vocab = 4096 + 37
    logits, target = _masked_logits(vocab, dtype)
    options = dict(logit_scale=0.7, softcap=softcap, label_smoothing=label_smoothing, z_loss=z_loss)
    loss, lse, grad = _expected(logits, target, **options)
    if softcap is None:  # the cases are there: PyTorch's own non-finite results
        assert torch.isnan(loss[5]) and torch.isnan(grad[5]).all() and torch.isfinite(grad[4]).all()
        assert torch.isinf(loss[4]) if label_smoothing < 1 else torch.isnan(loss[4])  # 0 * inf
    grad_tol = 1e-5 if dtype == torch.float32 else 8e-3  # G is stored in the logits dtype
    new_options = dict(transform=LogitTransform(scale=0.7, softcap=softcap),
                       terms=LossTerms(label_smoothing=label_smoothing, z_loss=z_loss, vocab_size=vocab))
    for losses_fn, grad_fn in ((row_losses, grad_logits), (torch_backend.row_losses, torch_backend.grad_logits)):
        got_loss, got_lse = torch.full((2, 9), 123.0).unbind(0)
        losses_fn(logits, target, got_loss, got_lse, **new_options)
        _assert_matches(got_loss, loss, 1e-5, (losses_fn.__module__, "loss"))
        _assert_matches(got_lse, lse, 1e-5, (losses_fn.__module__, "lse"))
        got_grad = torch.full_like(logits, 123.0)
        grad_fn(logits, got_grad, target, got_lse, grad_scale=1.0, row_scale=None, **new_options)
        _assert_matches(got_grad, grad, grad_tol, (grad_fn.__module__, "grad"))


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_vocab_shard_of_neg_inf_merges_as_nothing(softcap, monkeypatch):
    """row_stats of two vocab shards (the second all -inf in some rows, or both): the all -inf shard gives
    max -inf, sum-exp 0, sum -inf; merged as distributed.Shard.merge_stats does, lse is logsumexp of the row."""
    monkeypatch.setattr(row_stats_module, "SEGMENT_COLS", 256)  # 2 segments per shard, merged by merge_partials
    vocab = 1000
    logits, target = _masked_logits(4096 + 37, torch.float32)
    logits, target = logits[:, :vocab].contiguous(), target.clamp(max=vocab - 1)
    logits[[0, 1, 3], 500:] = NEG_INF  # the second shard all -inf (row 3: all -inf but a target < 500?)
    target[3] = 20
    logits[3, 20] = 1.5
    shards = [(0, 500), (500, vocab)]
    z64 = logits.double() * 0.7
    if softcap is not None:
        z64 = softcap * torch.tanh(z64 / softcap)
    transform = LogitTransform(scale=0.7, softcap=softcap)
    terms = LossTerms(label_smoothing=0.1, vocab_size=vocab)  # smoothing: row_stats computes the logit sum
    for impl in (row_stats, torch_backend.row_stats):
        parts = []
        for start, end in shards:
            local = torch.where((target >= start) & (target < end), target - start, -1)
            parts.append(impl(logits[:, start:end].contiguous(), local, transform=transform, terms=terms))
        if softcap is None:
            m, s, t, total = parts[1]
            for row in (0, 1, 3, 5, 7):
                assert m[row] == NEG_INF and s[row] == 0 and total[row] == NEG_INF, (impl.__module__, row)
                assert t[row] == (NEG_INF if 500 <= target[row] else 0), (impl.__module__, row)
        global_max = torch.maximum(parts[0][0], parts[1][0])
        sumexp = sum(p[1] * torch.exp(p[0] - global_max) for p in parts)
        merged_lse = global_max + torch.log(sumexp)
        expected_lse = torch.logsumexp(z64, 1)
        # rows whose shards are not all -inf in both: the merge is logsumexp (both all -inf: NaN, as the loss)
        ok = torch.isfinite(parts[0][0]) | torch.isfinite(parts[1][0])
        _assert_matches(merged_lse[ok], expected_lse[ok], 1e-6, impl.__module__)
        _assert_matches(parts[0][3] + parts[1][3], z64.sum(1), 1e-6, impl.__module__)
        expected_target = z64.gather(1, target[:, None]).squeeze(1)
        _assert_matches(parts[0][2] + parts[1][2], expected_target, 1e-6, impl.__module__)


def test_merge_of_neg_inf_segments_across_segment_blocks(monkeypatch):
    """125 segments of 8 columns, merged 64 at a time: rows whose first 64 segments (or all) are -inf."""
    monkeypatch.setattr(row_stats_module, "SEGMENT_COLS", 8)
    vocab = 1000
    logits = torch.randn(4, vocab) * 4
    target = torch.tensor([700, 999, 3, 650])
    logits[0, :600] = NEG_INF  # the first block of 64 segments all -inf
    logits[1, :999] = NEG_INF  # only the last segment's last column finite
    logits[2] = NEG_INF  # all -inf: NaN
    logits[3, 600:] = NEG_INF  # the second block all -inf, and the target among them: +inf
    loss, lse, _ = _expected(logits, target, logit_scale=1.0, softcap=None, label_smoothing=0.0, z_loss=0.0)
    for impl in (row_losses, torch_backend.row_losses):
        got_loss, got_lse = torch.full((2, 4), 123.0).unbind(0)
        impl(logits, target, got_loss, got_lse, transform=LogitTransform(), terms=LossTerms(vocab_size=vocab))
        _assert_matches(got_loss, loss, 1e-6, (impl.__module__, "loss"))
        _assert_matches(got_lse, lse, 1e-6, (impl.__module__, "lse"))


@pytest.mark.parametrize("pattern", ["tile", "all_but_two", "all"])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_matmul_partials_with_neg_inf_bias(pattern, softcap):
    """A -inf bias: a whole vocabulary tile (256 columns) of -inf logits in every row, all columns but two,
    or all (loss NaN). Merged partials against F.cross_entropy in float64 of the fp16-rounded logits."""
    rows, hidden_size, vocab = 130, 40, 700  # 2 row tiles, 3 vocabulary tiles
    dtype = torch.float16
    hidden = torch.randn(rows, hidden_size).to(dtype)
    weight = (torch.randn(vocab, hidden_size) * 0.6).to(dtype)
    if not matmul_stats.supported(hidden, weight):
        pytest.skip("needs a TMA-capable GPU (sm90+) and a Triton with tensor descriptors, or the interpreter")
    bias = torch.randn(vocab) * 0.5
    target = torch.randint(0, vocab, (rows,))
    if pattern == "tile":
        bias[256:512] = NEG_INF
        target[:10] = torch.arange(300, 310)  # targets in the -inf tile: loss +inf
    elif pattern == "all_but_two":
        keep = bias[[5, 650]].clone()
        bias[:] = NEG_INF
        bias[[5, 650]] = keep
        target[:] = 5
        target[1::3] = 650
        target[2::3] = 100  # a -inf target
    else:
        bias[:] = NEG_INF
    bias = bias.to(dtype)
    x = (hidden.double() @ weight.double().T + bias.double()).to(dtype)
    options = dict(logit_scale=0.9, softcap=softcap, label_smoothing=0.1, z_loss=1e-3)
    loss, lse, _ = _expected(x, target, **options)
    partial = matmul_stats.matmul_partials(hidden, weight, bias, target, logits_dtype=dtype,
                                           transform=LogitTransform(scale=0.9, softcap=softcap), need_sum=True)
    got_loss, got_lse = torch.full((2, rows), 123.0).unbind(0)
    merge_partials(partial, loss_out=got_loss, lse_out=got_lse,
                   terms=LossTerms(label_smoothing=0.1, z_loss=1e-3, vocab_size=vocab))
    # fp32 accumulation in another order than float64: a rounded logit may land one ulp away (as test_matmul_stats)
    _assert_matches(got_loss, loss, 2e-3, "loss")
    _assert_matches(got_lse, lse, 2e-3, "lse")
    if pattern == "all" and softcap is None:
        assert torch.isnan(got_loss).all()
