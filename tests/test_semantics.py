"""PyTorch's semantics as the reference: label layouts and dtypes, autograd rules (version counters,
higher-order gradients), the mean denominator, degenerate shapes. Each case on both backends."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from fused_lm_loss import FusedLMLoss, fused_divergence, fused_linear_cross_entropy, token_stats
from fused_lm_loss.backends import use_backend

from .conftest import TEST_DEVICE
from .reference import make_inputs, reference_loss, rel_err

INTEGER_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
for _name in ("uint16", "uint32", "uint64"):  # torch >= 2.3 has them
    if hasattr(torch, _name):
        INTEGER_DTYPES.append(getattr(torch, _name))


def _grads_match(tensors, grads, tol=2e-4):
    for name, t in tensors.items():
        assert rel_err(t.grad, grads[name]) <= tol, name


@pytest.mark.parametrize("layout", ["last_position", "every_other", "broadcast", "transposed"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_strided_labels_without_ignored_ones(backend, layout, reduction):
    """Labels that flatten to a strided view (or a stride-0 broadcast) with no ignored label: the kernels must
    see each token's own label."""
    hidden, weight, _, _ = make_inputs(48, 16, 37)
    weight.requires_grad_(True)
    ids = torch.randint(0, 37, (6, 8))
    if layout == "last_position":  # the B x 1 slice an RL value head takes; row stride 8
        h, y = hidden.reshape(6, 8, 16)[:, -1:], ids[:, -1:]
    elif layout == "every_other":
        h, y = hidden[::2], ids.reshape(-1)[::2]
    elif layout == "broadcast":  # stride 0
        h, y = hidden[:6], torch.tensor([3]).expand(6)
    else:
        h, y = hidden.reshape(6, 8, 16).transpose(0, 1), ids.t()
    assert not y.is_contiguous()
    h = h.detach().requires_grad_(True)
    loss = FusedLMLoss(reduction=reduction, chunk_size=5)(h, weight, y)
    loss.sum().backward()
    expected, grads = reference_loss(h, weight, y.contiguous(), reduction=reduction)
    assert rel_err(loss, expected) <= 2e-4
    _grads_match({"hidden": h, "weight": weight}, grads)


@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=str)
@pytest.mark.parametrize("ignored", [False, True])
def test_every_integer_label_dtype(backend, dtype, ignored):
    """Every integer dtype, with and without ignored labels. uint8 label 156 is not -100 (torch compares uint8
    with -100 modulo 256), and an unsigned dtype cannot hold -100 at all: only ignore_index=7 ignores then."""
    vocab = 120 if dtype == torch.int8 else 200  # int8 holds class ids up to 127
    hidden, weight, labels, _ = make_inputs(20, 8, vocab, ignore_frac=0.0)
    if vocab > 156:
        labels[3] = 156
    ignore_index = 7 if (dtype.is_signed is False) else -100
    if ignored:
        labels[::4] = ignore_index
    hidden.requires_grad_(True)
    loss = FusedLMLoss(ignore_index=ignore_index, chunk_size=6)(hidden, weight, labels.to(dtype))
    loss.backward()
    expected, grads = reference_loss(hidden, weight, labels, ignore_index=ignore_index)
    assert rel_err(loss, expected) <= 2e-4
    _grads_match({"hidden": hidden}, grads)


@pytest.mark.skipif(not hasattr(torch, "uint64"), reason="torch < 2.3 has no uint64")
@pytest.mark.parametrize("label", [2**64 - 100, 2**63 + 5])
def test_uint64_labels_beyond_int64_raise(backend, label):
    """int64 cannot hold them: widened, 2**64 - 100 would become -100 (ignore_index, the token silently dropped)
    and 2**63 + 5 a negative label. A ValueError instead (PyTorch refuses uint64 targets altogether)."""
    hidden, weight, labels, _ = make_inputs(8, 8, 37, ignore_frac=0.0)
    labels = labels.to(torch.uint64)
    labels[3] = torch.tensor(label - 2**64).to(torch.uint64)
    with pytest.raises(ValueError, match="uint64 labels above 2"):
        FusedLMLoss()(hidden, weight, labels)


@pytest.mark.parametrize("what", ["labels", "hidden", "weight"])
def test_in_place_change_before_recompute_raises(backend, what):
    """reduction='none' recomputes in backward from what forward saw: a change in between must raise as
    PyTorch does ('modified by an inplace operation'), whatever the tensor."""
    hidden, weight, labels, _ = make_inputs(12, 8, 11, ignore_frac=0.0)
    leaf = hidden.clone().requires_grad_(True)
    h = leaf * 1.0  # a non-leaf hidden state, as a model makes it
    weight.requires_grad_(True)
    loss = FusedLMLoss(reduction="none")(h, weight, labels)
    with torch.no_grad():
        {"labels": lambda: labels.copy_((labels + 5) % 11), "hidden": lambda: h.add_(1.0),
         "weight": lambda: weight.mul_(2.0)}[what]()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.sum().backward()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_higher_order_gradients_raise(backend, reduction):
    """create_graph=True asks for a gradient of the gradient, which the fused backward (a rescale of gradients
    made in forward) cannot give: a clear error, never a gradient penalty that silently drops terms."""
    hidden, weight, labels, _ = make_inputs(10, 8, 20)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    loss = FusedLMLoss(reduction=reduction)(hidden, weight, labels).sum()
    with pytest.raises(RuntimeError, match="higher-order"):
        torch.autograd.grad(loss, hidden, create_graph=True)
    (g,) = torch.autograd.grad(FusedLMLoss(reduction=reduction)(hidden, weight, labels).sum(), hidden)
    assert g.grad_fn is None and not g.requires_grad


@pytest.mark.parametrize("api", ["loss", "token_stats", "divergence", "logits_loss", "weight"])
@pytest.mark.parametrize("mode", ["jvp", "jacfwd", "forward_ad"])
def test_forward_mode_ad_raises(backend, api, mode):
    """Forward-mode AD reaches a custom operator without a forward derivative, and PyTorch gives its outputs a zero
    (torch.func.jvp) or no (forward_ad) tangent without a word: refused wherever a tangent enters, also through the
    weight alone. Reverse mode on the same call still works."""
    from fused_lm_loss.loss import logits_loss

    hidden, weight, labels, _ = make_inputs(12, 8, 30)
    opts = FusedLMLoss().options
    calls = {
        "loss": lambda h: fused_linear_cross_entropy(h, weight, labels),
        "token_stats": lambda h: token_stats(h, weight, labels).logprobs,
        "divergence": lambda h: fused_divergence(h, weight, h.detach(), 2.0 * weight, labels),
        "logits_loss": lambda h: logits_loss(h @ weight.T, labels, opts),
        "weight": lambda w: fused_linear_cross_entropy(hidden, w, labels),
    }
    fn, primal = calls[api], weight if api == "weight" else hidden
    with pytest.raises(RuntimeError, match="forward-mode AD"):
        if mode == "jvp":
            torch.func.jvp(fn, (primal,), (torch.randn_like(primal),))
        elif mode == "jacfwd":
            torch.func.jacfwd(fn)(primal)
        else:
            with torch.autograd.forward_ad.dual_level():
                fn(torch.autograd.forward_ad.make_dual(primal, torch.randn_like(primal)))
    leaf = primal.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(fn(leaf).sum(), leaf)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("api", ["loss", "token_stats", "divergence"])
def test_vmap_over_a_batch_that_needs_a_gradient_raises(backend, api):
    """torch.func.vmap hides a batched input's requires_grad from the operator, whose per-sample calls would then
    make it no gradient (h.grad None, no error): refused. Without gradients vmap gives the per-sample values."""
    hidden, weight, labels, _ = make_inputs(3 * 8, 16, 40)
    hidden, labels = hidden.view(3, 8, 16), labels.view(3, 8)
    calls = {
        "loss": lambda h, y: fused_linear_cross_entropy(h, weight, y),
        "token_stats": lambda h, y: token_stats(h, weight, y).logprobs.sum(),
        "divergence": lambda h, y: fused_divergence(h, weight, h.detach(), 2.0 * weight, y),
    }
    with pytest.raises(RuntimeError, match="vmap"):
        torch.func.vmap(calls[api])(hidden.detach().requires_grad_(True), labels)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (PyTorch's: no batching rule, a loop)
        batched = torch.func.vmap(calls[api])(hidden, labels)
        assert torch.equal(batched, torch.stack([calls[api](h, y) for h, y in zip(hidden, labels)]))


@pytest.mark.parametrize("num_items", [0.5, 0.25, 3, 1e-3])
def test_num_items_is_the_exact_denominator(backend, num_items):
    hidden, weight, labels, _ = make_inputs(16, 8, 30)
    weight.requires_grad_(True)
    for given in (num_items, torch.tensor(num_items)):
        weight.grad = None
        loss = FusedLMLoss()(hidden, weight, labels, num_items_in_batch=given)
        loss.backward()
        summed, grads = reference_loss(hidden, weight, labels, reduction="sum")
        assert rel_err(loss, summed / num_items) <= 2e-4
        assert rel_err(weight.grad, grads["weight"] / num_items) <= 2e-4


def test_num_items_zero_and_negative(backend):
    """0 with every label ignored: loss 0 (the rule the README states); 0 with tokens, or < 0: ValueError."""
    hidden, weight, labels, _ = make_inputs(8, 8, 30, ignore_frac=0.0)
    weight.requires_grad_(True)
    ignored = torch.full_like(labels, -100)
    loss = FusedLMLoss()(hidden, weight, ignored, num_items_in_batch=0)
    loss.backward()
    assert loss.item() == 0.0 and torch.all(weight.grad == 0)
    for bad in (0, -2.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="num_items_in_batch"):
            FusedLMLoss()(hidden, weight, labels, num_items_in_batch=bad)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_hidden_size_zero_matches_pytorch(backend, requires_grad):
    """H = 0: the logits are the bias (zero without one), as F.linear makes them: loss log V, as PyTorch."""
    dtype = torch.float16 if TEST_DEVICE == "cpu" else torch.bfloat16  # the epilogue kernel runs on these (no grad)
    hidden = torch.randn(5, 0, dtype=dtype, requires_grad=requires_grad)
    weight = torch.randn(13, 0, dtype=dtype, requires_grad=requires_grad)
    bias = torch.randn(13, dtype=dtype, requires_grad=requires_grad)
    labels = torch.randint(0, 13, (5,))
    for b in (None, bias):
        loss = FusedLMLoss()(hidden, weight, labels, b)
        want = F.cross_entropy(F.linear(hidden.float(), weight.float(), None if b is None else b.float()), labels)
        assert rel_err(loss, want) <= 1e-3
        if requires_grad:
            loss.backward()
            assert hidden.grad.shape == (5, 0) and weight.grad.shape == (13, 0)
    if requires_grad:
        (want_bias,) = torch.autograd.grad(F.cross_entropy(F.linear(hidden, weight, bias).float(), labels), bias)
        assert rel_err(bias.grad, want_bias) <= 1e-2


@pytest.mark.parametrize("low_rank", [([1, 2], None), (None, None), "uB", ("u", "B", "C")], ids=str)
def test_bad_low_rank_raises_value_error(low_rank):
    hidden, weight, labels, _ = make_inputs(4, 8, 10)
    with pytest.raises(ValueError, match="low_rank"):
        fused_linear_cross_entropy(hidden, weight, labels, low_rank=low_rank)


def test_inference_mode_tensors(backend):
    """Tensors made under inference_mode: the loss works there and outside it (no gradient asked)."""
    with torch.inference_mode():
        hidden, weight, labels, _ = make_inputs(12, 8, 20)
        inside = FusedLMLoss()(hidden, weight, labels)
    outside = FusedLMLoss()(hidden, weight, labels)
    expected, _ = reference_loss(hidden.clone(), weight.clone(), labels.clone())
    assert rel_err(inside, expected) <= 2e-4 and rel_err(outside, expected) <= 2e-4


@pytest.mark.parametrize("trainable", ["hidden", "weight", "bias", "hidden+bias", "none"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_requires_grad_on_any_subset(backend, trainable, reduction):
    hidden, weight, labels, bias = make_inputs(21, 8, 33, bias=True)
    named = {"hidden": hidden, "weight": weight, "bias": bias}
    for name in trainable.split("+"):
        if name in named:
            named[name].requires_grad_(True)
    loss = FusedLMLoss(reduction=reduction, chunk_size=8)(hidden, weight, labels, bias)
    expected, grads = reference_loss(hidden, weight, labels, bias, reduction=reduction)
    assert rel_err(loss, expected) <= 2e-4
    if trainable == "none":
        assert not loss.requires_grad
        return
    loss.sum().backward()
    for name, t in named.items():
        assert (t.grad is not None) == (name in grads), name
    _grads_match({k: v for k, v in named.items() if k in grads}, grads)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_nan_in_ignored_rows_does_not_leak(backend):
    """A NaN hidden state at an ignored position carries no loss: it must not reach the loss or the gradients."""
    hidden, weight, labels, _ = make_inputs(12, 8, 20, ignore_frac=0.0)
    labels[[2, 7]] = -100
    hidden[2, 3] = float("nan")
    hidden[7] = float("inf")
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    loss = FusedLMLoss(chunk_size=4)(hidden, weight, labels)
    loss.backward()
    kept = labels != -100
    expected, grads = reference_loss(hidden[kept].detach(), weight, labels[kept])
    assert torch.isfinite(loss) and rel_err(loss, expected) <= 2e-4
    assert torch.all(hidden.grad[~kept] == 0) and torch.isfinite(weight.grad).all()


def test_labels_on_another_device_raise():
    if not torch.cuda.is_available():
        pytest.skip("needs a second device")
    hidden, weight, labels, _ = make_inputs(4, 8, 10)
    with pytest.raises(ValueError, match="labels are on"):
        FusedLMLoss()(hidden.cuda(), weight.cuda(), labels.cpu())


def test_many_calls_do_not_grow_memory(backend):
    """Thousands of calls (with and without backward, retain_graph dropped): no tensors kept alive."""
    import gc

    hidden, weight, labels, _ = make_inputs(16, 8, 20)
    weight.requires_grad_(True)
    loss_fn = FusedLMLoss(chunk_size=8)

    def live_tensors():
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))

    for _ in range(20):  # warm up caches
        loss_fn(hidden, weight, labels).backward()
    before = live_tensors()
    for step in range(60 if backend == "triton" else 2000):  # the interpreter is slow; the loop is the same
        loss = loss_fn(hidden, weight, labels)
        if step % 2:
            loss.backward()
        del loss
    weight.grad = None
    assert live_tensors() <= before


@pytest.mark.parametrize("case", ["kept_weights_sum_to_zero", "all_ignored", "no_rows"])
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_class_weighted_mean_with_a_zero_denominator(backend, case, z_loss):
    """The weighted mean divides by the kept targets' summed weights: where they sum to 0, 0 / 0 is NaN in the loss
    and the gradients, as F.cross_entropy; with no kept row at all the loss is 0 and so are the gradients, as
    without class weights (not F.cross_entropy's NaN: README)."""
    n = 0 if case == "no_rows" else 6
    hidden, weight, labels, _ = make_inputs(n, 8, 40)
    class_weight = torch.rand(40) + 0.5
    if case == "kept_weights_sum_to_zero":
        class_weight[labels[labels != -100]] = 0.0
    elif case == "all_ignored":
        labels[:] = -100
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss = FusedLMLoss(class_weight=class_weight, z_loss=z_loss)(h, w, labels)
    loss.backward()
    if case == "kept_weights_sum_to_zero":
        h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
        want = F.cross_entropy(h64 @ w64.T, labels, weight=class_weight.double())
        want.backward()
        assert want.isnan() and loss.isnan()
        assert torch.equal(h.grad.isnan(), h64.grad.isnan()) and torch.equal(w.grad.isnan(), w64.grad.isnan())
    else:
        assert loss == 0 and not h.grad.any() and not w.grad.any()


def test_all_on_meta_gives_shapes(backend):
    """Every tensor on meta (meta-device initialization, shape inference): the loss and gradients come back as
    meta tensors of the right shapes, as eager's do. (torch has no autocast state for meta to ask about.)"""
    hidden = torch.empty(2, 5, 8, device="meta", requires_grad=True)
    weight = torch.empty(40, 8, device="meta", requires_grad=True)
    labels = torch.empty(2, 5, dtype=torch.int64, device="meta")
    loss = FusedLMLoss()(hidden, weight, labels)
    assert loss.device.type == "meta" and loss.shape == ()
    loss.backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape
    per_token = FusedLMLoss(reduction="none")(hidden, weight, labels)
    assert per_token.device.type == "meta" and per_token.shape == (2, 5)
    for expected_grads in ("uniform", None):  # (uniform: backward asks whether the weights are one value)
        hidden.grad = weight.grad = None
        out = token_stats(hidden, weight, labels, **({"expected_grads": expected_grads} if expected_grads else {}))
        (out.logprobs.sum() + out.entropy.sum()).backward()
        assert out.logprobs.shape == (2, 5) and hidden.grad.shape == hidden.shape and weight.grad.is_meta
    hidden.grad = None
    divergence = fused_divergence(hidden, weight, hidden.detach(), weight.detach(), labels)
    divergence.backward()
    assert divergence.is_meta and hidden.grad.shape == hidden.shape


def test_all_on_meta_with_the_triton_backend_chosen(monkeypatch):
    """Meta tensors run no kernel, so a chosen Triton backend does not need CUDA or the interpreter for them (the
    GPU suite runs with the backend chosen; this failed there, not on the CPU, where the interpreter is on)."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    hidden = torch.empty(2, 5, 8, device="meta", requires_grad=True)
    weight = torch.empty(40, 8, device="meta", requires_grad=True)
    with use_backend("triton"):
        loss = FusedLMLoss()(hidden, weight, torch.empty(2, 5, dtype=torch.int64, device="meta"))
        loss.backward()
    assert loss.is_meta and hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape


def test_a_meta_tensor_beside_real_ones_raises(backend):
    """A meta tensor among the operator's inputs (a class-weight buffer left on meta by meta-device initialization)
    would make the dispatcher run the fake implementation: uninitialized outputs. A ValueError names it."""
    hidden, weight, labels, _ = make_inputs(6, 8, 40)
    with pytest.raises(ValueError, match="class_weight on the meta device"):
        FusedLMLoss(class_weight=torch.ones(40, device="meta"))(hidden, weight, labels)
    with pytest.raises(ValueError, match="num_items on the meta device"):
        FusedLMLoss()(hidden, weight, labels, num_items_in_batch=torch.tensor(3.0, device="meta"))
