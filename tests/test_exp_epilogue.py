"""The Hopper path (exp_epilogue.py, ``plan.exp_epilogue``): the logits GEMM's epilogue writes E = exp(z - k) per
(row, tile), the statistics and the target logit from the fp32 accumulator; loss and gradients come from those.

On CPU the epilogue's PyTorch twin stands in for the GPU GEMM (the ``served`` fixture tells the plan that the
GEMM serves); on an sm90 GPU with the [hopper] extra the CuTe DSL GEMM itself runs (``test_the_gpu_gemm``). Against
float64 on fresh data, for every option the path serves: the loss to fp32 round-off and the gradients closer than
the bf16-logits path's; what it does not serve keeps that path.
"""
import math

import pytest
import torch

import fused_lm_loss.exp_epilogue as exp_epilogue
import fused_lm_loss.torch_backend as torch_backend
from fused_lm_loss import FusedLMLoss

from .conftest import TEST_DEVICE
from .reference import make_inputs, reference_loss, rel_err


class Served:
    """Says whether the active backend's epilogue GEMM serves (``serve``) and counts its calls. Off the GPU path
    the epilogue's PyTorch twin stands in for the CuTe DSL GEMM."""

    def __init__(self, monkeypatch, backend_name):
        if backend_name == "torch":
            module = torch_backend
        else:
            import fused_lm_loss.kernels as module
        self.monkeypatch, self.module, self.calls = monkeypatch, module, 0
        self.gpu = module is not torch_backend and TEST_DEVICE != "cpu"
        self.supports = module.supports_exp_epilogue if self.gpu else (lambda hidden, weight: True)
        gemm = module.exp_matmul if self.gpu else exp_epilogue.exp_matmul_reference

        def counted(*args):
            self.calls += 1
            return gemm(*args)

        monkeypatch.setattr(module, "exp_matmul", counted)
        self.serve(True)

    def serve(self, on: bool) -> None:
        self.monkeypatch.setattr(self.module, "supports_exp_epilogue", self.supports if on else lambda h, w: False)


@pytest.fixture
def served(monkeypatch, backend):
    served = Served(monkeypatch, backend)
    probe = torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(384, 64, dtype=torch.bfloat16)
    if not served.supports(*probe):
        pytest.skip("no sm90 GPU with quack-kernels / the CuTe DSL here")
    return served


def chunks_of(labels: torch.Tensor, chunk_size: int) -> int:
    """How many chunks of ``chunk_size`` rows the labels' kept rows fill (one GEMM call each)."""
    return math.ceil(int((labels != -100).sum()) / chunk_size)


def run(hidden, weight, labels, *, scaling=None, frozen=False, **options):
    """Loss, dX, dW (None when frozen) of the fused loss on leaf copies."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(not frozen)
    loss = FusedLMLoss(**options)(h, w, labels, scaling=scaling)
    loss.backward()
    return loss.detach(), h.grad, None if frozen else w.grad


@pytest.mark.parametrize("vocab", [384, 640])  # 2 tiles of 192, 5 of 128
@pytest.mark.parametrize("reduction, z_loss, scaling, chunk_size, frozen", [
    ("mean", 0.0, None, None, False),
    ("sum", 1e-3, 3.0, 7, False),  # several chunks, the last one ragged
    ("mean", 1e-3, None, 5, True),  # a frozen head: dX only
])
def test_against_float64(served, vocab, reduction, z_loss, scaling, chunk_size, frozen):
    hidden, weight, labels, _ = make_inputs(37, 64, vocab, dtype=torch.bfloat16, logit_std=4.0)
    options = dict(reduction=reduction, z_loss=z_loss, chunk_size=chunk_size)
    loss, dx, dw = run(hidden, weight, labels, scaling=scaling, frozen=frozen, **options)
    assert served.calls >= 1
    calls = served.calls
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(not frozen)
    want, grads = reference_loss(h64, w64, labels, reduction=reduction, z_loss=z_loss)
    assert rel_err(loss, want) < 2e-6
    served.serve(False)  # the bf16-logits path on the same inputs, for comparison
    base_loss, base_dx, base_dw = run(hidden, weight, labels, scaling=scaling, frozen=frozen, **options)
    assert served.calls == calls
    assert rel_err(base_loss, want) > 4 * rel_err(loss, want)
    assert rel_err(dx, grads["hidden"]) < 0.6 * rel_err(base_dx, grads["hidden"])
    if not frozen:
        assert rel_err(dw, grads["weight"]) < 0.6 * rel_err(base_dw, grads["weight"])


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_rows_whose_target_is_far_below_their_max(served, chunk_size):
    """The tiles of a row share the offset of its target logit unless their max is more than HEADROOM (64 in log2
    units, ~44 nats) above it. Row 0's max is 49 nats above its target and another tile's 44: the first takes an
    offset of its own, the second (and the rest) the shared one, and grad_from_exp moves them to one, which matters
    here (the second tile holds ~1% of the row's probability). Beside rows of one offset in the same chunks, loss and
    gradients stay those of float64."""
    hidden, weight, labels, _ = make_inputs(23, 64, 640, dtype=torch.bfloat16, logit_std=4.0)
    h0 = hidden[0].float()
    labels[0], labels[1] = 8, 7
    z_target = h0.dot(weight[8].float())
    for column, above in ((7, 49.0), (300, 44.0)):  # (columns 7 and 300 lie in different tiles of 128 and of 192)
        weight[column] = (h0 * ((z_target + above) / h0.dot(h0))).bfloat16()
    e = torch.empty(1, 640, dtype=torch.bfloat16)
    k = exp_epilogue.exp_matmul_reference(hidden[:1], weight, labels[:1], e).k[0]
    assert k.amin() < k.amax()  # (the case is the one meant: row 0's tiles do not share an offset)
    loss, dx, dw = run(hidden, weight, labels, chunk_size=chunk_size)
    assert served.calls >= 1
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    want, grads = reference_loss(h64, w64, labels)
    assert rel_err(loss, want) < 2e-6
    assert rel_err(dx, grads["hidden"]) < 4e-3 and rel_err(dw, grads["weight"]) < 4e-3


@pytest.mark.parametrize("scaling", [2.0**-45, 2.0**-64])
def test_a_gradient_scale_too_small_for_the_row_factor_keeps_cublas(served, scaling):
    """Below exp_epilogue.MIN_GRAD_SCALE (``scaling`` / the mean's denominator) a row's factor f could leave fp32's
    normal range and flush to 0, dropping the row's gradient, so the plan keeps the bf16-logits path there: the
    gradients, formed times the scale and unscaled in backward, stay float64's."""
    hidden, weight, labels, _ = make_inputs(21, 64, 640, dtype=torch.bfloat16, logit_std=4.0)
    loss, dx, dw = run(hidden, weight, labels, scaling=scaling)
    assert served.calls == 0
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    want, grads = reference_loss(h64, w64, labels)
    assert rel_err(loss, want) < 1e-2
    assert rel_err(dx, grads["hidden"]) < 1e-2 and rel_err(dw, grads["weight"]) < 1e-2
    run(hidden, weight, labels, scaling=exp_epilogue.MIN_GRAD_SCALE * int((labels != -100).sum()))
    assert served.calls >= 1  # (at the bound it serves)


def test_num_items_and_the_reported_z_loss(served):
    """What reads the epilogue's statistics besides the loss: the mean over num_items_in_batch and the z-loss term
    that return_z_loss reports, against float64."""
    hidden, weight, labels, _ = make_inputs(29, 64, 640, dtype=torch.bfloat16, logit_std=4.0)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    out = FusedLMLoss(z_loss=1e-3, return_z_loss=True, chunk_size=11)(h, w, labels, num_items_in_batch=40)
    out.loss.backward()
    assert served.calls == chunks_of(labels, 11) >= 2
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    want, grads = reference_loss(h64, w64, labels, z_loss=1e-3, num_items_in_batch=40)
    z = hidden.double() @ weight.double().T
    kept = labels != -100
    lse = torch.logsumexp(z[kept], 1)
    assert rel_err(out.loss, want) < 2e-6
    assert rel_err(out.z_loss, 1e-3 * (lse * lse).sum() / 40) < 2e-6
    # (the Triton interpreter rounds fp32 to bf16 toward zero, twice the GPU's error: 4.3e-3 measured there)
    bound = 5e-3 if served.module is not torch_backend and not served.gpu else 4e-3
    assert rel_err(h.grad, grads["hidden"]) < bound and rel_err(w.grad, grads["weight"]) < bound


def test_under_autocast(served):
    """Under autocast (bf16 operands already) the path gives what it gives without: the op's body runs with the
    caller's autocast on, and the epilogue's fp32 products must not be cast down."""
    hidden, weight, labels, _ = make_inputs(21, 64, 384, dtype=torch.bfloat16, logit_std=4.0)
    plain = run(hidden, weight, labels, z_loss=1e-3)
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16):
        cast = run(hidden, weight, labels, z_loss=1e-3)
    assert served.calls == 2
    for a, b in zip(plain, cast):
        assert rel_err(a, b) < 1e-6


@pytest.mark.parametrize("frozen", [False, True])
def test_the_epilogue_does_not_split_a_batch_that_fits_one_chunk(served, monkeypatch, frozen):
    """The epilogue's per-tile statistics (``exp_epilogue.bytes_per_row``) must not turn one chunk into several: a
    second chunk brings the wide dW accumulator (1.05-1.06x against 0.98-0.99x at Qwen2.5-7B, RESULTS.md session 17).
    Such a batch keeps cuBLAS in one chunk; a batch that takes several chunks either way takes the epilogue."""
    from fused_lm_loss import chunked, plan

    hidden, weight, labels, _ = make_inputs(37, 64, 384, dtype=torch.bfloat16, logit_std=4.0)
    chunk_rows = []
    original = chunked.logits_into
    monkeypatch.setattr(chunked, "logits_into",
                        lambda out, *args: chunk_rows.append(out.shape[0]) or original(out, *args))
    monkeypatch.setattr(plan, "exp_epilogue_bytes_per_row", lambda vocab, scaled_rows_bytes: 2**40)  # no row fits with them
    got = run(hidden, weight, labels, frozen=frozen)
    assert served.calls == 0 and chunk_rows == [int((labels != -100).sum())]
    want, grads = reference_loss(hidden.double().requires_grad_(True),
                                 weight.double().requires_grad_(not frozen), labels)
    assert rel_err(got[0], want) < 1e-2 and rel_err(got[1], grads["hidden"]) < 2e-2  # (bf16 logits)
    served.serve(False)
    for a, b in zip(got, run(hidden, weight, labels, frozen=frozen)):  # exactly the default path
        assert (a is None and b is None) or torch.equal(a, b)
    served.serve(True)
    run(hidden, weight, labels, frozen=frozen, chunk_size=7)  # several chunks either way: the epilogue serves
    assert served.calls == chunks_of(labels, 7)


def test_the_statistics_end_with_their_chunk(served, monkeypatch):
    """A chunk's k, sums and target logit are freed before the next chunk's GEMM allocates its own and before the
    dW result is allocated: the plan counts one chunk's (plan.py), so none may outlive its chunk."""
    import weakref

    from fused_lm_loss import chunked

    alive = []

    def no_statistics_left(where):
        assert all(ref() is None for ref in alive), f"a chunk's epilogue statistics are alive at {where}"

    gemm = served.module.exp_matmul

    def tracked(*args):
        no_statistics_left("the next chunk's GEMM")
        stats = gemm(*args)
        alive.extend(weakref.ref(t) for t in (stats.k, stats.sum_exp, stats.target_logit))
        return stats

    finish = chunked.LinearHead.finish

    def checked_finish(head):
        no_statistics_left("the dW result")
        return finish(head)

    monkeypatch.setattr(served.module, "exp_matmul", tracked)
    monkeypatch.setattr(chunked.LinearHead, "finish", checked_finish)
    hidden, weight, labels, _ = make_inputs(23, 64, 384, dtype=torch.bfloat16)
    run(hidden, weight, labels, chunk_size=8)
    assert served.calls == chunks_of(labels, 8) >= 2 and len(alive) == 3 * served.calls


@pytest.mark.parametrize("options", [
    dict(softcap=30.0), dict(logit_scale=0.5), dict(temperature=2.0), dict(label_smoothing=0.1),
    dict(return_token_accuracy=True), "class_weight", "bias", dict(logits_dtype=torch.float32),
    dict(reduction="none"),
], ids=str)
def test_what_the_epilogue_does_not_serve_keeps_the_logits(served, options):
    """Options the epilogue does not apply (a transform, sums over the logits, the top-1, a bias, fp32 logits) leave
    the plan on the cuBLAS + statistics path: the epilogue never runs. Nor for reduction="none", whose forward (no
    gradients) takes the lse from the rounded logits that its backward's recompute must then agree with."""
    hidden, weight, labels, bias = make_inputs(19, 64, 384, dtype=torch.bfloat16, bias=options == "bias")
    if options == "class_weight":
        options = dict(class_weight=torch.rand(384) + 0.5)
    elif options == "bias":
        options = {}
    h = hidden.clone().requires_grad_(True)
    out = FusedLMLoss(**options)(h, weight, labels, bias=bias) if bias is not None else FusedLMLoss(**options)(
        h, weight, labels)
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    assert served.calls == 0


def test_only_the_gpu_tested_tile_widths_serve():
    """192 or 128 columns (what the GPU tests ran); a vocabulary neither divides is not served (``supported``)."""
    assert [exp_epilogue.tile_width(v) for v in (128256, 151936, 256000, 384, 640, 320, 32001)] == [
        192, 128, 128, 192, 128, None, None]
    probe = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert not exp_epilogue.supported(probe, torch.zeros(320, 64, dtype=torch.bfloat16))


def test_the_exp_statistics_twin_against_float64():
    """exp_matmul_reference: E * 2^k is exp(z), the sums are E's, k an integer per tile, the target logit z's."""
    hidden, weight, labels, _ = make_inputs(9, 16, 640, dtype=torch.bfloat16, ignore_frac=0.0)
    target = labels.clone()
    e = torch.empty(9, 640, dtype=torch.bfloat16)
    stats = exp_epilogue.exp_matmul_reference(hidden, weight, target, e)
    z = hidden.double() @ weight.double().T
    tile = stats.tile_n
    assert tile == 128 and stats.k.shape == (9, 5)
    assert torch.equal(stats.k, stats.k.round())
    scale = torch.exp2(stats.k.double()).repeat_interleave(tile, 1)
    assert rel_err(e.double() * scale, torch.exp(z)) < 4e-3  # E rounded once to bf16
    assert rel_err(stats.sum_exp.double(), (torch.exp(z) / scale).view(9, 5, tile).sum(2)) < 1e-6
    assert rel_err(stats.target_logit, z.gather(1, target[:, None]).squeeze(1)) < 1e-6


@pytest.mark.skipif(TEST_DEVICE == "cpu", reason="the CuTe DSL GEMM needs an sm90 GPU")
def test_the_gpu_gemm():
    """On an sm90 GPU with the [hopper] extra: the plan takes the epilogue GEMM, the ragged row count included, and
    its outputs equal the PyTorch twin's to the GEMM's fp32 accumulation order."""
    hidden, weight, labels, _ = make_inputs(1000, 256, 4096, dtype=torch.bfloat16, ignore_frac=0.0)
    if not exp_epilogue.supported(hidden, weight):
        pytest.skip("no sm90 GPU with quack-kernels / the CuTe DSL here")
    e, e_ref = torch.empty(1000, 4096, dtype=torch.bfloat16), torch.empty(1000, 4096, dtype=torch.bfloat16)
    stats = exp_epilogue.exp_matmul(hidden, weight, labels, e)
    ref = exp_epilogue.exp_matmul_reference(hidden, weight, labels, e_ref)
    assert torch.equal(stats.k, ref.k)  # integers: a difference would be a max differing across a rounding tie
    assert rel_err(e, e_ref) < 8e-3 and rel_err(stats.sum_exp, ref.sum_exp) < 1e-5
    assert rel_err(stats.target_logit, ref.target_logit) < 1e-5
    assert not exp_epilogue.supported(hidden[:, :0], weight[:, :0])  # H = 0: an empty K loop never ran here


@pytest.mark.parametrize("found, says", [
    ({"quack-kernels": "0.7.0", "nvidia-cutlass-dsl": "4.8.1"}, "tested with quack-kernels 0.6.5"),
    ({"quack-kernels": "0.6.5", "nvidia-cutlass-dsl": "4.9.0"}, "found 0.6.5 and 4.9.0"),
    ({"quack-kernels": "0.6.5", "nvidia-cutlass-dsl": "4.8.1"}, "does not import"),  # (not installed here)
])
def test_untested_or_broken_quack_is_said_and_not_used(monkeypatch, found, says):
    """Only the pinned versions of the [hopper] extra serve; any other, or one that does not import, is named in a
    warning and the plan keeps cuBLAS + row_stats."""
    import importlib.metadata
    import sys

    if "quack" in sys.modules:
        pytest.skip("quack-kernels is imported in this process")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: found[name])
    monkeypatch.setitem(sys.modules, "quack", None)  # an import of it fails, as where the DSL is broken
    exp_epilogue._quack_epilogue.cache_clear()
    try:
        with pytest.warns(UserWarning, match=says):
            assert exp_epilogue._quack_epilogue() is None
    finally:
        exp_epilogue._quack_epilogue.cache_clear()
