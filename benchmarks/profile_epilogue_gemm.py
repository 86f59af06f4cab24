"""Issue 27's deciding kernel measurement: a logits GEMM whose epilogue writes E = exp(z - k) and the row statistics
from the fp32 accumulator, against what the library runs today for the same chunk.

    PYTHONPATH=$PYTHONPATH:<the packed CuTe DSL> python benchmarks/profile_epilogue_gemm.py [--shapes ...] [--rows 4096]
        [--configs auto,128/p/2x1,192/c/1x2]   # tile_n / pingpong (p) or cooperative (c) / cluster M x N

The epilogue GEMM is Quack's (quack-kernels 0.6.5, ``quack.epilogue.scaled_exp.scaled_exp_target_epi``, NVIDIA CuTe
DSL, sm90: warp-specialized, TMA stores overlapped with the next tile's MMAs), used as a library: per (row, tile of
``tile_n`` columns) it stores E = bf16(2^(z log2e - k)) with k the tile's max in log2 units rounded to an integer,
the tile's sum of E and k, and each row's target logit from the accumulator. Per shape and chunk rows M (the plan's
own, rounded up to a multiple of 128, the GEMM's tile, and each of ``--rows``), medians of ``do_bench``:

  cuBLAS        h @ W.T into a bf16 chunk (the library's logits step)
  stats         backend.row_losses on that chunk (loss, lse): cuBLAS + stats is today's forward part of a chunk
  epilogue      the E-storing epilogue GEMM (its first call, the JIT compile, is outside the timing), in each of
                ``--configs`` ("auto": the library's, exp_epilogue.exp_matmul; others where their tile_n divides V)
  merge         backend.merge_exp_stats on the epilogue's outputs (loss, lse): epilogue + merge is the Hopper path's
                forward part of a chunk
  grad from E   a copy of E, then backend.grad_from_exp on it (per-tile offsets here: every row takes its rescale loop)
  grad          backend.grad_logits on the chunk: today's gradient pass (it reads and writes as many bytes)

and, on the plan's chunk, the relative L2 error against float64 of the lse (from the epilogue's partials; from the
bf16 logits) and of G, the bf16 operand of both backward GEMMs: from E (the per-(row, tile) factor 2^k e^-lse and the
one-hot term in fp32, rounded once) against from bf16 logits (today). Without CUDA or Quack it says so and stops.

``--backward`` (RESULTS.md, session 17: the library's stays; Quack's strip GEMMs won only at Gemma-2-2B): what
follows the epilogue GEMM in a training chunk, on its E, per shape at the plan's chunk rows and each of ``--rows``
(rounded up to 128; Quack's own pipeline runs 4096), medians of ``do_bench``:

  library       today's Hopper path: ``grad_from_exp`` (G from E), then cuBLAS dX = G @ W and dW = G^T h, both
                into fp32 (the library's row buffer and accumulator)
  quack_plain   the same G, and Quack's plain GEMMs (``identity_epi``, fp32 D) for dX and dW
  quack_strip   Quack's scaled-exp backward as its pipeline runs it (quack/linear_cross_entropy.py): its glue
                kernel (loss, the target fix in E, the per-(64 columns, row) strip 2^(k - k_row), the per-row
                v = 2^k_row e^-lse, x v), then dX and dW as GEMMs on E itself with the strip applied in the
                operand load (``a_transform``): no G pass

and the relative error of each dX (first 256 rows) against float64.
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import sys

import torch

from common import DEVICE, SHAPES, bench, default_shapes, inputs, plan_for, sync, tflops

sys.path.insert(0, os.path.dirname(__file__))
import peers  # noqa: E402  (its import shim is not needed for quack.epilogue.scaled_exp)


def pick_tile_n(vocab: int) -> int | None:
    """The epilogue's tile width: it must divide V (one k per whole tile); as Quack picks it."""
    return next((t for t in (192, 256, 128, 64) if vocab % t == 0), None)


def epilogue_gemm(x, w, target, tile_n, pingpong=None, cluster=(2, 1)):
    """A closure running the epilogue GEMM on (x, w) and the outputs it writes (the library's launch settings
    unless given)."""
    from quack.epilogue.scaled_exp import scaled_exp_target_epi

    m, v = x.shape[0], w.shape[0]
    out = dict(
        E=torch.empty(m, v, device=x.device, dtype=x.dtype),
        sum_exp=torch.empty(m, v // tile_n, device=x.device, dtype=torch.float32),
        k=torch.empty(m, v // tile_n, device=x.device, dtype=torch.float32),
        target_logit=torch.empty(m, device=x.device, dtype=torch.float32),
    )

    def run():
        scaled_exp_target_epi.gemm(
            x, w, out["E"],
            epi_args=dict(max_log2=tile_n, sum_exp=out["sum_exp"], max_log2_out=out["k"], target=target,
                          target_logit=out["target_logit"]),
            tile_M=128, tile_N=tile_n, cluster_M=cluster[0], cluster_N=cluster[1],
            pingpong=tile_n <= 208 if pingpong is None else pingpong,
        )

    return run, out


def accuracy(x, w, target, logits, lse_today, out, tile_n):
    """Relative L2 errors of lse and G (bf16) against float64: (lse epilogue, lse today, G from E, G today)."""
    kept = target >= 0
    z64 = x.double() @ w.double().T
    lse64 = torch.logsumexp(z64, 1)
    onehot = torch.zeros_like(z64)
    onehot[kept.nonzero().squeeze(1), target[kept]] = 1.0
    g64 = torch.exp(z64 - lse64[:, None]) - onehot
    del z64
    k, s = out["k"], out["sum_exp"]
    k_row = k.max(1).values
    lse_epi = (k_row + torch.log2((s * torch.exp2(k - k_row[:, None])).sum(1))) * math.log(2.0)
    factor = torch.exp2(k - (lse_epi / math.log(2.0))[:, None])  # per (row, tile): E * factor = p
    p = (out["E"].float().view(x.shape[0], -1, tile_n) * factor[:, :, None]).view(x.shape[0], -1)
    g_epi = (p - onehot.float()).to(torch.bfloat16)
    g_today = (torch.softmax(logits.float(), 1) - onehot.float()).to(torch.bfloat16)

    def rel(a, b):
        a, b = a[kept].double(), b[kept]
        return ((a - b).norm() / b.norm()).item()

    return rel(lse_epi, lse64), rel(lse_today, lse64), rel(g_epi, g64), rel(g_today, g64)


def backward_rows(name: str, x, w, y, plan, rows, m: int) -> list[str]:
    """The ``--backward`` rows of one shape: (variant, ms, dX error) at a chunk of ``m`` rows."""
    from fused_lm_loss.exp_epilogue import ExpStats

    lce = peers.quack_lce()
    _, h, v = SHAPES[name]
    tile_n = pick_tile_n(v)
    xs, target = rows.gather(x, 0, m), rows.target[:m].contiguous()
    run, out = epilogue_gemm(xs, w, target, tile_n)
    run()
    stats = ExpStats(k=out["k"], sum_exp=out["sum_exp"], target_logit=out["target_logit"], tile_n=tile_n)
    lse = torch.empty(m, device=DEVICE, dtype=torch.float32)
    plan.backend.merge_exp_stats(stats, torch.empty_like(lse), lse, terms=plan.terms)
    scale = 1.0 / m
    f32 = torch.float32
    dx, dw = torch.empty(m, h, device=DEVICE, dtype=f32), torch.empty(v, h, device=DEVICE, dtype=f32)
    grad = torch.empty_like(out["E"])

    def library():  # (this script's epilogue keeps per-tile offsets: every row takes grad_from_exp's rescale loop)
        f = plan.backend.grad_from_exp(grad.copy_(out["E"]), target, lse, stats, terms=plan.grad_terms,
                                       grad_scale=scale, row_scale=None)
        torch.ops.aten.mm.dtype_out(grad, w, f32, out=dx).mul_(f[:, None])
        torch.ops.aten.mm.dtype_out(grad.t(), torch.mul(xs, f[:, None]), f32, out=dw)

    def quack_plain():
        f = plan.backend.grad_from_exp(grad.copy_(out["E"]), target, lse, stats, terms=plan.grad_terms,
                                       grad_scale=scale, row_scale=None)
        lce.identity_epi.gemm(grad, w.mT, dx, epi_args={})
        dx.mul_(f[:, None])
        lce.identity_epi.gemm(grad.t(), torch.mul(xs, f[:, None]).mT, dw, epi_args={})

    strip = torch.empty(v // 64, m, device=DEVICE, dtype=x.dtype)
    v_row, loss = torch.empty(m, device=DEVICE, dtype=f32), torch.empty(m, device=DEVICE, dtype=f32)
    x_scaled = torch.empty_like(xs)
    tile_n2 = 192 if h % 192 == 0 else 256
    grad_scale = torch.tensor(scale, device=DEVICE, dtype=f32)

    def quack_strip():
        lce.lce_glue(out["k"], out["sum_exp"], xs, target, out["target_logit"], out["E"], loss, strip, v_row,
                     x_scaled, tile_n, ignore_index=-100, grad_scale=grad_scale)
        bundle = lce.transform_a_operand(lce._lce_dx_scale, out["E"], {"u": strip}, 128, 64)
        lce._lce_vscale_epi.gemm(bundle, w.mT, dx, epi_args=dict(v=v_row.unsqueeze(0)), transform_a=lce._lce_dx_scale,
                                 tile_M=128, tile_N=tile_n2, tile_K=64, cluster_M=2, cluster_N=1)
        bundle = lce.transform_a_operand(lce._lce_dw_scale, out["E"].t(), {"u": strip}, 128, 64)
        lce.identity_epi.gemm(bundle, x_scaled.mT, dw, epi_args={}, transform_a=lce._lce_dw_scale,
                              add_to_output=False, tile_M=128, tile_N=tile_n2, tile_K=64, cluster_M=1, cluster_N=2)

    z64 = xs[:256].double() @ w.double().T
    g64 = torch.softmax(z64, 1)
    g64[torch.arange(256, device=DEVICE), target[:256]] -= 1.0
    dx64 = (g64 * scale) @ w.double()
    del z64, g64
    lines = []
    for variant, fn in (("library", library), ("quack_plain", quack_plain), ("quack_strip", quack_strip)):
        try:
            fn()  # (the JIT compile of Quack's kernels)
            sync()
            err = ((dx[:256].double() - dx64).norm() / dx64.norm()).item()
            ms = bench(fn)
            lines.append(f"| {name} | {m} | {variant} | {ms:.3f} | {tflops(4 * m * h * v, ms):.0f} | {err:.2e} |")
        except Exception as e:  # noqa: BLE001 - a failed compile or launch is a result too
            lines.append(f"| {name} | {m} | {variant} | failed: {type(e).__name__}: {str(e)[:160]} | | |")
        print(lines[-1], flush=True)
    return lines


def chunk_rows(plan, rows, extra: str) -> list[int]:
    """The plan's chunk rows and each of ``--rows``, rounded up to the GEMM's 128-row tile, at most the batch's."""
    return [min(-(-m // 128) * 128, rows.count // 128 * 128)
            for m in [plan.chunk_rows] + [int(r) for r in extra.split(",") if r]]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=None, help=f"of {','.join(SHAPES)}")
    parser.add_argument("--rows", default="4096", help="chunk rows to time besides the plan's (both modes)")
    parser.add_argument("--configs", default="auto", help="epilogue launch settings: auto, or tile_n/p|c/MxN")
    parser.add_argument("--backward", action="store_true", help="time what follows the epilogue GEMM instead")
    args = parser.parse_args()
    from fused_lm_loss.exp_epilogue import ExpStats

    if DEVICE != "cuda":
        print("needs CUDA (an sm90 GPU) and quack-kernels")
        return
    try:
        importlib.import_module("quack.epilogue.scaled_exp")
    except Exception as e:  # noqa: BLE001 - report and stop
        print(f"quack unavailable: {type(e).__name__}: {str(e)[:300]}")
        return
    print(f"quack-kernels {peers.version('quack-kernels')} · nvidia-cutlass-dsl {peers.version('nvidia-cutlass-dsl')}"
          f" · torch {torch.__version__} · {torch.cuda.get_device_name()}")
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.backward:
        lines = ["| shape | M | variant | ms (G pass, dX, dW) | TF/s (dX + dW) | dX err (256 rows) |", "|---" * 6 + "|"]
        for name in default_shapes(args.shapes):
            x, w, y = inputs(name, 0.1)
            plan, _, rows = plan_for(x, w, y, "train")
            for m in chunk_rows(plan, rows, args.rows):
                lines += backward_rows(name, x, w, y, plan, rows, m)
                torch.cuda.empty_cache()
        print("\n".join(lines))
        return
    header = ("| shape | M | tile_n | cuBLAS ms (TF/s) | stats ms | cuBLAS + stats | config | epilogue ms (TF/s) | "
              "merge ms | (epilogue + merge) / (cuBLAS + stats) | grad from E ms | grad ms |")
    table = [header, "|---" * 12 + "|"]
    errors = ["| shape | M | lse err: epilogue | lse err: today | G err: from E | G err: today (bf16 logits) |",
              "|---|---|---|---|---|---|"]
    for name in default_shapes(args.shapes):
        x, w, y = inputs(name, 0.1)
        plan, head, rows = plan_for(x, w, y, "train")
        _, h, v = SHAPES[name]
        tile_n = pick_tile_n(v)
        for i, m in enumerate(chunk_rows(plan, rows, args.rows)):
            xs, target = rows.gather(x, 0, m), rows.target[:m].contiguous()
            logits = torch.empty(m, v, device=DEVICE, dtype=x.dtype)
            loss, lse = (torch.empty(m, device=DEVICE, dtype=torch.float32) for _ in range(2))
            grad = torch.empty_like(logits)
            kwargs = dict(transform=plan.transform, terms=plan.terms)
            t_mm = bench(lambda: torch.mm(xs, w.t(), out=logits))
            t_stats = bench(lambda: plan.backend.row_losses(logits, target, loss, lse, **kwargs))
            t_grad = bench(lambda: plan.backend.grad_logits(logits, grad, target, lse, grad_scale=plan.grad_scale,
                                                            row_scale=None, transform=plan.transform,
                                                            terms=plan.grad_terms))
            row = [name, str(m), str(tile_n), f"{t_mm:.3f} ({tflops(2 * m * h * v, t_mm):.0f})", f"{t_stats:.3f}",
                   f"{t_mm + t_stats:.3f}"]
            for config in args.configs.split(","):
                if config == "auto":
                    tn, pingpong, cluster = tile_n, None, (2, 1)
                else:
                    tn, mode, mn = config.split("/")
                    tn, pingpong, cluster = int(tn), mode == "p", tuple(int(c) for c in mn.split("x"))
                    if v % tn:
                        continue
                cells = row + [config]
                try:
                    run, out = epilogue_gemm(xs, w, target, tn, pingpong, cluster)
                    run()  # the JIT compile
                    torch.cuda.synchronize()
                    t_epi = bench(run)
                    stats = ExpStats(k=out["k"], sum_exp=out["sum_exp"], target_logit=out["target_logit"], tile_n=tn)
                    merged = torch.empty_like(loss), torch.empty_like(lse)  # (lse stays today's, for accuracy())
                    t_merge = bench(lambda: plan.backend.merge_exp_stats(stats, *merged, terms=plan.terms))
                    t_grad_exp = bench(lambda: plan.backend.grad_from_exp(
                        grad.copy_(out["E"]), target, merged[1], stats, terms=plan.grad_terms,
                        grad_scale=plan.grad_scale, row_scale=None))
                    cells += [f"{t_epi:.3f} ({tflops(2 * m * h * v, t_epi):.0f})", f"{t_merge:.3f}",
                              f"{(t_epi + t_merge) / (t_mm + t_stats):.3f}", f"{t_grad_exp:.3f}"]
                    if i == 0 and config == "auto":
                        errs = accuracy(xs, w, target, logits, lse, out, tn)
                        errors.append(f"| {name} | {m} | " + " | ".join(f"{e:.2e}" for e in errs) + " |")
                    out = run = stats = merged = None
                except Exception as e:  # noqa: BLE001 - a failed compile or launch is a result too
                    cells += [f"failed: {type(e).__name__}: {str(e)[:120]}", "", "", ""]
                table.append("| " + " | ".join(cells + [f"{t_grad:.3f}"]) + " |")
                print(table[-1], flush=True)
            logits = grad = None
            torch.cuda.empty_cache()
        x = w = y = None
        torch.cuda.empty_cache()
    print("\n".join(table))
    print()
    print("\n".join(errors))


if __name__ == "__main__":
    main()
