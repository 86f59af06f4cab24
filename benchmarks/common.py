"""What the profile_*.py scripts share: shapes, inputs, timing, and one call's plan built as ops.py builds it.

Only public and plan-level entry points of the library: ``plan.make_plan``, ``backends.get_backend``,
``chunked.select_rows`` / ``label_ids`` / ``LinearHead``, ``distributed.Shard`` and ``options.LossOptions``.
"""
from __future__ import annotations

import math
import os
import sys
import time

import torch

# FUSED_LM_LOSS_ROOT: the library of another checkout (an A/B against an earlier commit, in one call)
sys.path.insert(0, os.environ.get("FUSED_LM_LOSS_ROOT") or os.path.join(os.path.dirname(__file__), ".."))
from fused_lm_loss.backends import get_backend  # noqa: E402
from fused_lm_loss.chunked import LinearHead, label_ids, select_rows  # noqa: E402
from fused_lm_loss.distributed import Shard  # noqa: E402
from fused_lm_loss.options import LossOptions  # noqa: E402
from fused_lm_loss.plan import GradNeeds, make_plan  # noqa: E402

SHAPES = {  # N tokens, H hidden, V vocabulary
    "tiny": (512, 64, 4000),  # a dry run on CPU before spending device time
    "llama3-8b": (8192, 4096, 128256),
    "qwen2.5-7b": (8192, 3584, 152064),
    "gemma2-2b": (8192, 2304, 256000),
    "qwen2.5-0.5b": (8192, 896, 151936),
}
GPU_SHAPES = "llama3-8b,qwen2.5-7b,gemma2-2b,qwen2.5-0.5b"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEEDS = {  # what a step asks for: the autograd inputs that require a gradient
    "train": GradNeeds(hidden=True, weight=True),
    "frozen": GradNeeds(hidden=True),  # frozen lm_head (LoRA elsewhere)
    "forward": GradNeeds(),  # no gradients (eval)
}


def default_shapes(arg: str | None) -> list[str]:
    return (arg or (GPU_SHAPES if DEVICE == "cuda" else "tiny")).split(",")


def bench(fn) -> float:
    """Median ms (``triton.testing.do_bench``); on CPU one timed run (a dry run: does it run?)."""
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def tflops(flop: float, ms: float) -> float:
    return flop / ms / 1e9


def inputs(name: str, ignore: float = 0.1, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """hidden (N, H), weight (V, H) with logits of std ~4, labels with a fraction ``ignore`` at -100."""
    n, h, v = SHAPES[name]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(n, h, device=DEVICE, generator=gen).to(dtype)
    w = (torch.randn(v, h, device=DEVICE, generator=gen) * (4 / math.sqrt(h))).to(dtype)
    return x, w, labels(name, ignore, seed)


def labels(name: str, ignore: float = 0.1, seed: int = 0) -> torch.Tensor:
    """(N,) uniform class ids with a fraction ``ignore`` at -100."""
    n, _, v = SHAPES[name]
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    y = torch.randint(0, v, (n,), device=DEVICE, generator=gen)
    y[torch.rand(n, device=DEVICE, generator=gen) < ignore] = -100
    return y


def plan_for(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, mode: str = "train", **options):
    """(plan, head, rows) of one FusedLMLoss(**options) call on (x, w, y), as ops.linear_cross_entropy makes
    them (reduction "mean": gradients scaled by 1 / selected rows)."""
    opts = LossOptions(**options)
    backend = get_backend(x.device)
    shard = Shard.whole(w.shape[0])
    rows = select_rows(label_ids(y), opts.ignore_index, shard, backend)
    head = LinearHead(x, w, None, None)
    plan = make_plan(opts, backend, shard, rows, head, needs=NEEDS[mode], grad_scale=1.0 / max(rows.count, 1))
    return plan, head, rows


def describe(plan) -> str:
    """One line: the plan's chunks and dtypes."""
    chunks = len(list(plan.chunks()))
    name = lambda dtype: str(dtype).replace("torch.", "")  # noqa: E731
    return (f"{plan.n_rows} selected rows in {chunks} chunk(s) of {plan.chunk_rows}; backend {plan.backend.name}; "
            f"logits {name(plan.logits_dtype)}, dX {name(plan.grad_input_dtype)}, dW accum "
            f"{name(plan.accum_dtype)} -> {name(plan.weight_grad_dtype)}; stats in matmul {plan.stats_in_matmul}; "
            f"dX on a side stream {plan.overlap_grad_matmuls}")


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, add: bool = False) -> None:
    """out = a @ b (or out += a @ b), ``out`` possibly fp32 from bf16/fp16 operands, as the chunk loop's
    matmuls write it (cuBLAS's fp32 output on CUDA with torch >= 2.8; upcast operands elsewhere)."""
    if out.dtype != a.dtype:
        if a.is_cuda and hasattr(torch.ops.aten.mm, "dtype_out"):
            if add:
                torch.ops.aten.addmm.dtype_out(out, a, b, out.dtype, out=out)
            else:
                torch.ops.aten.mm.dtype_out(a, b, out.dtype, out=out)
            return
        a, b = a.to(out.dtype), b.to(out.dtype)
    if add:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)
