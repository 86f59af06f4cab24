"""Llama-3-8B-sized loss on a GPU (N=8192, H=4096, V=128256): errors vs float64, no worse than eager.

Skipped without CUDA; run on the H200 through the device tool (see benchmarks/run_on_h200.sh).
"""
import pytest
import torch
import torch.nn.functional as F

from fused_lm_loss import FusedLMLoss

from .reference import make_inputs, reference_loss, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("logits_dtype", [None, torch.float32])
def test_llama3_8b_size(dtype, logits_dtype):
    torch.cuda.empty_cache()
    n, h, v = 8192, 4096, 128256
    hidden, weight, labels, _ = make_inputs(n, h, v, dtype=dtype, logit_std=4.0, ignore_frac=0.1)
    hidden, weight, labels = hidden.cuda(), weight.cuda(), labels.cuda()
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    expected, grads = reference_loss(hidden, weight, labels)

    h_eager = hidden.detach().clone().requires_grad_(True)
    w_eager = weight.detach().clone().requires_grad_(True)
    eager = F.cross_entropy((h_eager @ w_eager.T).float(), labels)
    eager.backward()
    eager_errors = [rel_err(eager, expected), rel_err(h_eager.grad, grads["hidden"]), rel_err(w_eager.grad, grads["weight"])]
    del h_eager, w_eager

    scale = 2.0**14 if dtype == torch.float16 else 1.0  # fp16: as a GradScaler would
    loss = FusedLMLoss(logits_dtype=logits_dtype)(hidden, weight, labels, scaling=scale)
    (loss * scale).backward()
    ours = [rel_err(loss, expected), rel_err(hidden.grad / scale, grads["hidden"]), rel_err(weight.grad / scale, grads["weight"])]
    print(f"\n{dtype} logits={logits_dtype}: ours loss/dX/dW {ours}, eager {eager_errors}")
    assert all(e < 2e-2 for e in ours)
    for mine, theirs in zip(ours[1:], eager_errors[1:]):
        assert mine <= 1.1 * theirs


@pytest.mark.parametrize(
    "n, h, v",
    [
        (8192, 4096, 32000),  # default: one chunk, in the memory the fp32 accumulator would take
        (8192, 1024, 32000),  # default: 2 chunks, budget + the returned dW's bytes
        (8192, 256, 151936),  # small H: 7 chunks
    ],
)
@pytest.mark.parametrize("accum_dtype", [torch.float32, None])
def test_extra_memory_stays_within_the_budget(n, h, v, accum_dtype):
    """Peak memory beyond inputs and returned gradients: LOGITS_BUDGET_BYTES (+ the fp32 accumulator's bytes,
    + the fp32 dX kept until backward over the bf16 one returned)."""
    from fused_lm_loss import plan

    torch.cuda.empty_cache()
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    weight = (torch.randn(v, h, device="cuda") * (4 / h**0.5)).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, v, (n,), device="cuda")
    labels[torch.rand(n, device="cuda") < 0.1] = -100
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = FusedLMLoss(accum_dtype=accum_dtype)(hidden, weight, labels)
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - hidden.grad.nbytes - weight.grad.nbytes
    kept_dx = plan.row_grad_dtype(plan.LossOptions(accum_dtype=accum_dtype), hidden.device, torch.bfloat16)
    allowed = (
        plan.LOGITS_BUDGET_BYTES + (weight.numel() * 4 if accum_dtype is not None else 0)
        + hidden.numel() * (kept_dx.itemsize - 2) + 16 * 2**20
    )
    assert torch.isfinite(loss) and weight.grad.dtype == torch.bfloat16
    assert extra <= allowed, (extra / 2**20, allowed / 2**20)


@pytest.mark.parametrize("keep_logits", [False, True], ids=["recompute", "kept-logits"])
def test_rl_recompute_over_vocabulary_tiles_at_gemma_size(keep_logits):
    """token_stats with a trainable head and per-token weights at Gemma-2-2B's vocabulary (bf16): backward
    recomputes (or, with keep_logits, reads the logits kept in forward) over vocabulary tiles (the whole
    vocabulary does not fit one chunk of all rows); the gradients are as close to float64 as eager autograd on
    materialized logits, and no fp32 dW accumulator is made."""
    from fused_lm_loss import plan, token_stats

    torch.cuda.empty_cache()
    n, h, v = 4096, 256, 256000
    hidden, weight, labels, _ = make_inputs(n, h, v, dtype=torch.bfloat16, logit_std=4.0, ignore_frac=0.1)
    hidden, weight, labels = hidden.cuda().requires_grad_(True), weight.cuda().requires_grad_(True), labels.cuda()
    kept = labels != -100
    a = torch.randn(n, device="cuda") * kept / n
    b = torch.randn(n, device="cuda") * kept / n
    assert int(kept.sum()) * v * 2 > plan.LOGITS_BUDGET_BYTES + v * h * 2  # the untiled plan would need chunks

    def loss_of(out):
        return (out.logprobs * a).sum() + (out.entropy * b).sum()

    h64, w64 = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    z = h64 @ w64.T
    target = torch.where(kept, labels, 0)
    logprobs = torch.where(kept, torch.log_softmax(z, -1).gather(-1, target[:, None]).squeeze(-1), 0.0)
    entropy = torch.where(kept, torch.distributions.Categorical(logits=z).entropy(), 0.0)
    ((logprobs * a.double()).sum() + (entropy * b.double()).sum()).backward()
    del z
    h_eager, w_eager = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    z = (h_eager @ w_eager.T).float()
    lp = torch.where(kept, torch.log_softmax(z, -1).gather(-1, target[:, None]).squeeze(-1), 0.0)
    ent = torch.where(kept, torch.distributions.Categorical(logits=z).entropy(), 0.0)
    ((lp * a).sum() + (ent * b).sum()).backward()
    eager = [rel_err(h_eager.grad, h64.grad), rel_err(w_eager.grad, w64.grad)]
    del z, lp, ent, h_eager, w_eager

    out = token_stats(hidden, weight, labels, keep_logits=keep_logits)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss_of(out).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - weight.numel() * 2 - hidden.numel() * 2
    ours = [rel_err(hidden.grad, h64.grad), rel_err(weight.grad, w64.grad)]
    print(f"\ntiled RL backward (keep_logits={keep_logits}): ours dX/dW {ours}, eager {eager}, extra {extra / 2**20:.0f} MiB")
    for mine, theirs in zip(ours, eager):
        assert mine <= 1.1 * theirs + 1e-6
    # the tile buffer and the kept rows' copies, not a V x H fp32 accumulator (1 GiB here)
    assert extra <= plan.LOGITS_BUDGET_BYTES + 64 * 2**20 + n * h * 4 * 2
