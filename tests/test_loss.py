"""FusedLMLoss / fused_linear_cross_entropy against the float64 reference, every option and combination."""
import pytest
import torch
import torch.nn.functional as F

import fused_lm_loss
from fused_lm_loss import FusedLMLoss, fused_linear_cross_entropy

from .reference import make_inputs, reference_loss, rel_err

OPTION_SETS = {
    "plain": {},
    "label_smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-2},
    "softcap": {"softcap": 4.0},
    "logit_scale": {"logit_scale": 0.6},
    "all": {"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 5.0, "logit_scale": 1.3},
    "full_smoothing_ignore7": {"label_smoothing": 1.0, "ignore_index": 7},
    "temperature": {"temperature": 0.7},
    "temperature_all": {"temperature": 1.9, "softcap": 5.0, "logit_scale": 1.3, "label_smoothing": 0.1, "z_loss": 1e-2},
}
FROZEN = {"all_trainable": (True, True), "hidden_frozen": (False, True), "head_frozen": (True, False)}


def call_grad_output(loss):
    """A non-uniform per-token grad_output, so the recompute path is really exercised."""
    return torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape)


def _assert_matches(loss, expected_loss, grads, tensors, tol):
    assert loss.dtype == torch.float32
    assert rel_err(loss, expected_loss) <= tol, (loss, expected_loss)
    for name, t in tensors.items():
        if t is None:
            continue
        if name in grads:
            assert t.grad is not None and t.grad.dtype == t.dtype, name
            assert rel_err(t.grad, grads[name]) <= tol, name
        else:
            assert t.grad is None, name


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("frozen", FROZEN.values(), ids=FROZEN.keys())
def test_matches_float64_reference(backend, options, reduction, with_bias, frozen):
    hidden, weight, labels, bias = make_inputs(37, 24, 131, bias=with_bias, shape=(37,))
    if "ignore_index" in options:
        labels[labels == -100] = options["ignore_index"]
    hidden.requires_grad_(frozen[0])
    weight.requires_grad_(frozen[1])
    if bias is not None:
        bias.requires_grad_(frozen[1])
    options = dict(options, reduction=reduction, chunk_size=8)
    loss = FusedLMLoss(**options)(hidden, weight, labels, bias)
    if reduction == "none":
        assert loss.shape == labels.shape
        loss.backward(call_grad_output(loss))
    else:
        assert loss.shape == ()
        loss.backward()
    ref_options = {k: v for k, v in options.items() if k != "chunk_size"}
    if reduction == "none":
        ref_options["grad_output"] = call_grad_output(loss)
    expected, grads = reference_loss(hidden, weight, labels, bias, **ref_options)
    _assert_matches(loss, expected, grads, {"hidden": hidden, "weight": weight, "bias": bias}, 2e-4)


@pytest.mark.parametrize(
    "n,h,v,shape",
    [
        (1, 8, 50, (1,)),
        (12, 8, 1, (12,)),  # V = 1: the loss is z-loss only
        (6, 16, 5003, (6,)),  # several vocab blocks in the stats loop, V odd
        (24, 16, 97, (2, 3, 4)),  # 4-D hidden
    ],
    ids=["N1", "V1", "V5003", "4d"],
)
def test_shapes(backend, n, h, v, shape):
    hidden, weight, labels, _ = make_inputs(n, h, v, shape=shape, ignore_frac=0.0 if n == 1 else 0.2)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    options = {"z_loss": 1e-2, "label_smoothing": 0.1}
    loss = FusedLMLoss(chunk_size=5, **options)(hidden, weight, labels)
    loss.backward()
    expected, grads = reference_loss(hidden, weight, labels, **options)
    _assert_matches(loss, expected, grads, {"hidden": hidden, "weight": weight}, 2e-4)


def test_non_contiguous_hidden_and_functional_form(backend):
    full, weight, labels, _ = make_inputs(4 * 9, 16, 77, shape=(4, 9))
    full.requires_grad_(True)
    weight.requires_grad_(True)
    hidden = full[:, :-1]  # the usual shift: a non-contiguous view
    assert not hidden.is_contiguous()
    loss = fused_linear_cross_entropy(hidden, weight, labels[:, 1:], chunk_size=7, softcap=3.0)
    loss.backward()
    expected, grads = reference_loss(hidden, weight, labels[:, 1:], softcap=3.0)
    assert rel_err(loss, expected) <= 2e-4
    assert rel_err(weight.grad, grads["weight"]) <= 2e-4
    assert rel_err(full.grad[:, :-1], grads["hidden"]) <= 2e-4
    assert torch.all(full.grad[:, -1] == 0)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_num_items_in_batch(backend, reduction):
    hidden, weight, labels, _ = make_inputs(30, 16, 64)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    if reduction != "mean":
        with pytest.raises(ValueError, match="num_items_in_batch"):
            FusedLMLoss(reduction=reduction)(hidden, weight, labels, num_items_in_batch=50)
        return
    loss = FusedLMLoss(chunk_size=8)(hidden, weight, labels, num_items_in_batch=torch.tensor(50))
    loss.backward()
    expected, grads = reference_loss(hidden, weight, labels, num_items_in_batch=50)
    _assert_matches(loss, expected, grads, {"hidden": hidden, "weight": weight}, 2e-4)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_tokens_ignored_gives_zero_loss_and_grads(backend, reduction):
    hidden, weight, labels, bias = make_inputs(10, 8, 40, bias=True)
    labels[:] = -100
    for t in (hidden, weight, bias):
        t.requires_grad_(True)
    loss = FusedLMLoss(reduction=reduction, z_loss=1e-2)(hidden, weight, labels, bias)
    assert torch.isfinite(loss).all() and torch.all(loss == 0)
    loss.sum().backward()
    for t in (hidden, weight, bias):
        assert t.grad is not None and torch.all(t.grad == 0)


def test_low_rank_term(backend):
    """low_rank=(u, B) adds u @ B.T to the logits: a LoRA adapter on lm_head, gradients to u and B."""
    hidden, weight, labels, bias = make_inputs(29, 16, 90, bias=True)
    u = torch.randn(29, 4) * 0.5
    b = torch.randn(90, 4) * 0.5
    for t in (hidden, u, b):
        t.requires_grad_(True)
    for reduction in ("mean", "none"):
        for t in (hidden, u, b):
            t.grad = None
        loss = FusedLMLoss(chunk_size=6, reduction=reduction, softcap=6.0)(hidden, weight, labels, bias, low_rank=(u, b))
        loss.sum().backward()
        expected, grads = reference_loss(
            hidden, weight, labels, bias, low_rank=(u, b), reduction=reduction, softcap=6.0
        )
        assert rel_err(loss, expected) <= 2e-4
        assert weight.grad is None
        for name, t in (("hidden", hidden), ("low_rank_input", u), ("low_rank_weight", b)):
            assert rel_err(t.grad, grads[name]) <= 2e-4, name


def test_matches_torch_cross_entropy_definitions():
    """Independent check of the label-smoothing definition against torch's own cross_entropy."""
    hidden, weight, labels, bias = make_inputs(40, 16, 55, bias=True, dtype=torch.float64)
    for eps in (0.0, 0.3):
        for reduction in ("mean", "sum", "none"):
            ours = FusedLMLoss(label_smoothing=eps, reduction=reduction)(
                hidden.float(), weight.float(), labels, bias.float()
            )
            theirs = F.cross_entropy(hidden @ weight.T + bias, labels, label_smoothing=eps, reduction=reduction)
            assert rel_err(ours, theirs) <= 2e-5


@pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"), reason="torch without F.linear_cross_entropy")
@pytest.mark.filterwarnings("ignore:linear_cross_entropy")  # torch falls back to its reference path for smoothing
def test_matches_torch_linear_cross_entropy(backend):
    hidden, weight, labels, bias = make_inputs(48, 32, 150, bias=True)
    for eps, reduction in ((0.0, "mean"), (0.1, "sum"), (0.0, "none")):
        mine = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
        theirs = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
        ours = FusedLMLoss(label_smoothing=eps, reduction=reduction, chunk_size=16)(*mine[:2], labels, mine[2])
        chunked = {"options": torch.nn.LinearCrossEntropyOptions()} if hasattr(torch.nn, "LinearCrossEntropyOptions") else {}
        ref = F.linear_cross_entropy(
            theirs[0], theirs[1], labels, linear_bias=theirs[2], label_smoothing=eps, reduction=reduction, **chunked
        )
        assert rel_err(ours, ref) <= 2e-4
        ours.sum().backward()
        ref.sum().backward()
        for a, b in zip(mine, theirs):
            assert rel_err(a.grad, b.grad) <= 2e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_no_worse_than_eager(backend, dtype):
    """bf16/fp16 inputs: errors vs float64 no worse than eager PyTorch's on the same inputs."""
    hidden, weight, labels, _ = make_inputs(192, 64, 500, dtype=dtype, logit_std=4.0)
    expected, grads = reference_loss(hidden.requires_grad_(True), weight.requires_grad_(True), labels)

    h_eager = hidden.detach().clone().requires_grad_(True)
    w_eager = weight.detach().clone().requires_grad_(True)
    eager = F.cross_entropy((h_eager @ w_eager.T).float(), labels)
    eager.backward()

    loss = FusedLMLoss(chunk_size=64)(hidden, weight, labels)
    loss.backward()
    assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype
    # ours and eager both round logits to the input dtype; allow 25% for rounding luck between two implementations
    assert rel_err(loss, expected) <= 1.25 * rel_err(eager, expected) + 1e-6
    assert rel_err(hidden.grad, grads["hidden"]) <= 1.25 * rel_err(h_eager.grad, grads["hidden"])
    assert rel_err(weight.grad, grads["weight"]) <= 1.25 * rel_err(w_eager.grad, grads["weight"])


def test_fp32_logits_option_more_exact_than_half_logits(backend):
    """logits_dtype=float32: bf16 operands, fp32 logits: gradients closer to float64 than bf16 logits give."""
    hidden, weight, labels, _ = make_inputs(256, 64, 700, dtype=torch.bfloat16, logit_std=4.0)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    expected, grads = reference_loss(hidden, weight, labels)
    errors = {}
    for logits_dtype in (None, torch.float32):
        hidden.grad = weight.grad = None
        loss = FusedLMLoss(chunk_size=64, logits_dtype=logits_dtype)(hidden, weight, labels)
        loss.backward()
        errors[logits_dtype] = (rel_err(loss, expected), rel_err(hidden.grad, grads["hidden"]), rel_err(weight.grad, grads["weight"]))
    fp32, half = errors[torch.float32], errors[None]
    assert fp32[0] < 1e-5  # the loss is exact to fp32 when logits are never rounded
    assert fp32[1] < half[1] and fp32[2] < half[2]


def test_autocast_casts_like_linear(backend):
    hidden, weight, labels, _ = make_inputs(64, 32, 120)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16):
        loss = FusedLMLoss(chunk_size=16)(hidden, weight, labels)
    loss.backward()
    expected, grads = reference_loss(hidden, weight, labels)
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32
    assert rel_err(loss, expected) < 2e-2
    assert rel_err(hidden.grad, grads["hidden"]) < 3e-2 and rel_err(weight.grad, grads["weight"]) < 3e-2


def test_autocast_casts_a_bias_of_another_dtype(backend):
    """Under autocast every operand is cast, the bias too (F.linear); without it, dtypes that differ raise."""
    hidden, weight, labels, bias = make_inputs(16, 32, 120, bias=True)
    bias = bias.half().requires_grad_(True)
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16):
        loss = FusedLMLoss()(hidden, weight, labels, bias)
    loss.backward()
    expected, grads = reference_loss(hidden, weight, labels, bias)
    assert bias.grad.dtype == torch.float16
    assert rel_err(loss, expected) < 2e-2 and rel_err(bias.grad, grads["bias"]) < 3e-2
    with pytest.raises(ValueError, match="must share one dtype"):
        FusedLMLoss()(hidden, weight, labels, bias)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's numpy sees the NaN
def test_non_finite_hidden_propagates(backend):
    hidden, weight, labels, _ = make_inputs(8, 8, 30, ignore_frac=0.0)
    hidden[3, 2] = float("nan")
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    loss = FusedLMLoss()(hidden, weight, labels)
    assert torch.isnan(loss)
    loss.backward()
    assert torch.isnan(weight.grad).any() and torch.isnan(hidden.grad[3]).all()
    assert torch.isfinite(hidden.grad[torch.arange(8) != 3]).all()


def test_in_place_ops_on_returned_loss(backend):
    """HF does `loss *= n`; MoE models do `loss += aux`."""
    hidden, weight, labels, _ = make_inputs(16, 8, 40)
    weight.requires_grad_(True)
    aux = torch.tensor(0.5, requires_grad=True)
    loss = FusedLMLoss()(hidden, weight, labels)
    loss *= 3.0
    loss += aux
    loss.backward()
    _, grads = reference_loss(hidden, weight, labels)
    assert rel_err(weight.grad, 3.0 * grads["weight"]) <= 2e-4
    assert aux.grad == 1.0


@pytest.mark.skipif(not hasattr(torch.nn, "LinearCrossEntropyOptions"), reason="torch without chunked linear_cross_entropy")
def test_fp32_logits_at_least_as_exact_as_torch_chunked():
    """The exactness issue's reference case: N=2048, H=256, V=32000, bf16, logits std ~4."""
    hidden, weight, labels, _ = make_inputs(2048, 256, 32000, dtype=torch.bfloat16, logit_std=4.0, ignore_frac=0.0)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    expected, grads = reference_loss(hidden, weight, labels)

    h_torch = hidden.detach().clone().requires_grad_(True)
    w_torch = weight.detach().clone().requires_grad_(True)
    F.linear_cross_entropy(h_torch, w_torch, labels, options=torch.nn.LinearCrossEntropyOptions()).backward()

    FusedLMLoss(logits_dtype=torch.float32)(hidden, weight, labels).backward()
    # dX: torch keeps G in fp32 and lands on the floor (the exact gradient rounded once to bf16); ours, with
    # G as a bf16 hi + lo pair, lands there too (to 0.1%). dW: ours (hi alone, fp32 sum) beats torch's.
    floor = rel_err(grads["hidden"].to(torch.bfloat16), grads["hidden"])
    assert rel_err(hidden.grad, grads["hidden"]) <= 1.001 * min(floor, rel_err(h_torch.grad, grads["hidden"]))
    assert rel_err(weight.grad, grads["weight"]) <= rel_err(w_torch.grad, grads["weight"])


@pytest.mark.parametrize("factor", [0.375, 1 / 3, 3.0])
def test_loss_scaled_after_the_call(factor):
    """(loss * c).backward(): gradients made in forward are kept wide until backward rounds them once, so for
    realistic logits the errors are eager's (up to G's own bf16 rounding, made without c; README, Numerics);
    with scaling=c passed up front they are exactly eager's. Judged on the PyTorch path (bf16 rounds to
    nearest there; the Triton interpreter truncates)."""
    hidden, weight, labels, _ = make_inputs(256, 256, 4096, dtype=torch.bfloat16, logit_std=4.0, seed=1)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    _, grads = reference_loss(hidden, weight, labels)
    h_eager = hidden.detach().clone().requires_grad_(True)
    w_eager = weight.detach().clone().requires_grad_(True)
    (F.cross_entropy((h_eager @ w_eager.T).float(), labels) * factor).backward()
    eager = (rel_err(h_eager.grad, factor * grads["hidden"]), rel_err(w_eager.grad, factor * grads["weight"]))
    with fused_lm_loss.use_backend("torch"):
        for scaling, bound in ((None, 1.06), (factor, 1.0 + 1e-3)):
            hidden.grad = weight.grad = None
            (fused_linear_cross_entropy(hidden, weight, labels, scaling=scaling) * factor).backward()
            ours = (rel_err(hidden.grad, factor * grads["hidden"]), rel_err(weight.grad, factor * grads["weight"]))
            assert ours[0] <= bound * eager[0] and ours[1] <= bound * eager[1], (scaling, ours, eager)
