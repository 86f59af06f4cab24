"""Liger's extras: class weights (as F.cross_entropy combines them with label smoothing and ignore_index),
return_z_loss and return_token_accuracy, against float64 references computed here."""
import pytest
import torch
import torch.nn.functional as F

from fused_lm_loss import FusedLMLoss

from .reference import make_inputs, rel_err


def _reference(hidden, weight, labels, *, class_weight, reduction, label_smoothing, z_loss, softcap=None,
               temperature=1.0):
    """F.cross_entropy(weight=...) in float64 on the logits, plus the z-loss (unweighted; "mean": / tokens)."""
    h = hidden.detach().double().requires_grad_(hidden.requires_grad)
    w = weight.detach().double().requires_grad_(weight.requires_grad)
    z = h @ w.T
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    loss = F.cross_entropy(z, labels, weight=None if class_weight is None else class_weight.double(),
                           label_smoothing=label_smoothing, reduction=reduction)
    kept = labels != -100
    lse = torch.logsumexp(z, -1)
    z_terms = torch.where(kept, z_loss * lse * lse, 0.0)
    if reduction == "none":
        z_value = z_terms
    elif reduction == "sum":
        z_value = z_terms.sum()
    else:
        z_value = z_terms.sum() / kept.sum()
    total = loss + z_value
    accuracy = torch.where(kept, (z.argmax(-1) == labels).double(), 0.0)
    if reduction == "mean":
        accuracy = accuracy.sum() / kept.sum()
    elif reduction == "sum":
        accuracy = accuracy.sum()
    total.sum().backward()
    return total.detach(), z_value.detach(), accuracy, h.grad, w.grad


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
@pytest.mark.parametrize("weighted", [True, False], ids=["class_weight", "unweighted"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_class_weights_and_extras_match_pytorch(backend, reduction, label_smoothing, z_loss, weighted, temperature):
    hidden, weight, labels, _ = make_inputs(41, 16, 73)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    class_weight = torch.rand(73) * 2 if weighted else None
    loss_fn = FusedLMLoss(class_weight=class_weight, reduction=reduction, label_smoothing=label_smoothing,
                          z_loss=z_loss, softcap=6.0, temperature=temperature, chunk_size=16, return_z_loss=True,
                          return_token_accuracy=True)
    out = loss_fn(hidden, weight, labels)
    out.loss.sum().backward()
    want, want_z, want_accuracy, grad_h, grad_w = _reference(
        hidden, weight, labels, class_weight=class_weight, reduction=reduction, label_smoothing=label_smoothing,
        z_loss=z_loss, softcap=6.0, temperature=temperature,
    )
    assert rel_err(out.loss, want) <= 2e-5
    assert rel_err(out.z_loss, want_z) <= 2e-5
    assert rel_err(out.token_accuracy, want_accuracy) <= 1e-6  # (fp32 division of the same count)
    assert not out.z_loss.requires_grad and not out.token_accuracy.requires_grad
    assert rel_err(hidden.grad, grad_h) <= 2e-5 and rel_err(weight.grad, grad_w) <= 2e-5


def test_without_the_flags_the_loss_alone_is_returned():
    hidden, weight, labels, _ = make_inputs(8, 8, 20)
    out = FusedLMLoss(class_weight=torch.rand(20))(hidden, weight, labels)
    assert isinstance(out, torch.Tensor) and out.shape == ()


@pytest.mark.parametrize("bad", [torch.rand(3, 4), torch.arange(5), [1.0, 2.0]], ids=["2d", "integer", "list"])
def test_bad_class_weight_raises(bad):
    with pytest.raises(ValueError, match="class_weight"):
        FusedLMLoss(class_weight=bad)


def test_class_weight_checks_at_call():
    hidden, weight, labels, _ = make_inputs(8, 8, 20)
    with pytest.raises(ValueError, match="one weight per class"):
        FusedLMLoss(class_weight=torch.rand(19))(hidden, weight, labels)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        FusedLMLoss(class_weight=torch.rand(20))(hidden, weight, labels, num_items_in_batch=5)
    for flag in ("return_z_loss", "return_token_accuracy"):
        with pytest.raises(ValueError, match=flag):
            FusedLMLoss(**{flag: 1})
