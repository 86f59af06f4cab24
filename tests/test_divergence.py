"""fused_divergence / FusedDivergence: the teacher-student divergence against float64 on materialized logits, for
every kind, reduction and option, both backends; its gradients (student only), backward's strategies, compile."""
import pytest
import torch

import fused_lm_loss.divergence as divergence_module
from fused_lm_loss import FusedDivergence, fused_divergence

from .reference import rel_err

N, HS, HT, V = 19, 16, 24, 70
KINDS = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": 0.3}


def make(n=N, hs=HS, ht=HT, v=V, *, dtype=torch.float32, bias=True, ignored=0.25, std=3.0):
    """Student and teacher inputs whose logits have std ~ ``std``; labels with a fraction ignored."""
    student_hidden, teacher_hidden = torch.randn(n, hs), torch.randn(n, ht)
    student_weight, teacher_weight = torch.randn(v, hs) * std / hs**0.5, torch.randn(v, ht) * std / ht**0.5
    student_bias = 0.5 * torch.randn(v) if bias else None
    teacher_bias = 0.5 * torch.randn(v) if bias else None
    labels = torch.randint(0, v, (n,))
    labels[torch.rand(n) < ignored] = -100
    cast = [None if t is None else t.to(dtype) for t in (student_hidden, student_weight, student_bias, teacher_hidden,
                                                          teacher_weight, teacher_bias)]
    return (*cast, labels)


def reference(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, selected, *,
              beta, temperature=1.0, student_scale=1.0, student_softcap=None, teacher_scale=1.0, teacher_softcap=None):
    """(per-token divergence, student entropy) in float64, 0 where not selected, and the float64 student leaves."""
    leaves = {name: t.detach().double().requires_grad_(t.requires_grad) for name, t in
              (("hidden", student_hidden), ("weight", student_weight), ("bias", student_bias)) if t is not None}

    def z(x, scale, softcap):
        x = x * scale
        return (x if softcap is None else softcap * torch.tanh(x / softcap)) / temperature

    x_s = leaves["hidden"] @ leaves["weight"].T + (leaves["bias"] if "bias" in leaves else 0.0)
    x_t = teacher_hidden.double() @ teacher_weight.double().T + (0.0 if teacher_bias is None else teacher_bias.double())
    log_ps = torch.log_softmax(z(x_s, student_scale, student_softcap), -1)
    log_pt = torch.log_softmax(z(x_t, teacher_scale, teacher_softcap), -1)
    p_s, p_t = log_ps.exp(), log_pt.exp()

    def kl(p, log_p, log_q):
        return (p * (log_p - log_q)).sum(-1)

    if beta == 0.0:
        value = kl(p_t, log_pt, log_ps)
    elif beta == 1.0:
        value = kl(p_s, log_ps, log_pt)
    else:
        log_m = torch.log(beta * p_t + (1 - beta) * p_s)
        value = beta * kl(p_t, log_pt, log_m) + (1 - beta) * kl(p_s, log_ps, log_m)
    entropy = -(p_s * log_ps).sum(-1)
    return torch.where(selected, value, 0.0), torch.where(selected, entropy, 0.0).detach(), leaves


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("student", ["trainable", "frozen_head", "frozen_hidden"])
def test_matches_float64_reference(backend, kind, reduction, student):
    sh, sw, sb, th, tw, tb, labels = make()
    transforms = dict(temperature=0.8, student_logit_scale=1.2, student_softcap=6.0, teacher_logit_scale=0.9,
                      teacher_softcap=None)
    sh.requires_grad_(student != "frozen_hidden")
    for t in (sw, sb):
        t.requires_grad_(student != "frozen_head")
    out = fused_divergence(sh, sw, th, tw, labels, student_bias=sb, teacher_bias=tb, kind=kind,
                           beta=0.3 if kind == "jsd" else None, reduction=reduction, chunk_size=5,
                           return_entropy=True, **transforms)
    weights = torch.randn(N) if reduction == "none" else None
    (out.divergence if weights is None else (out.divergence * weights).sum()).backward()
    selected = labels != -100
    value, entropy, leaves = reference(sh, sw, sb, th, tw, tb, selected, beta=KINDS[kind], temperature=0.8,
                                       student_scale=1.2, student_softcap=6.0, teacher_scale=0.9)
    want = {"mean": value.sum() / selected.sum(), "sum": value.sum(), "none": value}[reduction]
    (want.sum() if weights is None else (want * weights.double()).sum()).backward()
    assert out.divergence.dtype == torch.float32 and out.divergence.shape == want.shape
    assert rel_err(out.divergence, want) <= 2e-6
    assert rel_err(out.entropy, entropy) <= 2e-6 and not out.entropy.requires_grad
    for name, t in (("hidden", sh), ("weight", sw), ("bias", sb)):
        if t.requires_grad:
            assert t.grad is not None and t.grad.dtype == t.dtype
            assert rel_err(t.grad, leaves[name].grad) <= 2e-5, name
        else:
            assert t.grad is None, name
    if reduction == "none":
        assert torch.all(out.divergence[~selected] == 0)


def _count_runs(monkeypatch):
    calls = []
    original = divergence_module._run
    monkeypatch.setattr(divergence_module, "_run", lambda *a, **k: calls.append(k["row_weight"]) or original(*a, **k))
    return calls


@pytest.mark.parametrize("case,reduction,weights,head,runs", [
    ("mean: gradients made in forward, rescaled", "mean", None, "trainable", 1),
    ("per-token weights, frozen head: rows weighted", "none", "random", "frozen", 1),
    ("per-token weights, trainable head: recomputed", "none", "random", "trainable", 2),
    ("one weight on every selected token: rescaled", "none", "uniform", "trainable", 1),
])
def test_backward_recomputes_only_when_forward_could_not_serve(monkeypatch, case, reduction, weights, head, runs):
    sh, sw, sb, th, tw, tb, labels = make()
    sh.requires_grad_(True)
    sw.requires_grad_(head == "trainable")
    calls = _count_runs(monkeypatch)
    out = fused_divergence(sh, sw, th, tw, labels, student_bias=sb, teacher_bias=tb, kind="jsd", reduction=reduction)
    a = {"random": torch.randn(N), "uniform": torch.full((N,), -0.7), None: None}[weights]
    (out if a is None else (out * a).sum()).backward()
    assert len(calls) == runs, case
    selected = labels != -100
    value, _, leaves = reference(sh, sw, sb, th, tw, tb, selected, beta=0.5)
    want = value.sum() / selected.sum() if a is None else (value * a.double()).sum()
    want.backward()
    assert rel_err(sh.grad, leaves["hidden"].grad) <= 2e-5
    if head == "trainable":
        assert rel_err(sw.grad, leaves["weight"].grad) <= 2e-5


@pytest.mark.parametrize("positions", ["labels", "mask", "all"])
@pytest.mark.parametrize("label_dtype", [torch.int64, torch.int32, torch.uint8])
def test_positions_by_labels_mask_or_all(backend, positions, label_dtype):
    sh, sw, sb, th, tw, tb, labels = make(bias=False)
    sh.requires_grad_(True)
    selected = labels != -100
    ignore = 255 if label_dtype == torch.uint8 else -100
    kwargs = {"labels": dict(labels=torch.where(selected, labels, ignore).to(label_dtype), ignore_index=ignore),
              "mask": dict(mask=selected), "all": {}}[positions]
    if positions == "all":
        selected = torch.ones(N, dtype=torch.bool)
    out = fused_divergence(sh, sw, th, tw, kind="reverse_kl", reduction="sum", **kwargs)
    out.backward()
    value, _, leaves = reference(sh, sw, None, th, tw, None, selected, beta=1.0)
    value.sum().backward()
    assert rel_err(out, value.sum()) <= 2e-6 and rel_err(sh.grad, leaves["hidden"].grad) <= 2e-5
    assert torch.all(sh.grad[~selected] == 0)


def test_batch_shapes_and_strides(backend):
    """(B, T, H) hidden states, a transposed weight view, labels that are a slice: as the flat call."""
    sh, sw, sb, th, tw, tb, labels = make(n=24, bias=False)
    flat = fused_divergence(sh, sw, th, tw, labels, reduction="none")
    shaped = fused_divergence(sh.view(4, 6, HS), sw.t().contiguous().t(), th.view(4, 6, HT), tw,
                              torch.stack([labels, labels]).t()[:, 0].view(4, 6), reduction="none")
    assert shaped.shape == (4, 6) and torch.allclose(shaped.reshape(-1), flat, rtol=1e-6, atol=1e-7)


def test_teacher_gets_no_gradient_and_no_selected_rows():
    sh, sw, sb, th, tw, tb, labels = make(bias=False)
    th.requires_grad_(True)
    tw.requires_grad_(True)
    sh.requires_grad_(True)
    fused_divergence(sh, sw, th, tw, labels).backward()
    assert th.grad is None and tw.grad is None and sh.grad is not None
    none = torch.full((N,), -100)
    sh.grad = None
    total = fused_divergence(sh, sw, th, tw, none, reduction="sum")
    total.backward()
    assert total.item() == 0.0 and torch.all(sh.grad == 0)
    assert torch.isnan(fused_divergence(sh, sw, th, tw, none))  # the mean of nothing, as F.cross_entropy's
    # no rows at all (an all-masked microbatch, compacted as TRL's trainer does): zeros, zero gradients
    empty = sh[:0].detach().requires_grad_(True)
    sw.requires_grad_(True)
    out = fused_divergence(empty, sw, th[:0], tw, reduction="none", return_entropy=True)
    (out.divergence.sum() + 0.0).backward()
    assert out.divergence.shape == out.entropy.shape == (0,)
    assert empty.grad.shape == (0, HS) and torch.all(sw.grad == 0)


@pytest.mark.parametrize("rows, vocab, chunk_size", [(64, 300, None), (64, 300, 16), (24, 4500, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_no_worse_than_eager(dtype, rows, vocab, chunk_size, backend):
    """bf16/fp16 operands: the divergence, dX and dW as exact as eager PyTorch on logits rounded to that dtype; in
    one chunk and in several, and with rows of several kernel blocks (G, 2 bytes, is written over the first half of
    each fp32 student row, block by block)."""
    sh, sw, sb, th, tw, tb, labels = make(n=rows, v=vocab, dtype=dtype, bias=False)
    sh.requires_grad_(True)
    sw.requires_grad_(True)
    selected = labels != -100
    value, _, leaves = reference(sh, sw, None, th, tw, None, selected, beta=0.0)
    value.sum().backward()
    eager_h, eager_w = (t.detach().clone().requires_grad_(True) for t in (sh, sw))
    log_ps = torch.log_softmax((eager_h @ eager_w.T).float(), -1)
    log_pt = torch.log_softmax((th @ tw.T).float(), -1)
    eager = torch.where(selected, (log_pt.exp() * (log_pt - log_ps)).sum(-1), 0.0).sum()
    eager.backward()
    out = fused_divergence(sh, sw, th, tw, labels, reduction="sum", chunk_size=chunk_size)
    out.backward()
    assert rel_err(out, value.sum()) <= 1.5 * rel_err(eager, value.sum()) + 1e-6
    assert rel_err(sh.grad, leaves["hidden"].grad) <= 1.25 * rel_err(eager_h.grad, leaves["hidden"].grad)
    assert rel_err(sw.grad, leaves["weight"].grad) <= 1.25 * rel_err(eager_w.grad, leaves["weight"].grad)


def test_retain_graph_and_higher_order():
    sh, sw, sb, th, tw, tb, labels = make(bias=False)
    sh.requires_grad_(True)
    sw.requires_grad_(True)
    loss = fused_divergence(sh, sw, th, tw, labels, kind="jsd")
    loss.backward(retain_graph=True)
    first = sh.grad.clone(), sw.grad.clone()
    sh.grad = sw.grad = None
    loss.backward()
    assert torch.equal(sh.grad, first[0]) and torch.equal(sw.grad, first[1])
    with pytest.raises(RuntimeError, match="higher-order"):
        torch.autograd.grad(fused_divergence(sh, sw, th, tw, labels), sh, create_graph=True)


def test_bad_arguments_raise():
    sh, sw, sb, th, tw, tb, labels = make(bias=False)
    for bad, match in ((dict(kind="kl"), "kind"), (dict(kind="jsd", beta=0.0), "beta"), (dict(kind="jsd", beta=1.5),
                       "beta"), (dict(temperature=0.0), "temperature"), (dict(student_softcap=-1.0), "student_softcap"),
                       (dict(reduction="avg"), "reduction"), (dict(chunk_size=0), "chunk_size"),
                       (dict(ignore_index=1.5), "ignore_index"), (dict(ignore_index=2**70), "ignore_index"),
                       (dict(temperature=float("nan")), "temperature"), (dict(beta=1.0), "beta is the mixture weight"),
                       (dict(kind="reverse_kl", beta=0.3), "beta is the mixture weight"),
                       # finite, but outside what fp32 math carries (options.FP32_SAFE_RANGE)
                       (dict(temperature=1e-39), "temperature"), (dict(teacher_softcap=1e39), "teacher_softcap"),
                       (dict(student_logit_scale=2.0**40, temperature=2.0**-40), "student_logit_scale / temperature"),
                       (dict(teacher_softcap=2.0**60, teacher_logit_scale=2.0**-10), "teacher_logit_scale / teacher_s")):
        with pytest.raises(ValueError, match=match):
            fused_divergence(sh, sw, th, tw, labels, **bad)
        with pytest.raises(ValueError, match=match):
            FusedDivergence(**bad)
    with pytest.raises(ValueError, match="vocabularies"):
        fused_divergence(sh, sw, th, tw[:-1], labels)
    for bad_labels, match in ((labels.float(), "integer"), (labels[:-1], "labels shape")):
        with pytest.raises(ValueError, match=match):
            fused_divergence(sh, sw, th, tw, bad_labels)
    with pytest.raises(ValueError, match="leading"):
        fused_divergence(sh, sw, th[:-1], tw, labels)
    with pytest.raises(ValueError, match="features"):
        fused_divergence(sh, sw, th, tw[:, :-1], labels)
    with pytest.raises(ValueError, match="dtype"):
        fused_divergence(sh.bfloat16(), sw, th, tw, labels)
    for dtype in (torch.float64, torch.float8_e4m3fn):  # (G is written in the student's matmul dtype)
        with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
            fused_divergence(sh.to(dtype), sw.to(dtype), th, tw, labels)
    with pytest.raises(ValueError, match="at least one class"):
        fused_divergence(sh, sw[:0], th, tw[:0], labels)
    with pytest.raises(ValueError, match="not both"):
        fused_divergence(sh, sw, th, tw, labels, mask=labels != -100)
    with pytest.raises(ValueError, match="applies to labels"):  # (it would select nothing: silently unused)
        fused_divergence(sh, sw, th, tw, mask=labels != -100, ignore_index=3)
    with pytest.raises(ValueError, match="integer"):
        fused_divergence(sh, sw, th, tw, labels.float())
    with pytest.raises(ValueError, match="mask"):
        fused_divergence(sh, sw, th, tw, mask=labels)
    with pytest.raises(ValueError, match="return_entropy"):
        fused_divergence(sh, sw, th, tw, labels, return_entropy="yes")
    for bad_bias in ([0.0] * tw.shape[0], torch.zeros(tw.shape[0] + 1)):
        with pytest.raises(ValueError, match="student_bias"):
            fused_divergence(sh, sw, th, tw, labels, student_bias=bad_bias)
    with pytest.raises(ValueError, match="return_entropy"):
        FusedDivergence(return_entropy=1)


def test_no_grad_makes_no_gradients(monkeypatch):
    """Under torch.no_grad (evaluation) the chunks build no dX / dW, whatever the tensors' requires_grad."""
    from fused_lm_loss import divergence

    asked = []
    run = divergence._run

    def spy(*args, **kwargs):
        asked.append((kwargs["need_hidden"], kwargs["need_weight"], kwargs["need_bias"]))
        return run(*args, **kwargs)

    monkeypatch.setattr(divergence, "_run", spy)
    sh, sw, sb, th, tw, tb, labels = make()
    for t in (sh, sw, sb):
        t.requires_grad_(True)
    with torch.no_grad():
        value = fused_divergence(sh, sw, th, tw, labels, student_bias=sb, teacher_bias=tb)
    assert asked == [(False, False, False)] and not value.requires_grad
    want = fused_divergence(sh, sw, th, tw, labels, student_bias=sb, teacher_bias=tb)
    assert asked[-1] == (True, True, True) and torch.equal(value, want.detach())


def test_module_matches_function():
    sh, sw, sb, th, tw, tb, labels = make()
    module = FusedDivergence(kind="jsd", beta=0.4, temperature=2.0, return_entropy=True)
    assert "jsd" in repr(module) and "0.4" in repr(module)
    got = module(sh, sw, th, tw, labels, student_bias=sb, teacher_bias=tb)
    want = fused_divergence(sh, sw, th, tw, labels, student_bias=sb, teacher_bias=tb, kind="jsd", beta=0.4,
                            temperature=2.0, return_entropy=True)
    assert torch.equal(got.divergence, want.divergence) and torch.equal(got.entropy, want.entropy)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("head", ["trainable", "frozen"])
def test_compiles_fullgraph_and_matches_eager(reduction, head):
    sh, sw, sb, th, tw, tb, labels = make()
    sw.requires_grad_(head == "trainable")
    a = torch.randn(N)

    def total(h):
        out = fused_divergence(h, sw, th, tw, labels, student_bias=sb, teacher_bias=tb, kind="jsd",
                               reduction=reduction, return_entropy=True, temperature=0.9)
        value = out.divergence if reduction == "mean" else (out.divergence * a).sum()
        return value + 0.01 * out.entropy.sum()

    compiled = torch.compile(total, fullgraph=True)
    results = []
    for fn in (compiled, total):
        h = sh.clone().requires_grad_(True)
        sw.grad = None
        value = fn(h)
        value.backward()
        results.append((value.detach(), h.grad, None if sw.grad is None else sw.grad.clone()))
    (v0, h0, w0), (v1, h1, w1) = results
    assert rel_err(v0, v1) <= 1e-6 and rel_err(h0, h1) <= 1e-6
    assert (w0 is None) == (head == "frozen") and (w0 is None or rel_err(w0, w1) <= 1e-6)


def test_compiled_backward_of_transposed_inputs():
    """A student's hidden states and weight with transposed strides (dense, not contiguous): the backward operator's
    outputs are contiguous, as its fake implementation says (Inductor asserts the strides it was promised)."""
    sh, sw, sb, th, tw, tb, labels = make()
    h = sh.detach().t().contiguous().t().requires_grad_(True)
    w = sw.detach().t().contiguous().t().requires_grad_(True)
    assert not h.is_contiguous() and not w.is_contiguous()
    a = torch.randn(N)

    def total(h, w):
        return (fused_divergence(h, w, th, tw, labels, kind="jsd", reduction="none") * a).sum()

    torch.compile(total, fullgraph=True)(h, w).backward()
    h0, w0 = sh.detach().clone().requires_grad_(True), sw.detach().clone().requires_grad_(True)
    total(h0, w0).backward()
    # (fp32 throughout; on a GPU cuBLAS sums transposed operands in another order: 1.4e-6 measured on an H100.
    # A wrong stride gives errors of order 1.)
    assert rel_err(h.grad, h0.grad) <= 1e-5 and rel_err(w.grad, w0.grad) <= 1e-5


@pytest.mark.parametrize("needs", [[True, True, True], [True, False, False], [False, True, False]])
def test_operator_passes_opcheck(needs):
    sh, sw, sb, th, tw, tb, labels = make()
    for t, need in zip((sh, sw, sb), needs):
        t.requires_grad_(need)
    options = dict(beta=0.3, temperature=0.9, student_scale=1.1, student_softcap=5.0, teacher_scale=1.0,
                   teacher_softcap=None, chunk_size=4)
    args = (sh, sw, sb, th, tw, tb, labels != -100, needs, True)
    torch.library.opcheck(divergence_module.linear_divergence, args, options,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_autocast_casts_both_sides_as_linear_does():
    """Under autocast the operands are cast to its dtype (as nn.Linear); the fp32 leaves get fp32 gradients, as
    close to float64 as eager autocast's."""
    sh, sw, sb, th, tw, tb, labels = make(n=32, v=200, bias=False)
    sh.requires_grad_(True)
    sw.requires_grad_(True)
    with torch.autocast(sh.device.type, dtype=torch.bfloat16):
        out = fused_divergence(sh, sw, th, tw, labels, kind="jsd", reduction="sum")
    out.backward()
    assert sh.grad.dtype == sw.grad.dtype == torch.float32
    bf = [t.bfloat16().float() for t in (sh, sw, th, tw)]
    value, _, leaves = reference(bf[0].requires_grad_(True), bf[1].requires_grad_(True), None, bf[2], bf[3], None,
                                 labels != -100, beta=0.5)
    value.sum().backward()
    assert rel_err(out, value.sum()) <= 1e-5
    assert rel_err(sh.grad, leaves["hidden"].grad) <= 1e-2 and rel_err(sw.grad, leaves["weight"].grad) <= 1e-2


def test_chunk_rows_follow_the_divergences_budget():
    """Rows per chunk at real sizes (meta tensors): all rows in one chunk while both fp32 chunks fit the budget
    (4 x the loss's), else equal chunks within it, or within the loss's budget plus the returned dW where that is
    more (a trainable head); chunk_size wins."""
    from fused_lm_loss import divergence
    from fused_lm_loss.plan import LOGITS_BUDGET_BYTES

    def rows(count, hidden, vocab, need_weight, **options):
        h = torch.empty(count, hidden, dtype=torch.bfloat16, device="meta")
        w = torch.empty(vocab, hidden, dtype=torch.bfloat16, device="meta")
        return divergence._chunk_rows(divergence.DivergenceOptions(**options), count, h, h, w, need_weight)

    per_row = 151936 * 8 + 896 * 8  # two fp32 logits rows, the hidden rows
    fits = divergence.BUDGET_BYTES // per_row
    assert LOGITS_BUDGET_BYTES // per_row < fits - 1
    assert rows(fits - 1, 896, 151936, False) == fits - 1  # one chunk, though beyond the loss's own budget
    chunk = rows(8192, 896, 151936, False)
    assert chunk <= fits and -(-8192 // chunk) == -(-8192 // fits)
    weight_bytes = 128256 * 4096 * 2  # Llama-3-8B's head: the returned dW outweighs the budget
    big = rows(8192, 4096, 128256, True)
    assert big * (128256 * 8 + 4096 * 8) <= LOGITS_BUDGET_BYTES + weight_bytes
    assert big > divergence.BUDGET_BYTES // (128256 * 8 + 4096 * 8)
    assert rows(8192, 896, 151936, True, chunk_size=100) == 100
