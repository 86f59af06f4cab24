"""The float64 reference the tests compare against: plain autograd on materialized logits.

Written independently of the library: it builds the full logits, applies the options literally as the
README defines them, and differentiates with autograd in float64.
"""
from __future__ import annotations

import torch


def float64_logits(hidden, weight, bias=None, *, low_rank=None, logit_scale=1.0, softcap=None, temperature=1.0):
    """(float64 leaves by name, each requiring grad as its input does; the loss-space logits z computed from
    them): z = softcap(logit_scale * (h @ W.T + b + u @ B.T)) / temperature."""
    named = {"hidden": hidden, "weight": weight, "bias": bias}
    if low_rank is not None:
        named["low_rank_input"], named["low_rank_weight"] = low_rank
    leaves = {k: v.detach().double().requires_grad_(v.requires_grad) for k, v in named.items() if v is not None}
    z = leaves["hidden"] @ leaves["weight"].T
    if "bias" in leaves:
        z = z + leaves["bias"]
    if low_rank is not None:
        z = z + leaves["low_rank_input"] @ leaves["low_rank_weight"].T
    z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return leaves, z / temperature


def reference_loss(
    hidden,
    weight,
    labels,
    bias=None,
    *,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
    logit_scale=1.0,
    temperature=1.0,
    num_items_in_batch=None,
    low_rank=None,
    grad_output=None,
):
    """Loss and float64 gradients (dict name -> grad) of every input that requires grad.

    For reduction="none" the gradients are those of sum(grad_output * loss) (grad_output defaults to ones).
    """
    leaves, z = float64_logits(hidden, weight, bias, low_rank=low_rank, logit_scale=logit_scale, softcap=softcap,
                               temperature=temperature)
    lse = torch.logsumexp(z, dim=-1)
    valid = labels != ignore_index
    target = torch.where(valid, labels, torch.zeros_like(labels))
    nll = lse - z.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    smooth = lse - z.mean(dim=-1)
    per_token = (1 - label_smoothing) * nll + label_smoothing * smooth + z_loss * lse**2
    per_token = torch.where(valid, per_token, torch.zeros_like(per_token))
    if reduction == "none":
        if _needs_grad(leaves):
            per_token.backward(torch.ones_like(per_token) if grad_output is None else grad_output.double())
        return per_token.detach(), _grads(leaves)
    loss = per_token.sum()
    if reduction == "mean":
        denominator = num_items_in_batch if num_items_in_batch is not None else int(valid.sum())
        loss = loss / max(denominator, 1)
    if _needs_grad(leaves):
        loss.backward()
    return loss.detach(), _grads(leaves)


def _needs_grad(leaves):
    return any(v.requires_grad for v in leaves.values())


def _grads(leaves):
    return {k: v.grad for k, v in leaves.items() if v.requires_grad}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (absolute error when expected is zero)."""
    actual, expected = actual.double(), expected.double()
    denominator = expected.norm().item()
    diff = (actual - expected).norm().item()
    return diff / denominator if denominator > 0 else diff


def make_inputs(n, h, v, *, dtype=torch.float32, logit_std=3.5, ignore_frac=0.2, bias=False, shape=None, seed=None):
    """Fresh random inputs whose logits have std ~ logit_std; labels drawn from the model's softmax."""
    gen = torch.Generator(torch.get_default_device()).manual_seed(seed) if seed is not None else None
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64) * (logit_std / h**0.5)
    b = torch.randn(v, generator=gen, dtype=torch.float64) * 0.5 if bias else None
    logits = hidden @ weight.T + (b if b is not None else 0)
    labels = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(-1)
    labels[torch.rand(n, generator=gen) < ignore_frac] = -100
    if shape is not None:
        hidden, labels = hidden.reshape(*shape, h), labels.reshape(shape)
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return cast(hidden), cast(weight), labels, cast(b)
