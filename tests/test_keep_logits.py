"""keep_logits: where backward would recompute the logits (reduction="none"; token_stats with per-token weights
and a trainable lm_head), forward keeps them and backward reads them. Against float64 autograd on fresh data,
with every option that changes the gradient; backward runs no logits matmul; the kept logits are never
overwritten (retain_graph); nothing is kept where backward needs no logits."""
import pytest
import torch
import torch.nn.functional as F

import fused_lm_loss.chunked as chunked
import fused_lm_loss.plan as plan
from fused_lm_loss import FusedLMLoss, token_stats

from .reference import float64_logits, make_inputs, reference_loss, rel_err
from .test_token_stats import reference as token_reference

N, H, V = 41, 16, 97


class Spy:
    """Counts the logits matmuls (``logits_into``), the logits tiles the heads hand to the steps, and whether
    each head was given kept logits."""

    def __init__(self, monkeypatch):
        self.matmuls, self.tile_widths, self.kept = 0, [], []
        into, logits, init = chunked.logits_into, chunked.LinearHead.logits, chunked.LinearHead.__init__

        def spy_into(*args):
            self.matmuls += 1
            return into(*args)

        def spy_logits(head, start, end, cols=None):
            out = logits(head, start, end, cols)
            self.tile_widths.append(out.shape[1])
            return out

        def spy_init(head, *args, **kwargs):
            init(head, *args, **kwargs)
            self.kept.append(head.kept_logits is not None)

        monkeypatch.setattr(chunked, "logits_into", spy_into)
        monkeypatch.setattr(chunked.LinearHead, "logits", spy_logits)
        monkeypatch.setattr(chunked.LinearHead, "__init__", spy_init)

    def reset(self):
        self.matmuls, self.tile_widths = 0, []


def per_token_reference(hidden, weight, labels, bias, grad_output, *, label_smoothing=0.0, z_loss=0.0, softcap=None,
                        logit_scale=1.0, class_weight=None):
    """Per-token losses (F.cross_entropy in float64 on the logits, plus z_loss * lse**2) and the float64
    gradients of sum(grad_output * loss)."""
    leaves, z = float64_logits(hidden, weight, bias, logit_scale=logit_scale, softcap=softcap)
    kept = labels != -100
    loss = F.cross_entropy(z, labels, weight=None if class_weight is None else class_weight.double(),
                           label_smoothing=label_smoothing, reduction="none")
    loss = loss + torch.where(kept, z_loss * torch.logsumexp(z, -1) ** 2, 0.0)
    loss.backward(grad_output.double())
    return loss.detach(), {k: v.grad for k, v in leaves.items() if v.requires_grad}


def _chunks(labels, rows):
    return -(-int((labels != -100).sum()) // rows)


LOSS_OPTIONS = {
    "plain": {},
    "smoothing-zloss-softcap-scale": dict(label_smoothing=0.2, z_loss=1e-2, softcap=5.0, logit_scale=1.3),
    "class-weights-smoothing": dict(label_smoothing=0.1, class_weight=torch.rand(V) + 0.5),
}


@pytest.mark.parametrize("options", LOSS_OPTIONS.values(), ids=LOSS_OPTIONS.keys())
@pytest.mark.parametrize("trainable", ["all", "hidden", "head"])
def test_per_token_loss_reads_the_kept_logits(backend, monkeypatch, options, trainable):
    hidden, weight, labels, bias = make_inputs(N, H, V, bias=True)
    hidden.requires_grad_(trainable in ("all", "hidden"))
    for t in (weight, bias):
        t.requires_grad_(trainable in ("all", "head"))
    spy = Spy(monkeypatch)
    loss = FusedLMLoss(reduction="none", chunk_size=16, keep_logits=True, **options)(hidden, weight, labels, bias)
    assert spy.kept == [True] and spy.matmuls == _chunks(labels, 16)  # forward: written where kept
    spy.reset()
    tensors = {"hidden": hidden, "weight": weight, "bias": bias}
    for _ in range(2):  # retain_graph: the second backward reads the same kept logits
        grad_output = torch.randn(N)
        for t in tensors.values():
            t.grad = None
        loss.backward(grad_output, retain_graph=True)
        expected, grads = per_token_reference(hidden, weight, labels, bias, grad_output, **options)
        assert rel_err(loss, expected) <= 2e-6
        for name, t in tensors.items():
            assert (t.grad is None) == (name not in grads), name
            if t.grad is not None:
                assert rel_err(t.grad, grads[name]) <= 2e-5, name
    assert spy.matmuls == 0  # backward recomputed no logits


def test_backward_buffers_keep_to_the_budget(backend, monkeypatch):
    """Reading kept logits, backward's G buffer stays within LOGITS_BUDGET_BYTES: where a recompute takes one
    chunk of all rows (using the bytes of the fp32 dW accumulator of a bf16 head, which one chunk does not need),
    it tiles the vocabulary instead, since the kept logits already hold N x V. Both as close to float64."""
    n = 80
    hidden, weight, labels, _ = make_inputs(n, H, V, dtype=torch.bfloat16, ignore_frac=0.5)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    kept_rows = int((labels != -100).sum())
    per_logit = 2 + (plan.TORCH_BACKEND_TEMP_BYTES if backend == "torch" else 0)
    row_bytes = 2 * H + 4 * H  # the gathered row of h and its fp32 dX row
    budget = kept_rows * (V * per_logit + row_bytes) - 1  # all rows, all columns: 1 byte too many ...
    assert budget + V * H * 4 > kept_rows * (V * per_logit + row_bytes)  # ... but within budget + accumulator
    monkeypatch.setattr(plan, "LOGITS_BUDGET_BYTES", budget)
    monkeypatch.setattr(plan, "MIN_TILE_COLS", 16)
    spy = Spy(monkeypatch)
    a = torch.randn(n)
    _, want = token_reference(hidden, weight, labels, a=a)
    for keep in (False, True):
        hidden.grad = weight.grad = None
        out = token_stats(hidden, weight, labels, keep_logits=keep)
        spy.reset()
        (out.logprobs * a).sum().backward()
        if keep:
            assert len(spy.tile_widths) >= 2 and kept_rows * max(spy.tile_widths) * per_logit <= budget
        else:
            assert spy.tile_widths == [V]
        assert rel_err(hidden.grad, want["hidden"]) <= 1e-2 and rel_err(weight.grad, want["weight"]) <= 1e-2


def test_fp32_logits_kept_for_a_bf16_head(backend, monkeypatch):
    """logits_dtype=float32 keeps fp32 logits (and backward's G = hi + lo beside them); no worse than eager bf16."""
    hidden, weight, labels, _ = make_inputs(N, H, V, dtype=torch.bfloat16)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    spy = Spy(monkeypatch)
    loss = FusedLMLoss(reduction="none", keep_logits=True, logits_dtype=torch.float32)(hidden, weight, labels)
    grad_output = torch.randn(N)
    spy.reset()
    loss.backward(grad_output)
    assert spy.matmuls == 0
    expected, grads = reference_loss(hidden, weight, labels, reduction="none", grad_output=grad_output)
    assert rel_err(loss, expected) <= 1e-5
    for name, t in (("hidden", hidden), ("weight", weight)):
        assert rel_err(t.grad, grads[name]) <= 1e-2, name


@pytest.mark.parametrize("expected_grads", ["logprobs", "logprobs_and_entropy"])
@pytest.mark.parametrize("tiled", [False, True], ids=["chunks", "vocab-tiles"])
@pytest.mark.parametrize("a_kind,b_kind", [("random", None), ("random", "random"), (None, "random"),
                                           ("zeros", "random")])
def test_token_stats_reads_the_kept_logits(backend, monkeypatch, expected_grads, tiled, a_kind, b_kind):
    """Trainable head with bias and a LoRA adapter on lm_head, the transforms, random per-token weights (positive,
    negative, zero); backward over whole-vocabulary chunks or over tiles of the kept logits (strided views)."""
    hidden, weight, labels, bias = make_inputs(N, H, V, bias=True)
    u = (torch.randn(N, 3) * 0.5).requires_grad_(True)
    b_lr = (torch.randn(V, 3) * 0.5).requires_grad_(True)
    for t in (hidden, weight, bias):
        t.requires_grad_(True)
    transforms = dict(temperature=0.7, logit_scale=1.2, softcap=5.0)
    spy = Spy(monkeypatch)
    out = token_stats(hidden, weight, labels, bias, low_rank=(u, b_lr), expected_grads=expected_grads,
                      keep_logits=True, chunk_size=None if tiled else 16, **transforms)
    assert spy.kept == [True] and spy.matmuls == (1 if tiled else _chunks(labels, 16))
    if tiled:  # backward's budget: ~30 columns of G per kept row (tiles, one row chunk)
        per_logit = 4 + (plan.TORCH_BACKEND_TEMP_BYTES if backend == "torch" else 0)
        monkeypatch.setattr(plan, "LOGITS_BUDGET_BYTES", N * 30 * per_logit + N * 200)
        monkeypatch.setattr(plan, "MIN_TILE_COLS", 16)
    tensors = {"hidden": hidden, "weight": weight, "bias": bias, "low_rank_input": u, "low_rank_weight": b_lr}
    for _ in range(2):  # retain_graph: the kept logits are read, never overwritten
        spy.reset()
        a, b = ({"random": torch.randn, "zeros": torch.zeros}[k](N) if k else None for k in (a_kind, b_kind))
        for t in tensors.values():
            t.grad = None
        total = (0.0 if a is None else (out.logprobs * a).sum()) + (0.0 if b is None else (out.entropy * b).sum())
        total.backward(retain_graph=True)
        assert spy.matmuls == 0
        if tiled:
            assert len(spy.tile_widths) >= 2 and max(spy.tile_widths) < V and sum(spy.tile_widths) == V
        (logprobs, entropy, lse, argmax), grads = token_reference(hidden, weight, labels, bias, a=a, b=b,
                                                                  low_rank=(u, b_lr), **transforms)
        assert rel_err(out.logprobs, logprobs) <= 2e-6 and rel_err(out.entropy, entropy) <= 2e-6
        assert torch.equal(out.argmax, argmax)
        for name, t in tensors.items():
            assert rel_err(t.grad, grads[name]) <= 2e-5, name


def test_token_stats_kept_logits_with_uniform_weights(backend, monkeypatch):
    """An RL call whose weights turn out uniform (expected "logprobs", SFT-like backward) reads the kept logits too."""
    hidden, weight, labels, _ = make_inputs(N, H, V)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    spy = Spy(monkeypatch)
    out = token_stats(hidden, weight, labels, keep_logits=True)
    spy.reset()
    kept = labels != -100
    a = torch.where(kept, -1.0 / kept.sum(), 0.0)
    (out.logprobs * a).sum().backward()
    assert spy.matmuls == 0
    _, grads = token_reference(hidden, weight, labels, a=a)
    assert rel_err(hidden.grad, grads["hidden"]) <= 2e-5 and rel_err(weight.grad, grads["weight"]) <= 2e-5


@pytest.mark.parametrize("case", ["loss-mean", "loss-none-no-grad", "frozen-head", "sft-uniform", "no-grad-mode"])
def test_nothing_kept_where_backward_needs_no_logits(monkeypatch, case):
    """Where the gradients are made in forward (or none are needed) keep_logits keeps nothing: the same
    memory as without it. The results still match float64."""
    hidden, weight, labels, _ = make_inputs(N, H, V)
    hidden.requires_grad_(case != "loss-none-no-grad")
    weight.requires_grad_(case not in ("frozen-head", "loss-none-no-grad"))
    spy = Spy(monkeypatch)
    a = torch.randn(N)
    if case.startswith("loss"):
        reduction = "mean" if case == "loss-mean" else "none"
        loss = FusedLMLoss(reduction=reduction, keep_logits=True)(hidden, weight, labels)
        expected, grads = reference_loss(hidden, weight, labels, reduction=reduction)
        assert rel_err(loss, expected) <= 2e-6
    else:
        with torch.set_grad_enabled(case != "no-grad-mode"):
            out = token_stats(hidden, weight, labels, keep_logits=True,
                              expected_grads="uniform" if case == "sft-uniform" else "logprobs")
        (logprobs, *_), grads = token_reference(hidden, weight, labels, a=a)
        assert rel_err(out.logprobs, logprobs) <= 2e-6
        if case != "no-grad-mode":
            (out.logprobs * a).sum().backward()
            assert rel_err(hidden.grad, grads["hidden"]) <= 2e-5
    assert spy.kept[0] is False


def test_saved_inputs_are_still_guarded(backend):
    """The kept logits do not replace the saved inputs: changing the weight in place before backward raises."""
    hidden, weight, labels, _ = make_inputs(N, H, V)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    for run in (lambda: FusedLMLoss(reduction="none", keep_logits=True)(hidden, weight, labels).sum(),
                lambda: token_stats(hidden, weight, labels, keep_logits=True).logprobs.sum()):
        total = run()
        with torch.no_grad():
            weight.mul_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            total.backward()


@pytest.mark.parametrize("value", [1, "yes", None])
def test_keep_logits_must_be_a_bool(value):
    with pytest.raises(ValueError, match="keep_logits must be True or False"):
        FusedLMLoss(keep_logits=value)
    hidden, weight, labels, _ = make_inputs(5, H, V)
    with pytest.raises(ValueError, match="keep_logits must be True or False"):
        token_stats(hidden, weight, labels, keep_logits=value)


@pytest.mark.parametrize("op", ["loss", "token_stats"])
def test_kept_logits_past_the_selected_rows_are_zeros(monkeypatch, op):
    """The kept logits hold the selected rows first; the rows past them (ignored tokens) are zeros, not the
    uninitialized memory they are allocated as (an operator's outputs must not depend on it: opcheck's
    aot_dispatch test compares two calls). Allocations are poisoned with NaN to show any row left unwritten."""
    from fused_lm_loss import ops, token_ops
    from fused_lm_loss.ops_common import allocate

    module = ops if op == "loss" else token_ops
    monkeypatch.setattr(module, "allocate", lambda specs, device: tuple(t.fill_(float("nan")) if t.is_floating_point()
                                                                           else t for t in allocate(specs, device)))
    captured = []
    kept_of = chunked.KeptLogits.of

    def spy(tensor, mode):
        if mode == "store":
            captured.append(tensor)
        return kept_of(tensor, mode)

    monkeypatch.setattr(chunked.KeptLogits, "of", staticmethod(spy))
    hidden, weight, labels, _ = make_inputs(N, H, V)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    if op == "loss":
        FusedLMLoss(reduction="none", keep_logits=True, chunk_size=8)(hidden, weight, labels)
    else:
        token_stats(hidden, weight, labels, keep_logits=True, chunk_size=8)
    count = int((labels != -100).sum())
    (kept,) = [t for t in captured if t.numel()]
    assert 0 < count < N and not kept[:count].isnan().any() and torch.equal(kept[count:], torch.zeros_like(kept[count:]))
