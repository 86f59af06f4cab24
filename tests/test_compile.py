"""torch.compile(fullgraph=True) through the fused loss: one opaque node, no graph break, no recompile when the
number of ignored labels changes, and the same loss and gradients as eager."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fused_lm_loss
import fused_lm_loss.ops
from fused_lm_loss import FusedLMLoss, fused_linear_cross_entropy

from .conftest import TEST_DEVICE
from .reference import reference_loss, rel_err

N, H, V = 48, 16, 97


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _batches(count, *, seed=0):
    """Batches of the same shape whose number of ignored labels differs from one to the next."""
    g = torch.Generator("cpu").manual_seed(seed)
    for k in range(count):
        x = torch.randn(N, H, generator=g, device="cpu").to(TEST_DEVICE)
        y = torch.randint(0, V, (N,), generator=g, device="cpu").to(TEST_DEVICE)
        y[: 7 * k] = -100
        yield x, y


class Step(torch.nn.Module):
    """A projection before the loss, so the compiled graph has work of its own around the fused op."""

    def __init__(self, loss):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(H, H)
        self.head = torch.nn.Parameter(torch.randn(V, H) * 0.3)
        self.loss = loss

    def forward(self, x, y):
        return self.loss(self.proj(x), self.head, y)


STEPS = {
    "module": lambda: FusedLMLoss(label_smoothing=0.1, softcap=30.0, z_loss=1e-3, chunk_size=16),
    "functional": lambda: lambda h, w, y: fused_linear_cross_entropy(
        h, w, y, num_items_in_batch=torch.tensor(40.0), logit_scale=0.7
    ),
    "reduction_none": lambda: FusedLMLoss(reduction="none", chunk_size=16),
    "reduction_none_kept_logits": lambda: FusedLMLoss(reduction="none", chunk_size=16, keep_logits=True),
}


@pytest.mark.parametrize("backend_name", ["torch", "triton"] if TEST_DEVICE != "cpu" else ["torch"])
@pytest.mark.parametrize("kind", STEPS)
def test_fullgraph_matches_eager_without_recompiles(kind, backend_name):
    step = Step(STEPS[kind]())
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    with fused_lm_loss.use_backend(backend_name):
        for x, y in _batches(3):
            out = compiled(x, y)
            weights = torch.rand(out.shape) if out.dim() else torch.tensor(1.0)  # non-uniform per-token grads
            (out * weights).sum().backward()
            got = [p.grad.clone() for p in step.parameters()]
            step.zero_grad(set_to_none=True)
            want = step(x, y)
            (want * weights).sum().backward()
            assert rel_err(out, want) <= 1e-5
            for a, p in zip(got, step.parameters()):
                assert rel_err(a, p.grad) <= 1e-5
            step.zero_grad(set_to_none=True)
    assert counter.frame_count == 1  # one graph for all three ignored counts: no recompilation
    assert torch._dynamo.utils.counters["graph_break"] == {}


def test_compiled_backward_keeps_the_scaling_rules():
    """Compiled backward rescales out of place (retain_graph twice = twice the gradient) and still refuses
    a non-zero grad_output when the loss was computed with scaling=0."""
    hidden = torch.randn(N, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    (x, y), = _batches(1)

    def step(h, w, labels):
        return fused_linear_cross_entropy(h, w, labels, scaling=8.0)

    loss = torch.compile(step, fullgraph=True)(hidden, weight, y)
    (loss * 8.0).backward(retain_graph=True)
    (loss * 8.0).backward()
    expected, grads = reference_loss(hidden, weight, y)
    assert rel_err(loss, expected) <= 1e-5
    assert rel_err(weight.grad, 2 * 8.0 * grads["weight"]) <= 1e-5
    assert rel_err(hidden.grad, 2 * 8.0 * grads["hidden"]) <= 1e-5

    zero = torch.compile(lambda h, w, labels: fused_linear_cross_entropy(h, w, labels, scaling=0.0), fullgraph=True)
    with pytest.raises(RuntimeError, match="scaling=0"):
        zero(hidden, weight, y).backward()


def test_patched_llama_compiles_fullgraph(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from .integrations.hf_models import assert_close_grads, grads, make_batch, make_model, twin

    calls = []
    original = fused_lm_loss.ops.run_chunks
    monkeypatch.setattr(fused_lm_loss.ops, "run_chunks", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = make_model("llama").to(TEST_DEVICE)
    ref = twin(model)
    fused_lm_loss.patch(model)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    compiled_ref = torch.compile(ref, fullgraph=True)
    for seed in range(3):
        batch = {k: v.to(TEST_DEVICE) for k, v in make_batch(seed=seed).items()}
        batch["labels"][1, : seed + 1] = -100  # a different ignored count each step
        out = compiled(**batch)
        out.loss.backward()
        want = compiled_ref(**batch)
        want.loss.backward()
        assert out.logits is None
        assert rel_err(out.loss, want.loss) <= 1e-5
        assert_close_grads(grads(model), grads(ref), tol=1e-5)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    assert counter.frame_count == 1
    assert len(calls) == 3  # the compiled model ran the fused loss at every step
    assert transformers is not None


@pytest.mark.parametrize("frozen,sft,keep", [(False, False, False), (True, False, False), (False, True, False),
                                             (False, False, True)],
                         ids=["rl-trainable", "rl-frozen", "sft", "rl-trainable-kept-logits"])
def test_token_stats_compile_fullgraph(frozen, sft, keep):
    """The per-token outputs under torch.compile(fullgraph=True): the same outputs and gradients (random per-token
    weights, or the SFT mean whose gradients forward makes) as eager, one frame across different ignored
    counts."""
    from fused_lm_loss import token_stats

    step = Step(None)
    step.head.requires_grad_(not frozen)

    def rl_loss(x, y, a, b):
        if sft:
            out = token_stats(step.proj(x), step.head, y, expected_grads="uniform")
            return -out.logprobs.sum() / (y != -100).sum()
        out = token_stats(step.proj(x), step.head, y, temperature=0.8, keep_logits=keep)
        return (out.logprobs * a).sum() + (out.entropy * b).sum() + out.is_top1.float().sum() * 0

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(rl_loss, backend=counter, fullgraph=True)
    for x, y in _batches(3):
        a, b = torch.randn(N), torch.randn(N)
        got_loss = compiled(x, y, a, b)
        got_loss.backward()
        got = [None if p.grad is None else p.grad.clone() for p in step.parameters()]
        step.zero_grad(set_to_none=True)
        want_loss = rl_loss(x, y, a, b)
        want_loss.backward()
        assert rel_err(got_loss, want_loss) <= 1e-5
        for g, p in zip(got, step.parameters()):
            assert (g is None) == (p.grad is None)
            if g is not None:
                assert rel_err(g, p.grad) <= 1e-5
        step.zero_grad(set_to_none=True)
    assert counter.frame_count == 1


OUTPUT_OPTIONS = {
    "return_z_loss": dict(z_loss=1e-2, return_z_loss=True),
    "return_token_accuracy": dict(return_token_accuracy=True),
    "both_sum": dict(z_loss=1e-2, reduction="sum", return_z_loss=True, return_token_accuracy=True),
    "none_with_extras": dict(z_loss=1e-2, reduction="none", return_z_loss=True, return_token_accuracy=True),
    "none_keep_logits": dict(reduction="none", keep_logits=True, return_z_loss=True, z_loss=1e-2),
    "class_weight_extras": dict(class_weight=torch.rand(V) + 0.5, return_z_loss=True, z_loss=1e-2,
                                return_token_accuracy=True),
}


@pytest.mark.parametrize("backend_name", ["torch", "triton"] if TEST_DEVICE != "cpu" else ["torch"])
@pytest.mark.parametrize("kind", OUTPUT_OPTIONS)
def test_every_output_is_right_under_compile(kind, backend_name):
    """Each option that adds or reshapes an output, compiled with fullgraph: every output used in arithmetic gives
    eager's value and gradients (a fake implementation that described an output wrongly would change them)."""
    options = dict(OUTPUT_OPTIONS[kind], chunk_size=16, temperature=0.9)
    if "class_weight" in options:
        options["class_weight"] = options["class_weight"].to(TEST_DEVICE)
    step = Step(FusedLMLoss(**options))

    def total(x, y):
        out = step(x, y)
        loss = out.loss * 1.0
        if out.z_loss is not None:
            assert out.z_loss.shape == out.loss.shape
            loss = loss + 100.0 * out.z_loss
        if out.token_accuracy is not None:
            assert out.token_accuracy.shape == out.loss.shape
            loss = loss + 10.0 * out.token_accuracy
        return loss * torch.linspace(0.5, 1.5, loss.numel(), device=loss.device).view(loss.shape)

    compiled = torch.compile(total, fullgraph=True)
    with fused_lm_loss.use_backend(backend_name):
        for x, y in _batches(2):
            got = compiled(x, y)
            got.sum().backward()
            got_grads = [p.grad.clone() for p in step.parameters()]
            step.zero_grad(set_to_none=True)
            want = total(x, y)
            want.sum().backward()
            assert got.shape == want.shape and rel_err(got, want) <= 1e-5
            for g, p in zip(got_grads, step.parameters()):
                assert rel_err(g, p.grad) <= 1e-5
            step.zero_grad(set_to_none=True)


def test_every_token_stats_output_is_right_under_compile():
    """All seven token_stats outputs (the two extra ones asked for) used in arithmetic under fullgraph compile,
    against eager."""
    from fused_lm_loss import token_stats

    step = Step(None)

    def total(x, y):
        out = token_stats(step.proj(x), step.head, y, temperature=0.8, softcap=7.0,
                          extra_outputs=("mean_logits", "log_sum_sq_probs"))
        return (out.logprobs + 0.1 * out.entropy + 0.01 * out.lse + out.is_top1.float()
                + (out.argmax + 1).float() / V + 0.3 * out.mean_logits + 0.2 * out.log_sum_sq_probs).sum()

    compiled = torch.compile(total, fullgraph=True)
    for x, y in _batches(2):
        got = compiled(x, y)
        got.backward()
        got_grads = [p.grad.clone() for p in step.parameters()]
        step.zero_grad(set_to_none=True)
        want = total(x, y)
        want.backward()
        assert rel_err(got, want) <= 1e-6
        for g, p in zip(got_grads, step.parameters()):
            assert rel_err(g, p.grad) <= 1e-5
        step.zero_grad(set_to_none=True)


def test_changing_float_options_and_a_grad_scaler_compile_fullgraph():
    """A temperature / z-loss schedule or a Python-float scaling that changes between steps (each value compiles
    anew: torch.compile specializes a custom operator's float arguments; README, torch.compile) and a GradScaler's
    scale (read as its attributes, before and after its first scale()) compile with fullgraph=True and give eager's
    numbers."""
    hidden = torch.randn(N, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    (x, y), = _batches(1)

    def step(h, w, labels, temperature, scaling):
        return fused_linear_cross_entropy(h, w, labels, temperature=temperature, z_loss=temperature / 100,
                                          scaling=scaling)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for temperature, scaling in ((0.7, 1024.0), (0.9, 512.0), (1.3, 2.0)):
        got, want = compiled(hidden, weight, y, temperature, scaling), step(hidden, weight, y, temperature, scaling)
        assert rel_err(got, want) <= 1e-6
    for first_step in (True, False):
        scaler = torch.amp.GradScaler(TEST_DEVICE, init_scale=256.0)
        if not first_step:
            scaler.scale(torch.ones((), device=TEST_DEVICE))  # its scale tensor now exists
        loss_fn = FusedLMLoss(grad_scaler=scaler)
        torch._dynamo.reset()
        loss = torch.compile(lambda h, w: loss_fn(h, w, y), backend="aot_eager", fullgraph=True)(hidden, weight)
        hidden.grad = weight.grad = None
        scaler.scale(loss).backward()
        expected, grads = reference_loss(hidden, weight, y)
        assert rel_err(loss, expected) <= 1e-5 and rel_err(hidden.grad, 256.0 * grads["hidden"]) <= 1e-5
