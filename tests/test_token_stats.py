"""token_stats: per-token log-probabilities, entropy, lse, top-1 and argmax with gradients for any per-token
weights, against float64 autograd on the full logits; and which strategy backward takes."""
import pytest
import torch

import fused_lm_loss.token_ops as token_ops
from fused_lm_loss import FusedLMLoss, token_stats

from .reference import float64_logits, make_inputs, rel_err

N, H, V = 37, 16, 90


def reference(hidden, weight, labels, bias=None, *, a=None, b=None, temperature=1.0, logit_scale=1.0, softcap=None,
              low_rank=None, ignore_index=-100):
    """The outputs and float64 gradients of sum(a * logprobs + b * entropy), on materialized logits."""
    leaves, z = float64_logits(hidden, weight, bias, low_rank=low_rank, logit_scale=logit_scale, softcap=softcap)
    z = z / temperature
    valid = labels != ignore_index
    target = torch.where(valid, labels, torch.zeros_like(labels))
    logprobs = torch.where(valid, torch.log_softmax(z, -1).gather(-1, target[..., None]).squeeze(-1), 0.0)
    entropy = torch.where(valid, torch.distributions.Categorical(logits=z).entropy(), 0.0)
    lse = torch.where(valid, torch.logsumexp(z, -1), 0.0)
    argmax = torch.where(valid, z.argmax(-1), -1)
    total = 0.0
    if a is not None:
        total = total + (logprobs * a.double()).sum()
    if b is not None:
        total = total + (entropy * b.double()).sum()
    if any(v.requires_grad for v in leaves.values()) and (a is not None or b is not None):
        total.backward()
    grads = {k: v.grad for k, v in leaves.items() if v.requires_grad}
    return (logprobs.detach(), entropy.detach(), lse.detach(), argmax), grads


def _weights(kind, n):
    if kind == "uniform":
        return torch.full((n,), -0.25)
    if kind == "zeros":
        return torch.zeros(n)
    return torch.randn(n)  # random: positive and negative


@pytest.mark.parametrize("expected", ["logprobs", "logprobs_and_entropy", "uniform"])
@pytest.mark.parametrize("head", ["trainable", "frozen"])
@pytest.mark.parametrize("a_kind,b_kind", [("uniform", None), ("random", None), ("random", "random"),
                                           (None, "random"), ("zeros", "zeros"), ("uniform", "zeros")])
def test_matches_float64_reference(backend, expected, head, a_kind, b_kind):
    hidden, weight, labels, bias = make_inputs(N, H, V, bias=True)
    hidden.requires_grad_(True)
    for t in (weight, bias):
        t.requires_grad_(head == "trainable")
    transforms = dict(temperature=0.7, logit_scale=1.2, softcap=5.0)
    out = token_stats(hidden, weight, labels, bias, chunk_size=16, expected_grads=expected, **transforms)
    a, b = (None if kind is None else _weights(kind, N) for kind in (a_kind, b_kind))
    total = (0.0 if a is None else (out.logprobs * a).sum()) + (0.0 if b is None else (out.entropy * b).sum())
    total.backward()
    (logprobs, entropy, lse, argmax), grads = reference(hidden, weight, labels, bias, a=a, b=b, **transforms)
    assert out.logprobs.dtype == out.entropy.dtype == out.lse.dtype == torch.float32
    for got, want in ((out.logprobs, logprobs), (out.entropy, entropy), (out.lse, lse)):
        assert rel_err(got, want) <= 2e-6
    assert torch.equal(out.argmax, argmax)
    assert torch.equal(out.is_top1, (argmax == labels) & (labels != -100))
    for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        if name in grads:
            assert rel_err(t.grad, grads[name]) <= 2e-5, name
        else:
            assert t.grad is None, name


def _count_recomputes(monkeypatch):
    calls = []
    original = token_ops.run_chunks
    monkeypatch.setattr(token_ops, "run_chunks", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


@pytest.mark.parametrize("case,head,expected,a_kind,b_kind,recomputes", [
    ("RL, frozen head: rows weighted", "frozen", "logprobs", "random", None, 0),
    ("RL + entropy bonus, frozen, expected", "frozen", "logprobs_and_entropy", "random", "random", 0),
    ("RL + entropy bonus, frozen, not expected", "frozen", "logprobs", "random", "random", 1),
    ("SFT, trainable: rescaled", "trainable", "uniform", "uniform", None, 0),
    ("SFT with an unused entropy of weight 0", "trainable", "uniform", "uniform", "zeros", 0),
    ("not uniform after all: recomputed", "trainable", "uniform", "random", None, 1),
    ("RL, trainable head: recomputed", "trainable", "logprobs", "random", None, 1),
])
def test_backward_recomputes_only_when_forward_could_not_serve(monkeypatch, case, head, expected, a_kind, b_kind,
                                                                recomputes):
    hidden, weight, labels, _ = make_inputs(N, H, V)
    hidden.requires_grad_(True)
    weight.requires_grad_(head == "trainable")
    out = token_stats(hidden, weight, labels, chunk_size=16, expected_grads=expected)
    calls = _count_recomputes(monkeypatch)
    a, b = (None if kind is None else _weights(kind, N) for kind in (a_kind, b_kind))
    total = (out.logprobs * a).sum() + (0.0 if b is None else (out.entropy * b).sum())
    total.backward()
    assert len(calls) == recomputes, case
    _, grads = reference(hidden, weight, labels, a=a, b=b)
    assert rel_err(hidden.grad, grads["hidden"]) <= 2e-5
    if head == "trainable":
        assert rel_err(weight.grad, grads["weight"]) <= 2e-5


def test_sft_through_token_stats_equals_the_loss(backend):
    """-mean(logprobs) over the kept tokens is the cross-entropy: the same loss and gradients as FusedLMLoss."""
    hidden, weight, labels, _ = make_inputs(N, H, V)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    out = token_stats(hidden, weight, labels, expected_grads="uniform")
    kept = labels != -100
    (-out.logprobs.sum() / kept.sum()).backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    loss = FusedLMLoss()(hidden, weight, labels)
    loss.backward()
    assert rel_err(-out.logprobs.sum() / kept.sum(), loss) <= 1e-6
    assert rel_err(got[0], hidden.grad) <= 1e-6 and rel_err(got[1], weight.grad) <= 1e-6


@pytest.mark.parametrize("head", ["trainable", "frozen"])
@pytest.mark.parametrize("loss_of,factor", [
    ("-sum / count", 1.0), ("-mean over kept", 1.0), ("-sum / count / 4 (accumulation)", 0.25),
    ("sum / count", -1.0), ("-sum", None),
])
def test_uniform_weights_rescale_the_forward_gradients(backend, monkeypatch, head, loss_of, factor):
    """The logprob gradients made in forward are those of the mean NLL over kept rows: an SFT loss sends back
    exactly that weight (factor 1.0: the saved gradients as they are), any other uniform weight is one factor."""
    hidden, weight, labels, _ = make_inputs(N, H, V)
    hidden.requires_grad_(True)
    weight.requires_grad_(head == "trainable")
    factors = []
    original = token_ops.apply_factor
    monkeypatch.setattr(token_ops, "apply_factor", lambda g, d, f: factors.append(f) or original(g, d, f))
    calls = _count_recomputes(monkeypatch)
    out = token_stats(hidden, weight, labels, expected_grads="uniform")
    kept = labels != -100
    count = int(kept.sum())
    loss = {
        "-sum / count": lambda lp: -lp.sum() / kept.sum(),
        "-mean over kept": lambda lp: -lp[kept].mean(),
        "-sum / count / 4 (accumulation)": lambda lp: -lp.sum() / kept.sum() / 4,
        "sum / count": lambda lp: lp.sum() / kept.sum(),
        "-sum": lambda lp: -lp.sum(),
    }[loss_of](out.logprobs)
    loss.backward()
    assert len(calls) == 1  # the forward only
    want_factor = count if factor is None else factor  # -sum: a = -1 = count * (-1 / count)
    if head == "frozen":
        assert factors == []  # only per-token inputs: weighted per row on the device, whatever the weights
    else:
        assert len(factors) == 1 and factors[0] == pytest.approx(want_factor, rel=1e-6)
        if factor == 1.0:
            assert factors[0] == 1.0
    a = {"-sum / count": -1 / count, "-mean over kept": -1 / count, "-sum / count / 4 (accumulation)": -0.25 / count,
         "sum / count": 1 / count, "-sum": -1.0}[loss_of]
    _, grads = reference(hidden, weight, labels, a=torch.full((N,), a))
    assert rel_err(hidden.grad, grads["hidden"]) <= 2e-6
    if head == "trainable":
        assert rel_err(weight.grad, grads["weight"]) <= 2e-6


def test_low_rank_and_shapes(backend):
    """A LoRA term on lm_head (gradients to u and B), (B, T) shaped inputs, a non-default ignore_index."""
    hidden, weight, labels, _ = make_inputs(4 * 9, H, V, shape=(4, 9))
    labels[labels == -100] = 5
    u = (torch.randn(4, 9, 3) * 0.5).requires_grad_(True)
    b_lr = (torch.randn(V, 3) * 0.5).requires_grad_(True)
    hidden.requires_grad_(True)
    out = token_stats(hidden, weight, labels, ignore_index=5, low_rank=(u, b_lr), chunk_size=7)
    assert out.logprobs.shape == labels.shape and out.argmax.shape == labels.shape
    a, b = torch.randn(4, 9), torch.randn(4, 9)
    ((out.logprobs * a).sum() + (out.entropy * b).sum()).backward()
    (logprobs, entropy, _, argmax), grads = reference(hidden, weight, labels, a=a, b=b, low_rank=(u, b_lr),
                                                      ignore_index=5)
    assert rel_err(out.logprobs, logprobs) <= 2e-6 and rel_err(out.entropy, entropy) <= 2e-6
    assert torch.equal(out.argmax, argmax)
    for name, t in (("hidden", hidden), ("low_rank_input", u), ("low_rank_weight", b_lr)):
        assert rel_err(t.grad, grads[name]) <= 2e-5, name


def test_ignored_positions_and_neg_inf_logits(backend):
    """Ignored positions give 0 / False / -1 and no gradient; a -inf masked part of the vocabulary (bias) carries
    no probability: the entropy stays finite, as torch.distributions.Categorical has it."""
    hidden, weight, labels, bias = make_inputs(N, H, V, bias=True)
    bias[: V // 2] = float("-inf")
    labels[labels < V // 2] = -100  # labels in the masked half would have log-probability -inf
    hidden.requires_grad_(True)
    out = token_stats(hidden, weight, labels, bias, chunk_size=16)
    ignored = labels == -100
    assert ignored.any()
    assert torch.all(out.logprobs[ignored] == 0) and torch.all(out.entropy[ignored] == 0)
    assert not out.is_top1[ignored].any() and torch.all(out.argmax[ignored] == -1)
    assert torch.isfinite(out.entropy).all() and torch.all(out.argmax[~ignored] >= V // 2)
    a, b = torch.randn(N), torch.randn(N)
    ((out.logprobs * a).sum() + (out.entropy * b).sum()).backward()
    # the reference on the unmasked half only (the same distribution; autograd of the entropy through -inf is NaN)
    half = V // 2
    shifted = torch.where(ignored, labels, labels - half)
    (logprobs, entropy, _, _), grads = reference(hidden, weight[half:], shifted, bias[half:], a=a, b=b)
    assert rel_err(out.entropy, entropy) <= 2e-6 and rel_err(out.logprobs, logprobs) <= 2e-6
    assert torch.isfinite(hidden.grad).all() and rel_err(hidden.grad, grads["hidden"]) <= 2e-5
    assert torch.all(hidden.grad[ignored] == 0)


@pytest.mark.parametrize("head", ["trainable", "frozen"])
@pytest.mark.parametrize("extra_outputs", [("mean_logits",), ("log_sum_sq_probs",), ("mean_logits", "log_sum_sq_probs")])
def test_mean_logits_and_log_sum_sq_probs(backend, head, extra_outputs):
    """The outputs DPO and KTO ask TRL's head for, against float64 on the transformed logits: z.mean(-1) and
    log sum softmax(z)^2, 0 at ignored positions, detached, None unless asked; asking changes nothing else."""
    hidden, weight, labels, bias = make_inputs(N, H, V, bias=True, logit_std=3.0)
    low_rank = (torch.randn(N, 3), 0.1 * torch.randn(V, 3))
    hidden.requires_grad_(True)
    weight.requires_grad_(head == "trainable")
    transforms = dict(temperature=0.7, logit_scale=1.2, softcap=5.0)
    a = torch.randn(N)
    outs, grads = [], []
    for asked in (extra_outputs, ()):
        out = token_stats(hidden, weight, labels, bias, chunk_size=16, low_rank=low_rank, extra_outputs=asked,
                          **transforms)
        (out.logprobs * a).sum().backward()
        outs.append(out)
        grads.append((hidden.grad, weight.grad))
        hidden.grad = weight.grad = None
    out, plain = outs
    z = float64_logits(hidden, weight, bias, low_rank=low_rank, **transforms)[1].detach()
    valid = labels != -100
    assert (~valid).any()
    want = {"mean_logits": torch.where(valid, z.mean(-1), 0.0),
            "log_sum_sq_probs": torch.where(valid, torch.log((torch.softmax(z, -1) ** 2).sum(-1)), 0.0)}
    for name in ("mean_logits", "log_sum_sq_probs"):
        got = getattr(out, name)
        if name not in extra_outputs:
            assert got is None and getattr(plain, name) is None
            continue
        assert got.dtype == torch.float32 and got.shape == labels.shape and not got.requires_grad
        assert torch.all(got[~valid] == 0)
        tol = 2e-6 * z.abs().max().item() if name == "mean_logits" else 2e-6 * want[name].abs().max().item()
        torch.testing.assert_close(got.double(), want[name], rtol=0, atol=tol)
    for field in ("logprobs", "entropy", "lse", "is_top1", "argmax"):
        assert torch.equal(getattr(out, field), getattr(plain, field)), field
    for got, want_grad in zip(*grads):
        assert (got is None and want_grad is None) or torch.equal(got, want_grad)


def test_extra_outputs_are_checked():
    hidden, weight, labels, _ = make_inputs(4, 8, 10)
    for bad in ("mean_logits", ("mean_logit",), ["log_probs"], 3, iter(["mean_logit"])):
        with pytest.raises(ValueError, match="extra_outputs"):
            token_stats(hidden, weight, labels, extra_outputs=bad)
    # any iterable of names, an iterator too (read once: validated and asked from one copy)
    out = token_stats(hidden, weight, labels, extra_outputs=(name for name in ["mean_logits", "log_sum_sq_probs"]))
    assert out.mean_logits is not None and out.log_sum_sq_probs is not None


@pytest.mark.parametrize("n_rows, logit_std", [(128, 4.0), (2048, 1.0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_no_worse_than_eager(dtype, n_rows, logit_std):
    """bf16/fp16 operands: log-probabilities, entropy and the gradient as exact as eager PyTorch on the logits
    rounded to that dtype (PyTorch path: bf16 rounds to nearest there, the interpreter truncates). The frozen
    head's dX is made in forward before the weights are known: with 2048 rows of flat rows a weight of -1/count
    would put G among fp16's subnormals (2.3x eager's error)."""
    hidden, weight, labels, _ = make_inputs(n_rows, 64, 500, dtype=dtype, logit_std=logit_std)
    hidden.requires_grad_(True)
    a = torch.randn(n_rows)
    (logprobs, entropy, _, _), grads = reference(hidden, weight, labels, a=a)
    h_eager = hidden.detach().clone().requires_grad_(True)
    z = (h_eager @ weight.T).float()
    kept = labels != -100
    eager_lp = torch.where(kept, torch.log_softmax(z, -1).gather(-1, labels.clamp(min=0)[:, None]).squeeze(-1), 0.0)
    eager_entropy = torch.where(kept, torch.distributions.Categorical(logits=z).entropy(), 0.0)
    (eager_lp * a).sum().backward()
    with fused_lm_loss_backend("torch"):
        out = token_stats(hidden, weight, labels)
        (out.logprobs * a).sum().backward()
    assert rel_err(out.logprobs, logprobs) <= 1.25 * rel_err(eager_lp, logprobs) + 1e-6
    assert rel_err(out.entropy, entropy) <= 1.25 * rel_err(eager_entropy, entropy) + 1e-6
    assert rel_err(hidden.grad, grads["hidden"]) <= 1.25 * rel_err(h_eager.grad, grads["hidden"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_sft_with_a_trainable_head_no_worse_than_eager(dtype):
    """expected_grads="uniform" with a trainable head, the SFT mean under a GradScaler's scale (grad_output
    -2**16 / count per token): dX and dW as exact as eager PyTorch's. In fp16 forward cannot make the mean's
    gradient (G = p / count would sink into the subnormals before the scale arrives: 2.3x eager's dX error at
    2048 rows): backward recomputes with the scaled weights, as autograd does."""
    scale, n_rows = 2.0**16, 2048
    hidden, weight, labels, _ = make_inputs(n_rows, 64, 500, dtype=dtype, logit_std=1.0)
    kept = labels != -100
    count = int(kept.sum())
    a = torch.where(kept, -scale / count, 0.0)
    _, grads = reference(hidden.requires_grad_(True), weight.requires_grad_(True), labels, a=a)
    h_eager, w_eager = (t.detach().clone().requires_grad_(True) for t in (hidden, weight))
    z = (h_eager @ w_eager.T).float()
    eager_lp = torch.log_softmax(z, -1).gather(-1, labels.clamp(min=0)[:, None]).squeeze(-1)
    (eager_lp[kept].sum() * (-scale / count)).backward()
    h, w = (t.detach().clone().requires_grad_(True) for t in (hidden, weight))
    with fused_lm_loss_backend("torch"):
        out = token_stats(h, w, labels, expected_grads="uniform")
        (out.logprobs.sum() * (-scale / count)).backward()
    for fused, eager, name in ((h, h_eager, "hidden"), (w, w_eager, "weight")):
        assert rel_err(fused.grad, grads[name]) <= 1.25 * rel_err(eager.grad, grads[name]), name


def fused_lm_loss_backend(name):
    import fused_lm_loss

    return fused_lm_loss.use_backend(name)


def test_bad_options_raise():
    hidden, weight, labels, _ = make_inputs(4, 8, 10)
    with pytest.raises(ValueError, match="expected_grads"):
        token_stats(hidden, weight, labels, expected_grads="rl")
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            token_stats(hidden, weight, labels, temperature=bad)
    with pytest.raises(ValueError, match="softcap"):
        token_stats(hidden, weight, labels, softcap=-2.0)


def _spy_tile_widths(monkeypatch):
    """The widths of the logits tiles the chunk loop computes."""
    import fused_lm_loss.chunked as chunked

    widths = []
    original = chunked.logits_into
    monkeypatch.setattr(chunked, "logits_into", lambda out, *args: widths.append(out.shape[1]) or original(out, *args))
    return widths


@pytest.mark.parametrize("ignored", [True, False], ids=["some-ignored", "none-ignored"])
def test_recompute_over_vocabulary_tiles_matches_float64(backend, monkeypatch, ignored):
    """With a trainable head and per-token weights, backward recomputes; when the whole vocabulary does not fit
    one chunk it tiles the columns (plan.vocab_tiling). Every gradient (hidden, weight, bias, a LoRA u and B)
    against float64, with transforms, random logprob and entropy weights, the labels spread over all tiles."""
    import fused_lm_loss.plan as plan

    n, vocab = 45, 300
    hidden, weight, labels, bias = make_inputs(n, H, vocab, bias=True, ignore_frac=0.2 if ignored else 0.0)
    u = (torch.randn(n, 3) * 0.5).requires_grad_(True)
    b_lr = (torch.randn(vocab, 3) * 0.5).requires_grad_(True)
    for t in (hidden, weight, bias):
        t.requires_grad_(True)
    transforms = dict(temperature=0.8, logit_scale=1.1, softcap=6.0)
    out = token_stats(hidden, weight, labels, bias, low_rank=(u, b_lr), **transforms)  # forward: whole rows
    # backward's plan: 40 columns of fp32 logits per kept row (tiles of ~40 columns, one row chunk)
    per_logit = 4 + (plan.TORCH_BACKEND_TEMP_BYTES if backend == "torch" else 0)
    monkeypatch.setattr(plan, "LOGITS_BUDGET_BYTES", n * 40 * per_logit + n * 200)
    monkeypatch.setattr(plan, "MIN_TILE_COLS", 16)
    widths = _spy_tile_widths(monkeypatch)
    a, b = torch.randn(n), torch.randn(n)
    ((out.logprobs * a).sum() + (out.entropy * b).sum()).backward()
    assert len(widths) > 2 and max(widths) < vocab and sum(widths) % vocab == 0, widths  # tiles, each column once
    _, grads = reference(hidden, weight, labels, bias, a=a, b=b, low_rank=(u, b_lr), **transforms)
    for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias), ("low_rank_input", u),
                    ("low_rank_weight", b_lr)):
        assert rel_err(t.grad, grads[name]) <= 2e-5, name


@pytest.mark.parametrize("head", ["trainable", "frozen"])
def test_weights_at_ignored_positions_do_not_reach_the_gradients(backend, head):
    """Ignored positions' outputs are constants (0), so whatever weight they get (even NaN or inf) contributes
    nothing, as autograd through torch.where gives; the kept rows' gradients are exact."""
    hidden, weight, labels, _ = make_inputs(N, H, V)
    hidden.requires_grad_(True)
    weight.requires_grad_(head == "trainable")
    ignored = labels == -100
    assert ignored.any()
    out = token_stats(hidden, weight, labels, expected_grads="logprobs_and_entropy")
    a, b = torch.randn(N), torch.randn(N)
    a[ignored], b[ignored] = float("nan"), float("inf")
    ((out.logprobs * a).sum() + (out.entropy * b).sum()).backward()  # (the value is NaN; its gradients are not)
    _, grads = reference(hidden, weight, labels, a=torch.where(ignored, 0.0, a), b=torch.where(ignored, 0.0, b))
    assert rel_err(hidden.grad, grads["hidden"]) <= 2e-5
    if head == "trainable":
        assert rel_err(weight.grad, grads["weight"]) <= 2e-5


@pytest.mark.parametrize("head", ["trainable", "frozen"])
@pytest.mark.parametrize("dtype,ignore_index", [(torch.int32, -100), (torch.int16, -100), (torch.int8, -100),
                                                (torch.uint8, 7), (torch.uint8, -100)], ids=str)
def test_every_integer_label_dtype(backend, dtype, ignore_index, head):
    """Labels of any integer dtype give the outputs and gradients of their int64 values. uint8 label 156 is a
    class (torch compares uint8 with -100 modulo 256, so ``labels != -100`` would call it ignored), and an
    unsigned dtype cannot hold -100: ignore_index=7 ignores there, -100 ignores nothing."""
    vocab = 120 if dtype == torch.int8 else 200
    hidden, weight, labels, _ = make_inputs(20, 8, vocab, ignore_frac=0.0)
    if ignore_index >= 0 or dtype.is_signed:
        labels[::4] = ignore_index
    if vocab > 156:
        labels[3] = 156
        weight[156] = hidden[3] * 3  # its top-1 is 156 (logit 3 |h|^2): is_top1 must say so
    hidden.requires_grad_(True)
    weight.requires_grad_(head == "trainable")
    out = token_stats(hidden, weight, labels.to(dtype), ignore_index=ignore_index)
    a = torch.randn(20)
    (out.logprobs * a).sum().backward()
    (logprobs, _, _, argmax), grads = reference(hidden, weight, labels, a=a, ignore_index=ignore_index)
    assert rel_err(out.logprobs, logprobs) <= 2e-6
    assert torch.equal(out.argmax, argmax)
    assert torch.equal(out.is_top1, (argmax == labels) & (labels != ignore_index))
    if vocab > 156:
        assert bool(out.is_top1[3])
    for name, t in (("hidden", hidden), ("weight", weight)):
        if name in grads:
            assert rel_err(t.grad, grads[name]) <= 2e-5, name


@pytest.mark.parametrize("expected", ["logprobs", "logprobs_and_entropy", "uniform"])
@pytest.mark.parametrize("head", ["trainable", "frozen"])
@pytest.mark.parametrize("case", ["zero_entropy_weight", "all_ignored"])
def test_gradients_nothing_weighs_are_zero(backend, expected, head, case):
    """Backward through the entropy alone with all-zero weights, or with any weights where every position is
    ignored: no gradient component is made, and the gradients asked for are 0 (not uninitialized memory)."""
    hidden, weight, labels, _ = make_inputs(N, H, V)
    if case == "all_ignored":
        labels[:] = -100
    hidden.requires_grad_(True)
    weight.requires_grad_(head == "trainable")
    out = token_stats(hidden, weight, labels, expected_grads=expected, chunk_size=16)
    weights = torch.zeros(N) if case == "zero_entropy_weight" else torch.randn(N)
    (out.entropy * weights).sum().backward()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))
    assert head == "frozen" or torch.equal(weight.grad, torch.zeros_like(weight))


def test_one_row(backend):
    """A single kept row: the per-row weights autograd hands back (an expand of one value) have stride 0."""
    hidden, weight, labels, _ = make_inputs(1, H, V, ignore_frac=0.0)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    out = token_stats(hidden, weight, labels)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    _, grads = reference(hidden, weight, labels, a=torch.ones(1), b=torch.ones(1))
    assert rel_err(hidden.grad, grads["hidden"]) <= 2e-5 and rel_err(weight.grad, grads["weight"]) <= 2e-5


@pytest.mark.parametrize("expected", ["logprobs", "logprobs_and_entropy", "uniform"])
@pytest.mark.parametrize("head", ["trainable", "frozen"])
def test_no_tokens(backend, expected, head):
    """An empty batch: empty outputs and zero gradients, as eager gives (backward's uniformity check has no row
    to reduce over)."""
    hidden = torch.randn(0, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=head == "trainable")
    out = token_stats(hidden, weight, torch.zeros(0, dtype=torch.int64), expected_grads=expected)
    (-out.logprobs.sum() + 0.01 * out.entropy.sum()).backward()
    assert out.logprobs.shape == (0,) and hidden.grad.shape == (0, H)
    assert weight.grad is None if head == "frozen" else (weight.grad.shape == (V, H) and not weight.grad.any())
