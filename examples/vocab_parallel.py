"""Vocab-parallel LM loss: each rank holds a slice of the lm_head's vocabulary rows.

    torchrun --nproc_per_node 2 examples/vocab_parallel.py                 # gloo on CPU, NCCL on GPUs
    torchrun --nproc_per_node 2 examples/vocab_parallel.py --vocab 128256 --hidden 4096 --tokens 8192
    torchrun --nproc_per_node 2 examples/vocab_parallel.py --backend gloo   # 2 ranks sharing one GPU

Every rank builds the same random lm_head, hidden states and labels (same seed), keeps its contiguous
vocab shard (unequal when the vocabulary does not divide evenly), and computes the fused loss with
``process_group``: per token only a few statistics cross ranks, never the logits. Each rank then checks
its loss, its shard of dW / db and the (all-reduced) dX against the unsharded single-device computation,
and rank 0 prints the worst relative errors over all ranks.
"""
from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink SHARP multicast off: not needed for these collectives

import argparse
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from fused_lm_loss import FusedLMLoss  # noqa: E402

TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def shard_rows(vocab: int, world: int, rank: int) -> tuple[int, int]:
    """(start, size) of this rank's rows: sizes differ by at most one."""
    base, extra = divmod(vocab, world)
    start = rank * base + min(rank, extra)
    return start, base + (rank < extra)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().float(), expected.detach().float()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def check_vocab_parallel(
    device: torch.device,
    vocab: int = 4099,
    hidden_size: int = 64,
    tokens: int = 256,
    dtype: torch.dtype = torch.float32,
    group: dist.ProcessGroup | None = None,
) -> dict:
    """Fused vocab-parallel loss + gradients vs the unsharded computation; the same report on every rank."""
    group = group or dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(vocab, hidden_size, device=device, generator=gen) * (3.0 / hidden_size**0.5)
    bias = torch.randn(vocab, device=device, generator=gen) * 0.1
    hidden = torch.randn(tokens, hidden_size, device=device, generator=gen)
    labels = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    labels[torch.rand(tokens, device=device, generator=gen) < 0.1] = -100
    weight, bias, hidden = weight.to(dtype), bias.to(dtype), hidden.to(dtype)
    options = dict(label_smoothing=0.1, z_loss=1e-4)

    start, size = shard_rows(vocab, world, rank)
    w_shard = weight[start : start + size].clone().requires_grad_()
    b_shard = bias[start : start + size].clone().requires_grad_()
    h = hidden.clone().requires_grad_()
    loss_fn = FusedLMLoss(process_group=group, vocab_start=start, vocab_size=vocab, **options)
    for _ in range(2):  # the first call warms up communicators and kernels; the second is timed
        w_shard.grad = b_shard.grad = h.grad = None
        dist.barrier(group)
        began = time.perf_counter()
        loss = loss_fn(h, w_shard, labels, b_shard)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - began

    # The unsharded computation (what one device holding the whole lm_head would do).
    w_full, b_full, h_full = (t.clone().requires_grad_() for t in (weight, bias, hidden))
    expected = FusedLMLoss(**options)(h_full, w_full, labels, b_full)
    expected.backward()

    errors = torch.tensor(
        [
            rel_error(loss, expected),
            rel_error(h.grad, h_full.grad),
            rel_error(w_shard.grad, w_full.grad[start : start + size]),
            rel_error(b_shard.grad, b_full.grad[start : start + size]),
            seconds,
        ],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(errors, op=dist.ReduceOp.MAX, group=group)  # worst rank
    worst = dict(zip(("loss", "grad_hidden", "grad_weight", "grad_bias"), errors[:4].tolist()))
    return {
        "world_size": world,
        "loss": loss.item(),
        "max_rel_error": worst,
        "ok": all(e <= TOLERANCE[dtype] for e in worst.values()),
        "seconds": float(errors[4]),
        "shard_rows": (start, size),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=4099)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--backend", choices=("nccl", "gloo"), help="default: nccl with CUDA, else gloo")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    backend = args.backend or ("nccl" if cuda else "gloo")
    device = torch.device("cpu")
    if cuda:
        # More ranks than GPUs share them round-robin (gloo only: NCCL needs one GPU per rank).
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    try:
        report = check_vocab_parallel(device, args.vocab, args.hidden, args.tokens, getattr(torch, args.dtype))
    finally:
        dist.destroy_process_group()
    if int(os.environ.get("RANK", 0)) == 0:
        errors = ", ".join(f"{k} {v:.1e}" for k, v in report["max_rel_error"].items())
        print(
            f"vocab parallel over {report['world_size']} ranks ({backend} on {device.type}, {args.dtype}): "
            f"vocab {args.vocab}, hidden {args.hidden}, {args.tokens} tokens; loss {report['loss']:.6f}\n"
            f"max relative error vs unsharded: {errors} -> {'OK' if report['ok'] else 'MISMATCH'}\n"
            f"sharded forward + backward: {report['seconds'] * 1e3:.1f} ms (slowest rank)"
        )
    raise SystemExit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
