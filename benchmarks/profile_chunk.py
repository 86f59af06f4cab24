"""Where the time of one chunk goes: each step of the chunk loop timed alone, on the GPU.

    python benchmarks/profile_chunk.py [--shapes gemma2-2b,qwen2.5-0.5b] [--rows 448,512]

For each shape and chunk size it times (median of CUDA-event timings, ``triton.testing.do_bench``):
  logits   h_chunk @ W.T into the chunk buffer (cuBLAS)
  stats    the row_stats kernel; grad: the grad_logits kernel (their HBM bandwidth is printed)
  dX       G @ W (cuBLAS);  dW16 / dW32: dW += G.T @ h into a bf16 / fp32 accumulator
  dX|dW    dX on a second stream beside dW, as the chunk loop runs them
and the three full-batch matmuls of the floor, so that each step can be read as TFLOP/s or GB/s and as
its share of the floor. ``--profile``: a torch.profiler pass over one fused forward+backward lists the
kernels that actually ran (cuBLAS kernel names say whether a GEMM was split along K), and times the step
with dX and dW on one stream. ``--variants``: stats segment sizes, grad launch shapes, split-K dX and other
cuBLAS entry points for the logits. ``--dx-rows qwen2.5-0.5b:768,832``: G @ W at given row counts.
``--forward``: the forward without gradients with the statistics from the matmul epilogue or from cuBLAS
logits + row_stats. ``--no-dw-rows 4096``: forward-only and frozen-head steps at given chunk sizes.
``--profile-frozen``: the kernels of a frozen-head step; ``--preamble``: GPU time before a step's first matmul
(select_rows variants); ``--select-rows``: their host time; ``--timeline``: a profiled step's busy and idle GPU
time, where the gaps are, and the host ops before the first matmul and at the end.
Without a GPU (``TRITON_INTERPRET=1 ... --shapes tiny``) every step runs once, as a dry run.
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from fused_lm_loss import FusedLMLoss, kernels  # noqa: E402
from fused_lm_loss import chunked  # noqa: E402
from fused_lm_loss.chunked import _matmul_accumulate, auto_chunk_rows  # noqa: E402

grad_mod = importlib.import_module("fused_lm_loss.kernels.grad_logits")
row_stats_mod = importlib.import_module("fused_lm_loss.kernels.row_stats")

SHAPES = {
    "tiny": (512, 64, 4000),  # a dry run on CPU (TRITON_INTERPRET=1) before spending device time
    "llama3-8b": (8192, 4096, 128256),
    "qwen2.5-7b": (8192, 3584, 152064),
    "gemma2-2b": (8192, 2304, 256000),
    "qwen2.5-0.5b": (8192, 896, 151936),
}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def bench(fn) -> float:
    if not torch.cuda.is_available():  # dry run: just check that it runs
        fn()
        return 1.0
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def tflops(flop, ms):
    return flop / ms / 1e9


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="llama3-8b,qwen2.5-7b,gemma2-2b,qwen2.5-0.5b")
    parser.add_argument("--rows", default="", help="chunk rows to try besides the automatic one")
    parser.add_argument("--profile", action="store_true", help="also list the kernels of one fused step")
    parser.add_argument("--variants", action="store_true", help="also time launch-shape and split variants")
    parser.add_argument("--dx-rows", default="", help="name:rows,rows;name:rows... time G @ W at these chunk sizes")
    parser.add_argument("--no-dw-rows", default="", help="rows,rows: forward-only and frozen-head steps at these "
                        "chunk sizes (and the automatic one), as exact sizes rather than equalized chunks")
    parser.add_argument("--forward", action="store_true", help="forward without gradients: stats kernel or "
                        "matmul epilogue")
    parser.add_argument("--profile-frozen", action="store_true", help="only the kernels of a frozen-head step")
    parser.add_argument("--preamble", action="store_true", help="time the work before the first matmul")
    parser.add_argument("--select-rows", action="store_true", help="host time of select_rows variants")
    parser.add_argument("--timeline", action="store_true", help="busy and idle GPU time of one profiled step")
    args = parser.parse_args()
    torch.manual_seed(0)
    per_shape_sweeps = {
        "forward": forward_sweep,
        "no_dw_rows": lambda name: no_dw_sweep(name, [int(r) for r in args.no_dw_rows.split(",")]),
        "preamble": preamble_sweep,
        "timeline": timeline,
        "select_rows": select_rows_host_time,
        "profile_frozen": lambda name: profile_step(*_step_inputs(name)[:3], name, frozen=True),
    }
    for flag, sweep in per_shape_sweeps.items():
        if getattr(args, flag):
            for name in args.shapes.split(","):
                sweep(name)
            return
    if args.dx_rows:
        for item in args.dx_rows.split(";"):
            name, rows = item.split(":")
            dx_sweep(name, [int(r) for r in rows.split(",")])
        return
    for name in args.shapes.split(","):
        n, h, v = SHAPES[name]
        x = torch.randn(n, h, device=DEVICE, dtype=torch.bfloat16)
        w = (torch.randn(v, h, device=DEVICE) * (4 / math.sqrt(h))).to(torch.bfloat16)
        y = torch.randint(0, v, (n,), device=DEVICE)
        full = torch.empty(n, v, device=DEVICE, dtype=torch.bfloat16)
        flop = 2 * n * h * v
        t_f = bench(lambda: torch.mm(x, w.t(), out=full))
        dx_full = torch.empty_like(x)
        t_dx = bench(lambda: torch.mm(full, w, out=dx_full))
        dw_full = torch.empty_like(w)
        t_dw = bench(lambda: torch.mm(full.t(), x, out=dw_full))
        floor = t_f + t_dx + t_dw
        print(f"\n## {name}: N={n} H={h} V={v}; floor {floor:.2f} ms = x@W.T {t_f:.2f} ({tflops(flop, t_f):.0f} TF/s)"
              f" + G@W {t_dx:.2f} ({tflops(flop, t_dx):.0f}) + G.T@x {t_dw:.2f} ({tflops(flop, t_dw):.0f})")
        full = None  # free the N x V buffer
        auto = min(auto_chunk_rows(v * 2), n)
        rows_list = [auto] + [int(r) for r in args.rows.split(",") if r and int(r) <= n]
        acc16 = torch.zeros_like(w)
        acc32 = torch.zeros(v, h, device=DEVICE, dtype=torch.float32)
        side = torch.cuda.Stream() if DEVICE == "cuda" else None
        print("| rows | chunks | logits | stats (GB/s) | grad (GB/s) | dX | dW16 | dW32 | dX‖dW16 | dX‖dW32 |"
              " est. total bf16acc / fp32acc (× floor) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for c in rows_list:
            buf = torch.empty(c, v, device=DEVICE, dtype=torch.bfloat16)
            out = torch.empty_like(buf)
            hc = x[:c].contiguous()
            torch.mm(hc, w.t(), out=buf)
            tc = y[:c].contiguous()
            lse = torch.logsumexp(buf.float(), -1)
            cflop = 2 * c * h * v
            t_logits = bench(lambda: torch.mm(hc, w.t(), out=buf))
            t_stats = bench(lambda: kernels.row_stats(buf, tc, logit_scale=1.0, softcap=None, need_sum=False))
            kw = dict(grad_scale=1 / n, row_scale=None, logit_scale=1.0, softcap=None, label_smoothing=0.0,
                      vocab_size=v, z_loss=0.0)
            t_grad = bench(lambda: kernels.grad_logits(buf, out, tc, lse, **kw))
            dx = torch.empty(c, h, device=DEVICE, dtype=torch.bfloat16)
            t_dxc = bench(lambda: torch.mm(out, w, out=dx))
            t_dw16 = bench(lambda: acc16.addmm_(out.t(), hc))
            t_dw32 = bench(lambda: _matmul_accumulate(acc32, out.t(), hc, first=False))

            def both(acc_fn):
                def run():
                    if side is None:
                        torch.mm(out, w, out=dx)
                        return acc_fn()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        torch.mm(out, w, out=dx)
                    acc_fn()
                    torch.cuda.current_stream().wait_stream(side)
                return run

            t_both16 = bench(both(lambda: acc16.addmm_(out.t(), hc)))
            t_both32 = bench(both(lambda: _matmul_accumulate(acc32, out.t(), hc, first=False)))
            n_rows = int(n * 0.9)
            chunks = n_rows / c
            per16 = t_logits + t_stats + t_grad + t_both16
            per32 = t_logits + t_stats + t_grad + t_both32
            nbytes = c * v * 2
            print(f"| {c} | {chunks:.1f} | {t_logits:.3f} ({tflops(cflop, t_logits):.0f} TF/s) | {t_stats:.3f} "
                  f"({nbytes / t_stats / 1e6:.0f}) | {t_grad:.3f} ({2 * nbytes / t_grad / 1e6:.0f}) | "
                  f"{t_dxc:.3f} ({tflops(cflop, t_dxc):.0f}) | {t_dw16:.3f} ({tflops(cflop, t_dw16):.0f}) | "
                  f"{t_dw32:.3f} ({tflops(cflop, t_dw32):.0f}) | {t_both16:.3f} | {t_both32:.3f} | "
                  f"{per16 * chunks:.1f} ({per16 * chunks / floor:.2f}×) / {per32 * chunks:.1f} "
                  f"({per32 * chunks / floor:.2f}×) |")
            if c == auto and args.variants:
                kernel_variants(buf, out, tc, lse, w, kw)
            buf = out = None
        if args.profile:
            profile_step(x, w, torch.where(torch.rand(y.shape, device=DEVICE) < 0.1, -100, y), name)
        acc16 = acc32 = None


@triton.jit
def _two_pass_stats(logits_ptr, row_stride, partial_ptr, n_rows, n_cols, SEGMENT_COLS: tl.constexpr,
                    BLOCK_V: tl.constexpr):
    """Experiment: a segment's max with per-lane maxima, then its sum-exp in a second read (from L2):
    one cross-warp reduction per pass instead of two per block."""
    row = tl.program_id(0).to(tl.int64)
    segment = tl.program_id(1)
    row_ptr = logits_ptr + row * row_stride + segment * SEGMENT_COLS
    n = tl.minimum(n_cols - segment * SEGMENT_COLS, SEGMENT_COLS)
    offsets = tl.arange(0, BLOCK_V)
    lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    for start in range(0, n, BLOCK_V):
        z = tl.load(row_ptr + start + offsets, mask=start + offsets < n, other=float("-inf")).to(tl.float32)
        lane_max = tl.maximum(lane_max, z)
    seg_max = tl.max(lane_max, axis=0)
    lane_sum = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, n, BLOCK_V):
        z = tl.load(row_ptr + start + offsets, mask=start + offsets < n, other=float("-inf")).to(tl.float32)
        lane_sum += tl.exp(z - seg_max)
    out = partial_ptr + segment * n_rows + row
    tl.store(out, seg_max)
    tl.store(out + tl.num_programs(1) * n_rows, tl.sum(lane_sum, axis=0))


@triton.jit
def _lane_online_stats(logits_ptr, row_stride, partial_ptr, n_rows, n_cols, SEGMENT_COLS: tl.constexpr,
                       BLOCK_V: tl.constexpr):
    """Experiment: online softmax per lane (no reduction inside the loop, two exps per element)."""
    row = tl.program_id(0).to(tl.int64)
    segment = tl.program_id(1)
    row_ptr = logits_ptr + row * row_stride + segment * SEGMENT_COLS
    n = tl.minimum(n_cols - segment * SEGMENT_COLS, SEGMENT_COLS)
    offsets = tl.arange(0, BLOCK_V)
    lane_max = tl.full([BLOCK_V], -1e30, tl.float32)
    lane_sum = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, n, BLOCK_V):
        z = tl.load(row_ptr + start + offsets, mask=start + offsets < n, other=-1e30).to(tl.float32)
        new_max = tl.maximum(lane_max, z)
        lane_sum = lane_sum * tl.exp(lane_max - new_max) + tl.exp(z - new_max)
        lane_max = new_max
    seg_max = tl.max(lane_max, axis=0)
    out = partial_ptr + segment * n_rows + row
    tl.store(out, seg_max)
    tl.store(out + tl.num_programs(1) * n_rows, tl.sum(lane_sum * tl.exp(lane_max - seg_max), axis=0))


def kernel_variants(buf, out, target, lse, w, kw):
    rows, v = buf.shape
    nbytes = buf.numel() * 2
    line = []
    n_segments = lambda seg: triton.cdiv(v, seg)  # noqa: E731
    partial = torch.empty(4 * triton.cdiv(v, 4096) * rows, device=buf.device, dtype=torch.float32)
    for segment in (8192, 16384, 32768):
        for block, warps in ((1024, 1), (1024, 2), (2048, 2), (2048, 4), (4096, 4), (4096, 8), (8192, 8)):
            if block > segment:
                continue
            t = bench(lambda: row_stats_mod._segment_stats_kernel[(rows, n_segments(segment))](
                buf, buf.stride(0), target, partial, rows, v, 1.0, 1.0, HAS_SOFTCAP=False, NEED_SUM=False,
                SEGMENT_COLS=segment, BLOCK_V=block, num_warps=warps))
            line.append(f"stats segments only, {segment} cols, {block}/{warps}w {t:.3f} ms ({nbytes / t / 1e6:.0f} GB/s)")
        for block, warps in ((2048, 4), (4096, 8)):
            for kernel, label in ((_two_pass_stats, "two-pass"), (_lane_online_stats, "per-lane online")):
                t = bench(lambda: kernel[(rows, n_segments(segment))](
                    buf, buf.stride(0), partial, rows, v, SEGMENT_COLS=segment, BLOCK_V=block, num_warps=warps))
                line.append(f"stats {label}, {segment} cols, {block}/{warps}w {t:.3f} ms ({nbytes / t / 1e6:.0f} GB/s)")
    for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 16)):
        t = bench(lambda: grad_mod._grad_logits_kernel[(rows, triton.cdiv(v, block))](
            buf, buf.stride(0), out, out, out.stride(0), target, lse, lse, v, 1e-4, 1.0, 1.0, 0.0, 1.0, 0.0,
            HAS_SOFTCAP=False, PER_ROW_SCALE=False, SPLIT=False, BLOCK_V=block, num_warps=warps))
        line.append(f"grad {block}/{warps}w {t:.3f} ms ({2 * nbytes / t / 1e6:.0f} GB/s)")
    # stats then grad on sub-chunks small enough that the grad kernel's read hits L2
    for sub in (16, 32, 64, 128):
        def run_sub():
            for s0 in range(0, rows, sub):
                b, o = buf[s0 : s0 + sub], out[s0 : s0 + sub]
                kernels.row_stats(b, target[s0 : s0 + sub], logit_scale=1.0, softcap=None, need_sum=False)
                kernels.grad_logits(b, o, target[s0 : s0 + sub], lse[s0 : s0 + sub], **kw)

        line.append(f"stats+grad in {sub}-row sub-chunks {bench(run_sub):.3f} ms")
    t_sg = bench(lambda: (kernels.row_stats(buf, target, logit_scale=1.0, softcap=None, need_sum=False),
                          kernels.grad_logits(buf, out, target, lse, **kw)))
    line.append(f"stats+grad whole chunk {t_sg:.3f} ms")
    h = w.shape[1]
    dx = torch.empty(rows, h, device=DEVICE, dtype=torch.bfloat16)
    for splits in (2, 4, 8):
        if v % splits:
            continue
        part = torch.empty(splits, rows, h, device=DEVICE, dtype=torch.float32)
        g3 = out.view(rows, splits, v // splits).transpose(0, 1)
        w3 = w.view(splits, v // splits, h)

        def run_split():
            if DEVICE == "cuda":
                torch.ops.aten.bmm.dtype_out(g3, w3, torch.float32, out=part)
            else:
                torch.bmm(g3.float(), w3.float(), out=part)
            torch.sum(part, 0, out=dx)

        line.append(f"dX split-K {splits} (bmm fp32 + sum) {bench(run_split):.3f} ms")
    # the logits matmul through other cuBLAS entry points (their heuristics pick other kernels)
    hc = torch.randn(rows, h, device=DEVICE, dtype=torch.bfloat16)
    flop = 2 * rows * h * v
    zero_bias = torch.zeros(v, device=DEVICE, dtype=torch.bfloat16)
    for label, fn in (
        ("mm", lambda: torch.mm(hc, w.t(), out=buf)),
        ("addmm zero bias (cublasLt)", lambda: torch.addmm(zero_bias, hc, w.t(), out=buf)),
        ("F.linear", lambda: torch.nn.functional.linear(hc, w)),
        ("mm transposed (W @ h.T)", lambda: torch.mm(w, hc.t())),
    ):
        t = bench(fn)
        line.append(f"logits {label} {t:.3f} ms ({tflops(flop, t):.0f} TF/s)")
    print("variants at the automatic chunk:\n  " + "\n  ".join(line))


def dx_sweep(name, rows_list):
    """G @ W at several chunk sizes: cuBLAS picks its kernel per shape, and some picks leave SMs idle."""
    n, h, v = SHAPES[name]
    w = (torch.randn(v, h, device=DEVICE) * (4 / math.sqrt(h))).to(torch.bfloat16)
    print(f"\n{name}: G @ W (ms) | rows: plain / as (W.T @ G.T).T / split-K 4 | logits h @ W.T")
    for c in rows_list:
        g = torch.randn(c, v, device=DEVICE, dtype=torch.bfloat16) * 1e-3
        hc = torch.randn(c, h, device=DEVICE, dtype=torch.bfloat16)
        dx = torch.empty(c, h, device=DEVICE, dtype=torch.bfloat16)
        dx_t = torch.empty(h, c, device=DEVICE, dtype=torch.bfloat16)
        t_plain = bench(lambda: torch.mm(g, w, out=dx))
        t_trans = bench(lambda: (torch.mm(w.t(), g.t(), out=dx_t), dx.copy_(dx_t.t())))
        t_split = float("nan")
        if v % 4 == 0 and DEVICE == "cuda":
            part = torch.empty(4, c, h, device=DEVICE, dtype=torch.float32)
            g3, w3 = g.view(c, 4, v // 4).transpose(0, 1), w.view(4, v // 4, h)
            t_split = bench(lambda: (torch.ops.aten.bmm.dtype_out(g3, w3, torch.float32, out=part),
                                     torch.sum(part, 0, out=dx)))
        t_logits = bench(lambda: torch.mm(hc, w.t(), out=g))
        print(f"  {c}: {t_plain:.3f} / {t_trans:.3f} / {t_split:.3f} | {t_logits:.3f}")


def _step_inputs(name):
    """bf16 hidden states and weight (logits of std ~4), labels with 10% ignored, and a full logits buffer
    for the floor matmul."""
    n, h, v = SHAPES[name]
    x = torch.randn(n, h, device=DEVICE, dtype=torch.bfloat16)
    w = (torch.randn(v, h, device=DEVICE) * (4 / math.sqrt(h))).to(torch.bfloat16)
    y = torch.randint(0, v, (n,), device=DEVICE)
    y[torch.rand(n, device=DEVICE) < 0.1] = -100
    return x, w, y, torch.empty(n, v, device=DEVICE, dtype=torch.bfloat16)


def no_dw_sweep(name, rows_list):
    """Forward-only and frozen-head steps (no dW accumulator, so no cost per chunk beyond its rows) at exact
    chunk sizes: is one size's cuBLAS pick better per row than another's? Repeated 3 times, interleaved."""
    x, w, y, full = _step_inputs(name)
    dx = torch.empty_like(x)
    planner = chunked.plan_chunk_rows
    results = {}
    for repeat in range(3):
        t1 = bench(lambda: torch.mm(x, w.t(), out=full))
        t2 = t1 + bench(lambda: torch.mm(full, w, out=dx))
        results.setdefault("floor", []).append((t1, t2))
        for rows in [None] + rows_list:
            label = "auto (equal chunks)" if rows is None else f"{rows} rows"
            if rows is not None:
                chunked.plan_chunk_rows = lambda n_rows, max_rows: min(n_rows, max_rows)
            loss_fn = FusedLMLoss(chunk_size=rows)
            xr = x.detach().requires_grad_()

            def frozen():
                xr.grad = None
                loss_fn(xr, w, y).backward()

            with torch.no_grad():
                t_fwd = bench(lambda: loss_fn(x, w, y))
            t_frozen = bench(frozen)
            chunked.plan_chunk_rows = planner
            results.setdefault(label, []).append((t_fwd, t_frozen))
    floor_fwd = sorted(r[0] for r in results["floor"])[1]
    floor_frozen = sorted(r[1] for r in results["floor"])[1]
    print(f"\n{name}: forward floor {floor_fwd:.2f} ms, frozen-head floor {floor_frozen:.2f} ms (medians of 3)")
    for label, runs in results.items():
        if label != "floor":
            fwd, frz = sorted(r[0] for r in runs)[1], sorted(r[1] for r in runs)[1]
            print(f"  {label}: forward {fwd:.2f} ms ({fwd / floor_fwd:.3f}×), frozen {frz:.2f} ms "
                  f"({frz / floor_frozen:.3f}×)   runs {[f'{a:.2f}/{b:.2f}' for a, b in runs]}")


def forward_sweep(name):
    """Forward without gradients (10% ignored labels), × the full-batch cuBLAS matmul: cuBLAS logits +
    row_stats, and the matmul-epilogue statistics with bf16-rounded (default) and fp32 logits. 3 interleaved
    repeats, medians."""
    x, w, y, full = _step_inputs(name)
    variants = {"cuBLAS + row_stats": (False, None), "epilogue": (True, None), "epilogue, fp32 logits": (True, torch.float32)}
    results = {}
    with torch.no_grad():
        for repeat in range(3):
            results.setdefault("floor", []).append(bench(lambda: torch.mm(x, w.t(), out=full)))
            for label, (in_matmul, logits_dtype) in variants.items():
                chunked.STATS_IN_MATMUL = in_matmul
                loss_fn = FusedLMLoss(logits_dtype=logits_dtype)
                results.setdefault(label, []).append(bench(lambda: loss_fn(x, w, y)))
    chunked.STATS_IN_MATMUL = True
    floor = sorted(results["floor"])[1]
    print(f"\n{name}: forward floor (x @ W.T, full batch) {floor:.3f} ms")
    for label, runs in results.items():
        if label != "floor":
            print(f"  {label}: {sorted(runs)[1] / floor:.3f}×   (runs {' '.join(f'{t / floor:.3f}' for t in runs)})")


def _select_rows_v13(labels, ignore_index, shard):
    """select_rows of v13 (about ten small PyTorch kernels and one sync), for the A/B against the kept-rows
    kernel (v14)."""
    valid = labels != ignore_index
    lowest, highest = torch.aminmax(torch.where(valid, labels, 0))
    count, lowest, highest = torch.stack([valid.sum(), lowest.long(), highest.long()]).tolist()
    assert lowest >= 0 and highest < shard.total
    if count == labels.numel():
        return chunked.Rows(index=None, target=labels, count=count)
    index = torch.nonzero_static(valid, size=count).squeeze(1)
    return chunked.Rows(index=index, target=labels[index], count=count)


SELECT_ROWS_VARIANTS = {"kept-rows kernel (v14)": chunked.select_rows, "torch ops (v13)": _select_rows_v13}


def select_rows_host_time(name):
    """Host time of select_rows alone (from a synced GPU to its return), medians of 50, per variant."""
    x, w, y, full = _step_inputs(name)
    shard = chunked.distributed.Shard(start=0, size=w.shape[0], total=w.shape[0])
    y50 = torch.where(torch.rand(y.shape[0], device=DEVICE) < 0.5, -100, torch.randint_like(y, 0, w.shape[0]))
    for label, select in SELECT_ROWS_VARIANTS.items():
        for ignored, labels in (("10%", y), ("50%", y50)):
            times = []
            for _ in range(60):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                rows = select(labels, -100, shard)
                times.append(1e3 * (time.perf_counter() - t0))
            ref = chunked.select_rows(labels, -100, shard)
            same = torch.equal(rows.index, ref.index) and torch.equal(rows.target, ref.target)
            print(f"{name} select_rows {label}, {ignored} ignored: {sorted(times[10:])[25]:.3f} ms host "
                  f"(same rows: {same})")


def _scenario_steps(x, w, y, y50, loss_fn):
    """(scenario, step, lm_head trained) for a training step at 10% and 50% ignored labels and a frozen head."""
    for scenario, labels, train_head in (("train", y, True), ("train 50%", y50, True), ("frozen", y, False)):
        xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_(train_head)

        def step(xr=xr, wr=wr, labels=labels):
            xr.grad = wr.grad = None
            loss_fn(xr, wr, labels).backward()

        yield scenario, step, train_head


def preamble_sweep(name):
    """What the work before the first logits matmul costs a step: GPU time from the step's start to that
    matmul (CUDA events), and step times with each of SELECT_ROWS_VARIANTS, for a
    training step (10% and 50% ignored) and a frozen head. 3 interleaved repeats, medians."""
    x, w, y, full = _step_inputs(name)
    full = None
    y50 = torch.where(torch.rand(y.shape[0], device=DEVICE) < 0.5, -100, torch.randint_like(y, 0, w.shape[0]))
    loss_fn, current = FusedLMLoss(), chunked.select_rows
    original_logits = chunked._logits_into
    marks = []

    def marking_logits(out, *args):
        if not marks:
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[0].record()
        return original_logits(out, *args)

    results = {}
    for repeat in range(3):
        for label, select in SELECT_ROWS_VARIANTS.items():
            chunked.select_rows = select
            for scenario, step, train_head in _scenario_steps(x, w, y, y50, loss_fn):
                t = bench(step)
                chunked._logits_into = marking_logits
                idle = []
                for _ in range(5):
                    marks.clear()
                    start = torch.cuda.Event(enable_timing=True)
                    torch.cuda.synchronize()
                    start.record()
                    step()
                    torch.cuda.synchronize()
                    idle.append(start.elapsed_time(marks[0]))
                chunked._logits_into = original_logits
                results.setdefault((scenario, label), []).append((t, sorted(idle)[2]))
    chunked.select_rows = current
    print(f"\n{name}: step ms / GPU ms before the first logits matmul, medians of 3")
    for (scenario, label), runs in results.items():
        t, idle = sorted(r[0] for r in runs)[1], sorted(r[1] for r in runs)[1]
        print(f"  {scenario}, select_rows {label}: {t:.3f} ms, {idle:.3f} ms before the first matmul   runs "
              + " ".join(f"{a:.3f}/{b:.3f}" for a, b in runs))


def timeline(name):
    """Where a step's GPU time goes: one profiled step per scenario (train 10% / 50% ignored, frozen head),
    after an L2 flush as in ``bench``. Kernel intervals give the GPU's busy time and its idle gaps (before the
    first matmul, between kernels, after the last); the host's op spans before the first matmul say what the
    GPU waited for. A diagnostic: CUPTI adds a little host time per launch."""
    import json
    import tempfile

    x, w, y, full = _step_inputs(name)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    floor_logits = bench(lambda: torch.mm(x, w.t(), out=full))
    floor_frozen = floor_logits + bench(lambda: torch.mm(full, w, out=dx))
    floors = {"train": floor_frozen + bench(lambda: torch.mm(full.t(), x, out=dw)), "frozen": floor_frozen}
    full = dx = dw = None
    y50 = torch.where(torch.rand(y.shape[0], device=DEVICE) < 0.5, -100, torch.randint_like(y, 0, w.shape[0]))
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=DEVICE)
    loss_fn = FusedLMLoss()
    for scenario, step, train_head in _scenario_steps(x, w, y, y50, loss_fn):
        t = bench(step)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(3):  # the last step is read
                flush.zero_()
                torch.cuda._sleep(10)  # spin_kernel: the step starts when it ends
                with torch.profiler.record_function("timed step"):
                    step()
                torch.cuda._sleep(10)  # ... and ends when the next one starts
                torch.cuda.synchronize()
        path = os.path.join(tempfile.mkdtemp(), "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        gpu_work = ("kernel", "gpu_memcpy", "gpu_memset")  # copies count as busy too (a clone is a memcpy)
        kernels = sorted((e for e in events if e.get("cat") in gpu_work), key=lambda e: e["ts"])
        spins = [i for i, k in enumerate(kernels) if "spin_kernel" in k["name"]]
        first, last = spins[-2], spins[-1]
        begin, end = kernels[first]["ts"] + kernels[first]["dur"], kernels[last]["ts"]
        step_kernels = kernels[first + 1 : last]
        is_gemm = lambda n: "nvjet" in n or "gemm" in n.lower() or "xmma" in n or "cutlass" in n
        busy, gaps, cursor, prev = 0.0, [], begin, "step start"
        for k in step_kernels:  # union of kernel intervals (two streams may overlap)
            k_end = k["ts"] + k["dur"]
            if k["ts"] > cursor:
                gaps.append((k["ts"] - cursor, prev, k["name"], cursor - begin))
            busy += max(0.0, k_end - max(k["ts"], cursor))
            if k_end > cursor:
                cursor, prev = k_end, k["name"]
        if end > cursor:
            gaps.append((end - cursor, prev, "step end", cursor - begin))
        first_gemm = next(k["ts"] - begin for k in step_kernels if is_gemm(k["name"]))
        floor = floors["train" if train_head else "frozen"]
        print(f"\n{name} {scenario}: bench {t:.2f} ms = {t / floor:.3f}× floor ({floor:.2f} ms); profiled step "
              f"{(end - begin) / 1e3:.2f} ms, kernels busy {busy / 1e3:.2f} ms = {busy / 1e3 / floor:.3f}× floor, idle {sum(g[0] for g in gaps) / 1e3:.2f} ms in {len(gaps)} gaps; first matmul "
              f"starts at {first_gemm / 1e3:.3f} ms; {len(step_kernels)} kernels")
        by_kind = {}
        for k in step_kernels:
            kind = "matmul" if is_gemm(k["name"]) else k["name"] if k["name"].startswith("_") else "other"
            by_kind[kind] = by_kind.get(kind, 0.0) + k["dur"]
        print("  kernel time: " + "; ".join(f"{k} {v / 1e3:.3f} ms" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])))
        by_next = {}
        for g in gaps:
            by_next[g[2][:50]] = by_next.get(g[2][:50], 0.0) + g[0]
        print("  idle before: " + "; ".join(f"{k} {v:.0f} us" for k, v in sorted(by_next.items(), key=lambda kv: -kv[1])[:8]))
        for g in sorted(gaps, key=lambda g: -g[0])[:6]:
            print(f"  gap {g[0]:.0f} us at {g[3] / 1e3:.3f} ms: {g[1][:45]} -> {g[2][:45]}")
        # the host's top-level ops from the step's call to its first matmul call (the last step)
        ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")),
                     key=lambda e: e["ts"])
        host0 = [e for e in ops if e["name"] == "timed step"][-1]["ts"]
        mm = [e for e in ops if e["ts"] > host0 and e["name"] in ("aten::mm", "aten::addmm")]
        copies = [k for k in step_kernels if k.get("cat") != "kernel"]
        print(f"  copies and fills: " + "; ".join(f"{k['name'][:30]} {k['dur']:.0f} us at {(k['ts'] - begin) / 1e3:.3f} ms"
                                           for k in copies[:8]))
        runtime = [e for e in events if e.get("cat") == "cuda_runtime" and e.get("ph") == "X"]
        spin_launch = next(e for e in runtime if e.get("args", {}).get("correlation") == kernels[last]["args"]["correlation"])
        print(f"  host: first matmul called {1e-3 * (mm[0]['ts'] - host0):.3f} ms after the step, end marker "
              f"launched at {1e-3 * (spin_launch['ts'] - host0):.3f} ms; ops until the first matmul, then the "
              f"last 40 host events:")
        host_events = sorted(ops + runtime, key=lambda e: e["ts"])
        head = [e for e in host_events if host0 < e["ts"] <= mm[0]["ts"] and e.get("cat") != "cuda_runtime"]
        tail = [e for e in host_events if host0 < e["ts"] <= spin_launch["ts"]][-40:]
        for part in (head[:70], tail):
            stack = []
            for e in part:
                while stack and e["ts"] >= stack[-1]:
                    stack.pop()
                print(f"    {1e-3 * (e['ts'] - host0):7.3f} ms {e['dur']:6.0f} us {'  ' * len(stack)}{e['name'][:60]}")
                stack.append(e["ts"] + e["dur"])
            print("    ...")


def profile_step(x, w, y, name, frozen=False):
    """One fused step on labels ``y`` (default options and ``accum_dtype=None``; ``frozen``: lm_head without
    gradient):
    time with one and two streams, host issue time, and the kernels that ran; their summed GPU time against
    the step's time says how much is gaps between kernels."""
    for opts in ({},) if frozen else ({}, {"accum_dtype": None}):
        xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_(not frozen)
        loss_fn = FusedLMLoss(**opts)

        def step():
            xr.grad = wr.grad = None
            loss_fn(xr, wr, y).backward()

        t = bench(step)
        chunked.OVERLAP_GRAD_MATMULS = False
        t_one_stream = bench(step)
        chunked.OVERLAP_GRAD_MATMULS = True
        print(f"{name} {opts or 'default'}: {t:.2f} ms; with dX and dW on one stream {t_one_stream:.2f} ms")
        if DEVICE == "cuda":  # is the chunk loop bound by the host issuing it? (forward does all the work)
            xr.grad = wr.grad = None
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss_fn(xr, wr, y)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            print(f"{name} {opts or 'default'}: forward issued in {1e3 * (t1 - t0):.2f} ms, done after "
                  f"{1e3 * (t2 - t0):.2f} ms")
        activity = torch.profiler.ProfilerActivity.CUDA if DEVICE == "cuda" else torch.profiler.ProfilerActivity.CPU
        with torch.profiler.profile(activities=[activity]) as prof:
            step()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
        print(f"\n{name} fused {opts or 'default'}: {t:.2f} ms; kernels of one step:")
        if os.environ.get("OUT"):
            prof.export_chrome_trace(os.path.join(os.environ["OUT"], f"trace_{name}_{len(opts)}.json"))
        sort_by = "cuda_time_total" if DEVICE == "cuda" else "cpu_time_total"
        events = prof.key_averages()
        print(events.table(sort_by=sort_by, row_limit=12, max_name_column_width=110))
        busy = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events) / 1e3
        print(f"{name} {'frozen head' if frozen else opts or 'default'}: kernels busy {busy:.2f} ms of a {t:.2f} ms step")


if __name__ == "__main__":
    main()
