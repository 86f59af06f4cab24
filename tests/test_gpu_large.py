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
