"""The forward without gradients: statistics from the matmul epilogue vs cuBLAS logits + row_losses.

    python benchmarks/profile_forward.py [--shapes qwen2.5-0.5b,gemma2-2b] [--repeats 3]
    TRITON_INTERPRET=1 FUSED_LM_LOSS_BACKEND=triton python benchmarks/profile_forward.py --shapes tiny --dtype float16
                                                             # CPU dry run of the epilogue kernel (interpreter)

Without gradients the library's plan takes each chunk's softmax statistics from the epilogue of a Triton
matmul (``kernels.matmul_partials`` + ``merge_partials``: no logits are stored) where the backend supports
it (``plan.stats_in_matmul``, Hopper). This script runs, on the same kept rows (10% of labels ignored),
  epilogue        chunked.run_chunks with the plan make_plan gives a no-grad call (the epilogue path)
  cuBLAS+losses   chunked.run_chunks with that plan's stats_in_matmul off and the chunk rows make_plan
                  sizes for a stored logits chunk (plan.split_rows / max_chunk_rows / bytes_per_logit):
                  h @ W.T by cuBLAS into the chunk buffer, then backend.row_losses
  fp32 epilogue   the epilogue with logits_dtype=torch.float32 (the statistics of unrounded logits)
  FusedLMLoss     FusedLMLoss()(x, w, y) under torch.no_grad(): the public call (select_rows, plan, loop)
each as a multiple of one full-batch cuBLAS matmul x @ W.T (the forward floor), medians of --repeats
interleaved repeats; then, at the plan's first chunk, the two paths' kernels alone (matmul_partials +
merge_partials against torch.mm + row_losses), and the largest difference between the two paths' losses.
Where the backend has no epilogue matmul (CPU torch backend, bf16 under the interpreter) only the
cuBLAS+losses rows run.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from common import DEVICE, SHAPES, bench, default_shapes, describe, inputs, plan_for
from fused_lm_loss import FusedLMLoss
from fused_lm_loss.chunked import LossStep, run_chunks
from fused_lm_loss.loss_terms import LossTerms
from fused_lm_loss.plan import bytes_per_logit, max_chunk_rows, split_rows
from fused_lm_loss.transform import LogitTransform


def stored_logits_plan(plan, head, rows):
    """The plan's no-grad call with the statistics from a stored logits chunk: what make_plan picks when
    the backend has no epilogue matmul (chunk buffers within the budget, equal chunks)."""
    per_logit = bytes_per_logit(plan.backend.name, plan.logits_dtype, plan.matmul_dtype, plan.split_grad)
    bytes_per_row = plan.shard.chunk_vocab * per_logit + head.row_bytes(rows.index is not None, plan.needs,
                                                                       plan.grad_input_dtype)
    rows = split_rows(plan.n_rows, max_chunk_rows(plan.n_rows, bytes_per_row, None))
    return dataclasses.replace(plan, stats_in_matmul=False, chunk_rows=rows)


def loop(plan, head, rows) -> torch.Tensor:
    """The chunk loop of a loss call on this plan (ops.py's): the per-row losses."""
    return run_chunks(plan, head, rows, LossStep(plan, DEVICE)).step.loss


def chunks_of(plan) -> str:
    return f"{len(list(plan.chunks()))}×{plan.chunk_rows}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=None, help=f"of {','.join(SHAPES)} (default: all but tiny; CPU: tiny)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (medians are printed)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = getattr(torch, args.dtype)
    print("| shape | floor ms | epilogue (chunks) | cuBLAS+losses (chunks) | fp32 epilogue | FusedLMLoss no-grad | "
          "first chunk: partials+merge / mm+row_losses ms | max loss diff |")
    print("|---" * 8 + "|")
    plans = []
    for name in default_shapes(args.shapes):
        x, w, y = inputs(name, 0.1, dtype)
        plan, head, rows = plan_for(x, w, y, "forward")
        stored = stored_logits_plan(plan, head, rows)
        fp32_plan, fp32_head, _ = plan_for(x, w, y, "forward", logits_dtype=torch.float32)
        plans.append(f"{name} plan: {describe(plan)}")
        full = torch.empty(x.shape[0], w.shape[0], device=DEVICE, dtype=dtype)
        loss_fn = FusedLMLoss()
        variants = {"cuBLAS+losses": lambda: loop(stored, head, rows)}
        if plan.stats_in_matmul:
            variants["epilogue"] = lambda: loop(plan, head, rows)
        if fp32_plan.stats_in_matmul:
            variants["fp32 epilogue"] = lambda: loop(fp32_plan, fp32_head, rows)
        variants["FusedLMLoss"] = lambda: loss_fn(x, w, y)
        runs = {label: [] for label in ["floor", *variants]}
        with torch.no_grad():
            for _ in range(args.repeats):
                runs["floor"].append(bench(lambda: torch.mm(x, w.t(), out=full)))
                for label, fn in variants.items():
                    runs[label].append(bench(fn))
            full = None
            floor = statistics.median(runs["floor"])
            ratio = lambda label: (f"{statistics.median(runs[label]) / floor:.3f}×" if label in runs else "-")  # noqa: E731
            # the two paths' kernels alone at the first chunk
            end = min(plan.chunk_rows, plan.n_rows)
            target, h_rows = rows.target[:end], rows.gather(x, 0, end)
            loss, lse = (torch.empty(end, dtype=torch.float32, device=DEVICE) for _ in range(2))
            terms = LossTerms(vocab_size=w.shape[0])
            buf = torch.empty(end, w.shape[0], device=DEVICE, dtype=dtype)
            t_cublas = bench(lambda: (torch.mm(h_rows, w.t(), out=buf),
                                      plan.backend.row_losses(buf, target, loss, lse, transform=plan.transform,
                                                              terms=plan.terms)))
            kernels = f"- / {t_cublas:.3f}"
            losses = [loop(stored, head, rows)]
            if plan.stats_in_matmul:
                backend = plan.backend

                def epilogue_chunk():
                    partial = backend.matmul_partials(h_rows, w, None, target, logits_dtype=plan.logits_dtype,
                                                      transform=LogitTransform(), need_sum=False)
                    backend.merge_partials(partial, terms=terms, loss_out=loss, lse_out=lse)

                kernels = f"{bench(epilogue_chunk):.3f} / {t_cublas:.3f}"
                losses.append(loop(plan, head, rows))
            diff = max(float((other - losses[0]).abs().max()) for other in losses) if losses[0].numel() else 0.0
        print(f"| {name} | {floor:.3f} | {ratio('epilogue')} ({chunks_of(plan) if plan.stats_in_matmul else '-'}) | "
              f"{ratio('cuBLAS+losses')} ({chunks_of(stored)}) | {ratio('fp32 epilogue')} | {ratio('FusedLMLoss')} | "
              f"{kernels} | {diff:.1e} |", flush=True)
        x = w = y = buf = None
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    print("\n".join(plans))


if __name__ == "__main__":
    main()
