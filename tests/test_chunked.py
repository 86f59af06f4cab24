"""The operator's autograd contract (GradScaler semantics, retain_graph, no-grad forward) and the chunk plan."""
import gc
import random

import pytest
import torch

import fused_lm_loss
import fused_lm_loss.chunked as chunked
import fused_lm_loss.plan as plan
from fused_lm_loss import torch_backend
from fused_lm_loss import FusedLMLoss

from .conftest import TEST_DEVICE, requires_triton

from .reference import make_inputs, reference_loss, rel_err


def _inputs(n=40, h=16, v=90):
    hidden, weight, labels, bias = make_inputs(n, h, v, bias=True)
    for t in (hidden, weight, bias):
        t.requires_grad_(True)
    return hidden, weight, labels, bias


def test_factor_one_returns_saved_gradients_as_they_are(backend):
    """scaling=S and grad_output=S: factor 1.0, the tensors made in forward reach autograd uncopied."""
    hidden, weight, labels, bias = _inputs()
    seen = {}
    hidden.register_hook(lambda g: seen.setdefault("hidden", g))
    loss = FusedLMLoss(chunk_size=16)(hidden, weight, labels, bias, scaling=1024.0)
    saved_hidden = loss.grad_fn.saved_tensors[1]  # saved: (scale, d hidden, d weight, d bias, d u, d B)
    (loss * 1024.0).backward()
    assert seen["hidden"].data_ptr() == saved_hidden.data_ptr()
    expected, grads = reference_loss(hidden, weight, labels, bias)
    assert rel_err(loss, expected) <= 2e-4  # the loss itself is never scaled
    for t, name in ((hidden, "hidden"), (weight, "weight"), (bias, "bias")):
        assert rel_err(t.grad, 1024.0 * grads[name]) <= 2e-4, name


@pytest.mark.parametrize("retain_graph", [False, True])
def test_param_grad_adopts_the_saved_gradient_unless_the_graph_is_retained(backend, retain_graph):
    """Factor 1.0 without retain_graph: the engine has released the saved dW by the time it sets weight.grad,
    so it adopts that tensor (no copy: no V x H of extra memory or traffic). With retain_graph the saved dW
    stays alive and weight.grad is a copy, so that a second backward cannot accumulate into it."""
    hidden, weight, labels, bias = _inputs()
    loss = FusedLMLoss(chunk_size=16)(hidden, weight, labels, bias)
    saved_ptr = loss.grad_fn.saved_tensors[2].data_ptr()  # no reference kept: only the graph holds it
    loss.backward(retain_graph=retain_graph)
    assert (weight.grad.data_ptr() == saved_ptr) == (not retain_graph)
    _, grads = reference_loss(hidden, weight, labels, bias)
    assert rel_err(weight.grad, grads["weight"]) <= 2e-4
    if retain_graph:
        loss.backward()
        assert rel_err(weight.grad, 2 * grads["weight"]) <= 2e-4


def test_grad_scaler_scale_is_used(backend):
    """A fresh scaler has no scale tensor yet (its init_scale is used); after scale() its tensor is read."""
    scaler = torch.amp.GradScaler(torch.get_default_device().type, init_scale=2.0**12)
    hidden, weight, labels, bias = _inputs()
    _, grads = reference_loss(hidden, weight, labels, bias)
    for step in range(2):
        hidden.grad = weight.grad = bias.grad = None
        loss = FusedLMLoss(grad_scaler=scaler, chunk_size=16)(hidden, weight, labels, bias)
        assert (scaler._scale is None) == (step == 0)
        scaler.scale(loss).backward()
        assert rel_err(weight.grad, 2.0**12 * grads["weight"]) <= 2e-4
        assert rel_err(hidden.grad, 2.0**12 * grads["hidden"]) <= 2e-4


def test_grad_scaler_scale_is_used_on_given_logits(backend):
    """The loss of logits that already exist (``causal_lm_loss``: a patched model's eval loss, the integrations)
    makes d logits in the logits' dtype times the scaler's scale, as autograd through F.cross_entropy would see
    them after scale(loss): fp16 keeps them. Unscaled, 1 / num_items_in_batch times p would flush most of them
    to 0 in fp16. Checked against float64 at both steps (init_scale, then the scale tensor)."""
    from fused_lm_loss.loss import logits_loss

    scale, num_items = 2.0**16, 2**20
    logits = (torch.randn(24, 300, dtype=torch.float64) * 3).half()
    labels = torch.randint(0, 300, (24,))
    labels[::5] = -100
    z = logits.double().requires_grad_(True)
    torch.nn.functional.cross_entropy(z, labels, reduction="sum").div(num_items).backward()
    scaler = torch.amp.GradScaler(torch.get_default_device().type, init_scale=scale)
    opts = FusedLMLoss(grad_scaler=scaler).options
    for step in range(2):
        x = logits.clone().requires_grad_(True)
        loss = logits_loss(x, labels, opts, num_items_in_batch=num_items)
        assert (scaler._scale is None) == (step == 0)
        scaler.scale(loss).backward()
        assert x.grad.dtype == torch.float16
        assert rel_err(x.grad.double() / scale, z.grad) <= 2e-3  # fp16 rounding of each element
        assert rel_err(loss, torch.nn.functional.cross_entropy(z.detach(), labels, reduction="sum") / num_items) <= 1e-5


def test_disabled_grad_scaler_scales_by_one(backend):
    """GradScaler(enabled=False) (as in ``GradScaler(enabled=use_fp16)``): scale(loss) is the loss itself, so the
    gradients are the plain ones. A disabled scaler has no ``_scale`` attribute at all."""
    scaler = torch.amp.GradScaler(torch.get_default_device().type, enabled=False)
    hidden, weight, labels, bias = _inputs()
    loss = FusedLMLoss(grad_scaler=scaler, chunk_size=16)(hidden, weight, labels, bias)
    scaler.scale(loss).backward()
    expected, grads = reference_loss(hidden, weight, labels, bias)
    assert rel_err(loss, expected) <= 2e-5
    assert rel_err(weight.grad, grads["weight"]) <= 2e-4 and rel_err(hidden.grad, grads["hidden"]) <= 2e-4


@pytest.mark.parametrize("k", [1.0, 4.0])
def test_retain_graph_twice_accumulates_twice_and_never_bumps_saved(backend, k):
    """grad_output = S / k: factor 1 / k, applied out of place, so two backwards give twice the gradient."""
    hidden, weight, labels, bias = _inputs()
    loss = FusedLMLoss(chunk_size=16)(hidden, weight, labels, bias, scaling=8.0)
    saved = loss.grad_fn.saved_tensors[1:4]  # (scale, d hidden, d weight, d bias, ...)
    copies = [g.clone() for g in saved]
    (loss * (8.0 / k)).backward(retain_graph=True)
    (loss * (8.0 / k)).backward(retain_graph=True)
    for before, after in zip(copies, saved):
        assert torch.equal(before, after)
    _, grads = reference_loss(hidden, weight, labels, bias)
    for t, name in ((hidden, "hidden"), (weight, "weight"), (bias, "bias")):
        assert rel_err(t.grad, 2 * (8.0 / k) * grads[name]) <= 2e-4, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("factor", [1.0, 0.37, 3.0])
def test_backward_keeps_the_factor_on_the_device_unless_the_graph_is_kept(backend, monkeypatch, dtype, factor):
    """Without retain_graph backward never reads grad_output / scaling on the host (``grad_factor`` is its one
    host read): the device applies it, in place on gradients already in their dtype. The gradients are those of the
    host path (retain_graph, out of place) on the same forward, bitwise, and float64's within bf16's rounding."""
    from fused_lm_loss import ops_common

    host_reads = []
    grad_factor = ops_common.grad_factor
    monkeypatch.setattr(ops_common, "grad_factor", lambda *a: host_reads.append(a) or grad_factor(*a))
    hidden, weight, labels, bias = make_inputs(48, 16, 90, bias=True, dtype=dtype)
    results = {}
    for retain in (True, False):
        leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
        loss = FusedLMLoss(chunk_size=16)(leaves[0], leaves[1], labels, leaves[2], scaling=0.5)
        (loss * (0.5 * factor)).backward(retain_graph=retain)
        assert bool(host_reads) == retain
        host_reads.clear()
        results[retain] = [t.grad for t in leaves]
    _, grads = reference_loss(*(t.requires_grad_(True) for t in (hidden, weight)), labels, bias.requires_grad_(True))
    for name, on_device, on_host in zip(("hidden", "weight", "bias"), results[False], results[True]):
        assert on_device.dtype == dtype
        assert torch.equal(on_device, on_host), name
        assert rel_err(on_device, 0.5 * factor * grads[name]) <= (2e-4 if dtype == torch.float32 else 1e-2), name


def test_autograd_grad_gets_the_gradients_scaled_on_the_device(backend):
    """torch.autograd.grad (no retain_graph) returns the saved gradients themselves, scaled in place: the values are
    those of the factor; a second call on the freed graph raises PyTorch's error."""
    hidden, weight, labels, bias = _inputs()
    loss = FusedLMLoss(chunk_size=16)(hidden, weight, labels, bias)
    saved_ptr = loss.grad_fn.saved_tensors[2].data_ptr()
    d_hidden, d_weight = torch.autograd.grad(loss * 2.5, (hidden, weight))
    assert d_weight.data_ptr() == saved_ptr
    _, grads = reference_loss(hidden, weight, labels, bias)
    assert rel_err(d_weight, 2.5 * grads["weight"]) <= 2e-4 and rel_err(d_hidden, 2.5 * grads["hidden"]) <= 2e-4
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(loss * 2.5, (hidden,))


@pytest.mark.skipif(TEST_DEVICE == "cpu", reason="host syncs exist only with a device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_does_not_sync_with_the_host(dtype):
    """The mean loss's backward without retain_graph: CUDA's sync debug mode raises at any host sync."""
    hidden, weight, labels, _ = make_inputs(300, 64, 1000, dtype=dtype)
    hidden.requires_grad_(True), weight.requires_grad_(True)
    for factor in (1.0, 0.25):
        hidden.grad = weight.grad = None
        loss = FusedLMLoss(chunk_size=128)(hidden, weight, labels)
        torch.cuda.set_sync_debug_mode("error")
        try:
            (loss * factor).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        _, grads = reference_loss(hidden, weight, labels)
        assert rel_err(weight.grad, factor * grads["weight"]) <= 1e-2
        assert rel_err(hidden.grad, factor * grads["hidden"]) <= 1e-2


def test_scale_zero(backend):
    hidden, weight, labels, bias = _inputs()
    loss = FusedLMLoss()(hidden, weight, labels, bias, scaling=0.0)
    with pytest.raises(RuntimeError, match="scaling=0"):
        loss.backward(retain_graph=True)
    (loss * 0.0).backward()
    for t in (hidden, weight, bias):
        assert torch.all(t.grad == 0)


def test_scalings_at_the_edges_of_fp32(backend):
    """Forward forms the gradients in fp32 times the scaling and backward rescales them by its reciprocal: at the
    accepted range's ends the gradients are the unscaled ones; beyond it (reciprocal or product out of fp32) a
    ValueError, given as a number or as a tensor, where inf / NaN gradients came back silently."""
    hidden, weight, labels, bias = _inputs()
    _, grads = reference_loss(hidden, weight, labels, bias)
    for scaling in (2.0**-64, 2.0**64):
        for t in (hidden, weight, bias):
            t.grad = None
        (FusedLMLoss()(hidden, weight, labels, bias, scaling=scaling) * scaling).backward()
        for t, name in ((hidden, "hidden"), (weight, "weight"), (bias, "bias")):
            assert rel_err(t.grad / scaling, grads[name]) <= 2e-4, (scaling, name)
    for scaling in (1e-40, 2.0**-65, 2.0**65, 1e300):
        for given in (scaling, torch.tensor(scaling)):
            with pytest.raises(ValueError, match="between 2\\*\\*-64 and 2\\*\\*64"):
                FusedLMLoss()(hidden, weight, labels, bias, scaling=given)


def test_fp16_gradients_do_not_underflow_with_scaling():
    """Mean over many tokens: p / N underflows fp16; the scale is applied in fp32 before rounding."""
    hidden, weight, labels, _ = make_inputs(2048, 32, 400, dtype=torch.float16, logit_std=6.0, ignore_frac=0.0)
    weight.requires_grad_(True)
    _, grads = reference_loss(hidden, weight, labels)
    errors = {}
    for scale in (1.0, 2.0**16):
        weight.grad = None
        loss = FusedLMLoss(chunk_size=512, accum_dtype=None)(hidden, weight, labels, scaling=scale)
        (loss * scale).backward()
        errors[scale] = rel_err(weight.grad.float() / scale, grads["weight"])
    assert errors[2.0**16] < 5e-3
    assert errors[2.0**16] < errors[1.0]


def _forbid(monkeypatch, module, name):
    def fail(*args, **kwargs):
        raise AssertionError(f"{name} must not run")

    monkeypatch.setattr(module, name, fail)


def test_no_grad_forward_does_no_gradient_work(monkeypatch):
    hidden, weight, labels, bias = _inputs()
    _forbid(monkeypatch, torch_backend, "grad_logits")
    with torch.no_grad():
        loss = FusedLMLoss()(hidden, weight, labels, bias)
    frozen = FusedLMLoss()(hidden.detach(), weight.detach(), labels, bias.detach())
    expected, _ = reference_loss(hidden, weight, labels, bias)
    assert rel_err(loss, expected) <= 2e-4 and rel_err(frozen, expected) <= 2e-4
    assert not frozen.requires_grad


EPILOGUE_CASES = {
    "plain": ({}, False),
    "features_bias": (dict(label_smoothing=0.2, z_loss=1e-2, softcap=5.0, logit_scale=1.3), True),
    "fp32_logits": (dict(logits_dtype=torch.float32), False),
}


def _half_inputs_for_the_epilogue_kernel(n, h, v, with_bias):
    """fp16 under the interpreter (its bf16 TMA dots are wrong), bf16 on a GPU; skip where unsupported."""
    from fused_lm_loss.kernels import matmul_stats

    dtype = torch.float16 if TEST_DEVICE == "cpu" else torch.bfloat16
    hidden, weight, labels, bias = make_inputs(n, h, v, dtype=dtype, bias=with_bias, seed=5)
    if not matmul_stats.supported(hidden, weight):
        pytest.skip("the matmul-epilogue statistics need sm90+ and Triton tensor descriptors, or the interpreter")
    return hidden, weight, labels, bias


@requires_triton
@pytest.mark.parametrize("case", EPILOGUE_CASES.values(), ids=EPILOGUE_CASES.keys())
def test_no_grad_forward_takes_the_statistics_from_the_matmul(monkeypatch, case):
    """Without gradients no logits chunk is made: the Triton path takes the row statistics from the logits
    matmul's epilogue, chunk by chunk, and gives the stored-logits path's loss."""
    from fused_lm_loss import kernels
    from fused_lm_loss.kernels import matmul_stats

    options, with_bias = case
    hidden, weight, labels, bias = _half_inputs_for_the_epilogue_kernel(150, 32, 600, with_bias)
    launches = []
    original = matmul_stats.matmul_partials

    def spy(h, *args, **kwargs):
        launches.append(h.shape[0])
        return original(h, *args, **kwargs)

    monkeypatch.setattr(kernels, "matmul_partials", spy)  # what the triton backend calls
    with fused_lm_loss.use_backend("triton"), torch.no_grad():
        stored = FusedLMLoss(chunk_size=64, **options)
        with monkeypatch.context() as m:
            m.setattr(kernels, "supports_stats_in_matmul", lambda hidden, weight: False)
            expected_same = stored(hidden, weight, labels, bias)
        assert launches == []
        _forbid(monkeypatch, chunked, "logits_into")
        loss = FusedLMLoss(chunk_size=64, **options)(hidden, weight, labels, bias)
    n_rows = int((labels != -100).sum())
    step = plan.split_rows(n_rows, 64)
    assert n_rows > 64 and launches == [min(step, n_rows - start) for start in range(0, n_rows, step)]
    reference, _ = reference_loss(hidden, weight, labels, bias,
                                  **{k: v for k, v in options.items() if k != "logits_dtype"})
    assert rel_err(loss, expected_same) <= 1e-5
    assert rel_err(loss, reference) <= (1e-6 if "logits_dtype" in options else 2e-3)


@requires_triton
def test_reduction_none_recomputes_from_the_epilogue_lse():
    """reduction="none": forward keeps only lse (from the matmul epilogue), backward recomputes the logits."""
    hidden, weight, labels, bias = _half_inputs_for_the_epilogue_kernel(90, 32, 520, True)
    for t in (hidden, weight, bias):
        t.requires_grad_(True)
    with fused_lm_loss.use_backend("triton"):
        loss = FusedLMLoss(reduction="none", chunk_size=32)(hidden, weight, labels, bias)
        grad_output = torch.linspace(0.5, 1.5, loss.numel())
        loss.backward(grad_output)
    expected, grads = reference_loss(hidden, weight, labels, bias, reduction="none", grad_output=grad_output)
    assert rel_err(loss, expected) <= (2e-3 if hidden.dtype == torch.float16 else 1e-2)  # per-token, rounded logits
    for t, name in ((hidden, "hidden"), (weight, "weight"), (bias, "bias")):
        assert rel_err(t.grad, grads[name]) <= 2e-2, name


def test_frozen_head_skips_weight_gradient(monkeypatch):
    """LoRA-style frozen lm_head: no V x H accumulator, no G^T @ h matmul."""
    hidden, weight, labels, _ = _inputs()
    weight.requires_grad_(False)
    _forbid(monkeypatch, chunked, "_Accumulator")
    loss = FusedLMLoss(chunk_size=8)(hidden, weight, labels)
    loss.backward()
    _, grads = reference_loss(hidden, weight, labels)
    assert weight.grad is None
    assert rel_err(hidden.grad, grads["hidden"]) <= 2e-4


def test_head_only_trainable_still_gets_gradient(backend):
    hidden, weight, labels, bias = _inputs()
    hidden.requires_grad_(False)
    loss = FusedLMLoss(chunk_size=8, reduction="sum")(hidden, weight, labels, bias)
    loss.backward()
    _, grads = reference_loss(hidden, weight, labels, bias, reduction="sum")
    assert rel_err(weight.grad, grads["weight"]) <= 2e-4 and rel_err(bias.grad, grads["bias"]) <= 2e-4


def test_ignored_rows_skip_the_matmul(monkeypatch):
    """Only non-ignored rows reach the logits matmul."""
    hidden, weight, labels, _ = make_inputs(64, 8, 30, ignore_frac=0.5)
    seen_rows = []
    original = chunked.logits_into

    def spy(out, h, *args):
        seen_rows.append(h.shape[0])
        return original(out, h, *args)

    monkeypatch.setattr(chunked, "logits_into", spy)
    FusedLMLoss(chunk_size=16)(hidden, weight, labels)
    assert sum(seen_rows) == int((labels != -100).sum())


def test_rows_within_stays_in_budget():
    budget = plan.LOGITS_BUDGET_BYTES
    for vocab, itemsize in ((128256, 2), (256000, 2), (151936, 6), (32000, 4)):
        rows = plan.rows_within(vocab * itemsize, budget)
        assert rows * vocab * itemsize <= budget < (rows + 1) * vocab * itemsize
    assert plan.rows_within(10**12, budget) == 1


def test_split_rows_uses_fewest_equal_chunks():
    rng = random.Random(0)
    cases = [(7373, 491), (7373, 2304), (8192, 960), (1, 1), (5, 1), (100, 7), (4096, 4096), (64, 1000)]
    cases += [(rng.randint(1, 5000), rng.randint(1, 5000)) for _ in range(200)]
    for n_rows, max_rows in cases:
        rows = plan.split_rows(n_rows, max_rows)
        n_chunks = -(-n_rows // rows)
        assert rows <= max_rows and rows <= n_rows, (n_rows, max_rows)
        assert n_chunks == -(-n_rows // max_rows), (n_rows, max_rows)  # no more chunks than needed
        last = n_rows - (n_chunks - 1) * rows
        assert rows - last < 64 * n_chunks, (n_rows, max_rows)  # balanced: no nearly empty last chunk
    assert plan.split_rows(7373, 2304) == 1856  # 4 chunks, a multiple of 64
    assert plan.split_rows(0, 100) == 1


def test_max_chunk_rows_spends_what_the_accumulator_pays_for(monkeypatch):
    monkeypatch.setattr(plan, "LOGITS_BUDGET_BYTES", 1000)
    # no wider accumulator: the budget alone (10 rows of 100 bytes)
    assert plan.max_chunk_rows(500, 100, None) == 10
    assert plan.max_chunk_rows(7, 100, None) == 7
    # one chunk fits in budget + accumulator: it needs no accumulator, so it may take its bytes
    assert plan.max_chunk_rows(30, 100, None, accumulator_bytes=2000, result_bytes=1000) == 30
    # several chunks: budget + the returned dW's bytes (allocated only after the loop)
    assert plan.max_chunk_rows(31, 100, None, accumulator_bytes=2000, result_bytes=1000) == 20
    # an explicit chunk_size wins
    assert plan.max_chunk_rows(500, 100, 7, accumulator_bytes=2000, result_bytes=1000) == 7


REGIMES = ["small_batch", "one_chunk_takes_the_accumulator", "several_chunks"]


@pytest.mark.parametrize("regime", REGIMES)
def test_chunks_use_the_fp32_accumulators_memory(backend, monkeypatch, regime):
    """bf16 weights, fp32 dW accumulation, three regimes of the budget:
    - the whole batch fits in the budget plus what an fp32 dW costs over bf16: one chunk writes dW in fp32,
      kept until backward rounds it once;
    - one chunk fits only with the accumulator's bytes: it writes dW directly in bf16 (a single matmul);
    - several chunks get the returned dW's bytes besides the budget and accumulate in fp32."""
    n, h, v = 100, 16, 480
    hidden, weight, labels, bias = make_inputs(n, h, v, dtype=torch.bfloat16, bias=True, seed=3)
    for t in (hidden, weight, bias):
        t.requires_grad_(True)
    n_rows = int((labels != -100).sum())
    assert n_rows < n  # some rows ignored: each chunk row also holds a gathered h row and a dX row
    per_logit = 2 + (plan.TORCH_BACKEND_TEMP_BYTES if backend == "torch" else 0)  # + the torch backend's fp32 copies
    bytes_per_row = v * per_logit + h * 2 + h * 4  # logits, a gathered bf16 h row, an fp32 dX row
    accumulator, result = v * h * 4, v * h * 2
    budget = {
        "small_batch": n * v * per_logit,
        "one_chunk_takes_the_accumulator": n_rows * bytes_per_row - accumulator // 2,
        "several_chunks": 10 * bytes_per_row,
    }[regime]
    wide_kept = n * v * per_logit <= budget + (accumulator - result)
    assert wide_kept == (regime == "small_batch")
    monkeypatch.setattr(plan, "LOGITS_BUDGET_BYTES", budget)
    chunk_rows, accumulated = [], []
    original_logits, original_add = chunked.logits_into, chunked._Accumulator.add

    def spy_logits(out, h, *args):
        chunk_rows.append(h.shape[0])
        return original_logits(out, h, *args)

    def spy_add(self, a, b, **kwargs):
        accumulated.append(self.dtype)
        return original_add(self, a, b, **kwargs)

    monkeypatch.setattr(chunked, "logits_into", spy_logits)
    monkeypatch.setattr(chunked._Accumulator, "add", spy_add)
    loss = FusedLMLoss()(hidden, weight, labels, bias)
    assert loss.grad_fn.saved_tensors[2].dtype == (torch.float32 if wide_kept else torch.bfloat16)
    loss.backward()
    if regime == "small_batch":
        assert chunk_rows == [n_rows] and accumulated == [torch.float32]
    elif regime == "one_chunk_takes_the_accumulator":
        assert chunk_rows == [n_rows] and accumulated == [torch.bfloat16]
    else:
        expected_rows = plan.split_rows(n_rows, plan.rows_within(bytes_per_row, budget + result))
        assert expected_rows > 10 and len(chunk_rows) >= 2
        assert chunk_rows[:-1] == [expected_rows] * (len(chunk_rows) - 1)
        assert set(accumulated) == {torch.float32}
    assert weight.grad.dtype == torch.bfloat16
    expected, grads = reference_loss(hidden, weight, labels, bias)
    assert rel_err(loss, expected) < 4e-3  # bf16 logits: each rounded by up to 2**-9
    for t, name in ((hidden, "hidden"), (weight, "weight"), (bias, "bias")):
        assert rel_err(t.grad, grads[name]) < 2e-2, name


def test_accum_dtype_none_keeps_weight_dtype(backend):
    hidden, weight, labels, _ = make_inputs(64, 16, 80, dtype=torch.bfloat16)
    weight.requires_grad_(True)
    FusedLMLoss(accum_dtype=None, chunk_size=16)(hidden, weight, labels).backward()
    _, grads = reference_loss(hidden, weight, labels)
    assert weight.grad.dtype == torch.bfloat16
    assert rel_err(weight.grad, grads["weight"]) < 2e-2



@pytest.mark.parametrize("accum_dtype", [torch.float32, None])
def test_chunk_buffers_are_freed_before_the_weight_gradient_is_made(backend, monkeypatch, accum_dtype):
    """With several chunks the dW result (or the fp32 sum's cast) takes the chunk buffers' memory (plan.py), so
    nothing may hold a view of them when it is made: a stale reference costs a V x H of peak memory on a GPU."""
    hidden, weight, labels, bias = make_inputs(96, 16, 200, dtype=torch.bfloat16, bias=False, seed=5)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    storages, alive_at_result = [], []
    original_buffers, original_result = chunked._chunk_buffers, chunked._Accumulator.result

    def spy_buffers(*args, **kwargs):
        buffers = original_buffers(*args, **kwargs)
        storages.append(buffers.logits.untyped_storage()._weak_ref())
        return buffers

    def spy_result(self, dtype):
        if backend == "triton":  # Triton's CPU interpreter holds launch arguments in reference cycles; a GPU doesn't
            gc.collect()
        alive_at_result.extend(not torch.UntypedStorage._expired(ref) for ref in storages)
        return original_result(self, dtype)

    monkeypatch.setattr(chunked, "_chunk_buffers", spy_buffers)
    monkeypatch.setattr(chunked._Accumulator, "result", spy_result)
    loss = FusedLMLoss(chunk_size=32, accum_dtype=accum_dtype)(hidden, weight, labels)
    loss.backward()
    assert storages and alive_at_result == [False] * len(storages)
    _, grads = reference_loss(hidden, weight, labels)
    assert rel_err(weight.grad, grads["weight"]) <= 1e-2  # bf16


def test_hook_changing_a_saved_gradient_in_place_makes_a_retained_backward_raise(backend):
    """A hook that scales the gradient in place gets, for a factor of 1.0, the saved tensor itself: a second
    (retain_graph) backward must then raise PyTorch's in-place error, not return the hook's result again."""
    hidden, weight, labels, bias = _inputs()
    hidden.register_hook(lambda g: g.mul_(2.0))
    loss = FusedLMLoss(chunk_size=16)(hidden, weight, labels, bias)
    loss.backward(retain_graph=True)
    _, grads = reference_loss(hidden, weight, labels, bias)
    assert rel_err(hidden.grad, 2.0 * grads["hidden"]) <= 2e-4  # the hook's doubling, once
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("options", [{}, dict(label_smoothing=0.1, z_loss=1e-3, softcap=5.0, logit_scale=1.3),
                                     dict(return_token_accuracy=True)],
                         ids=["plain", "smoothing-zloss-softcap", "token-accuracy"])
def test_per_token_recompute_over_vocabulary_tiles(backend, monkeypatch, options):
    """reduction="none" recomputes in backward for a per-token grad_output; with a vocabulary wider than the
    budget allows in one chunk of all rows it tiles the columns: every gradient still equals float64 (and the
    token accuracy, a forward output, asks nothing of the recompute: no argmax over a tile)."""
    n, h, v = 50, 16, 280
    hidden, weight, labels, bias = make_inputs(n, h, v, bias=True)
    for t in (hidden, weight, bias):
        t.requires_grad_(True)
    loss = FusedLMLoss(reduction="none", **options)(hidden, weight, labels, bias)
    if options.pop("return_token_accuracy", False):
        loss = loss.loss
    per_logit = 4 + (plan.TORCH_BACKEND_TEMP_BYTES if backend == "torch" else 0)
    monkeypatch.setattr(plan, "LOGITS_BUDGET_BYTES", n * 50 * per_logit + n * 200)
    monkeypatch.setattr(plan, "MIN_TILE_COLS", 16)
    widths = []
    original = chunked.logits_into
    monkeypatch.setattr(chunked, "logits_into", lambda out, *args: widths.append(out.shape[1]) or original(out, *args))
    grad_output = torch.randn(n)
    loss.backward(grad_output)
    assert len(widths) > 2 and max(widths) < v and sum(widths) % v == 0, widths
    expected, grads = reference_loss(hidden, weight, labels, bias, reduction="none", grad_output=grad_output, **options)
    assert rel_err(loss, expected) <= 1e-5
    for t, name in ((hidden, "hidden"), (weight, "weight"), (bias, "bias")):
        assert rel_err(t.grad, grads[name]) <= 2e-5, name


def test_vocab_tiling_picks_the_least_gradient_traffic(monkeypatch):
    """plan.vocab_tiling: within the budget, equal tiles covering the vocabulary, and no candidate (the untiled
    chunks, or k row chunks with the widest tile that fits) moves fewer bytes by its own traffic model."""
    monkeypatch.setattr(plan, "LOGITS_BUDGET_BYTES", 240 * 2**20)
    for n_rows, vocab, per_logit, row_bytes, untiled_rows, result in [
        (7372, 256000, 2, 13824, 2496, 256000 * 2304 * 2),  # Gemma-2-2B's recompute on the H200
        (7372, 151936, 2, 5376, 1536, 151936 * 896 * 2),  # Qwen2.5-0.5B
        (29491, 128256, 2, 24576, 4224, 128256 * 4096 * 2),  # Llama-3-8B, N = 32768
        (100, 300, 4, 64, 40, 300 * 16 * 4),
    ]:
        rows, cols = plan.vocab_tiling(n_rows, vocab, per_logit, row_bytes, untiled_rows, 4, 2, result)
        chunks, tiles = -(-n_rows // rows), -(-vocab // cols)
        budget = plan.LOGITS_BUDGET_BYTES + (result if chunks > 1 else 0)
        assert cols == vocab or rows * (cols * per_logit + row_bytes) <= budget, (n_rows, vocab)
        assert cols == vocab or tiles * cols - vocab < 64 * tiles  # balanced tiles, no sliver at the end

        def traffic(r, c):
            ch, t = -(-n_rows // r), -(-vocab // c)
            return (2 if ch == 1 else 2 * ch * 4 + 6) * vocab + (4 if t == 1 else 8 * t) * n_rows

        assert traffic(rows, cols) <= traffic(untiled_rows, vocab)
        for k in range(1, 17):
            r = plan.split_rows(n_rows, -(-n_rows // k))
            c = min(vocab, (plan.LOGITS_BUDGET_BYTES + (result if k > 1 else 0) - r * row_bytes) // (r * per_logit))
            if c >= plan.MIN_TILE_COLS:
                assert traffic(rows, cols) <= traffic(r, c), (n_rows, vocab, k)
    # all rows in one chunk with whole rows: nothing to tile (make_plan does not ask)
    assert plan.vocab_tiling(10, 50, 4, 0, 10, 4, 4, 0) == (10, 50)


@pytest.mark.parametrize("dtype, accum_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, None),
                                                (torch.float32, torch.float32)])
@pytest.mark.parametrize("tokens", [300, 1810, 4000])
def test_unequal_vocab_shards_plan_the_same_chunks(monkeypatch, dtype, accum_dtype, tokens):
    """Vocab parallelism: every rank must run as many chunks as the others (each chunk merges statistics
    across the group), so the plan sizes them from numbers all ranks share (the shard width ceil(V / ranks)),
    not from this rank's own weight: unequal shards (18000 and 2000 rows of 20000) once planned 1 and 2 chunks
    and the collectives fell out of step. The budget is shrunk so that the accumulator terms decide."""
    from fused_lm_loss.chunked import LinearHead, label_ids, select_rows
    from fused_lm_loss.distributed import Shard
    from fused_lm_loss.options import LossOptions
    from fused_lm_loss.plan import GradNeeds

    monkeypatch.setattr(plan, "LOGITS_BUDGET_BYTES", 2**20)
    vocab, hidden_size = 20000, 64
    opts, backend = LossOptions(accum_dtype=accum_dtype), torch_backend
    hidden, labels = torch.randn(tokens, hidden_size, dtype=dtype), torch.randint(0, vocab, (tokens,))
    plans = []
    for start, size in ((0, 18000), (18000, 2000)):
        shard = Shard(start, size, vocab, group=object(), world_size=2, hidden_size=hidden_size)
        rows = select_rows(label_ids(labels), -100, Shard.whole(vocab), backend)
        head = LinearHead(hidden, torch.randn(size, hidden_size, dtype=dtype), None, None)
        plans.append(plan.make_plan(opts, backend, shard, rows, head, needs=GradNeeds(hidden=True, weight=True),
                                    grad_scale=1.0))
    assert plans[0].chunk_rows == plans[1].chunk_rows, [(p.chunk_rows, p.n_rows) for p in plans]
