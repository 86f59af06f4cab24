"""Speed, peak memory and accuracy of LM-loss implementations on one GPU, in one run.

    python benchmarks/bench_lm_loss.py --out results/            # everything (H200: ~5 min)
    python benchmarks/bench_lm_loss.py --quick                     # Llama-3-8B shape only

For each shape (N tokens, H hidden, V vocab; bf16) and scenario it times forward+backward (median of
CUDA-event timings after warm-up, L2 flushed before each run) and measures the peak memory beyond
the inputs and the gradient tensors, for:
  floor        the bf16 cuBLAS matmuls alone on the full batch: x @ W.T, G @ W, G.T @ x
               (forward-only: the first; frozen head: the first two)
  fused        fused_lm_loss (default options: bf16 logits, fp32 dW accumulator)
  fused_bf16acc, fused_fp32logits   the accum_dtype=None and logits_dtype=float32 variants
  fused_1stream  default options with dX and dW on one CUDA stream (main scenario only)
  eager        F.cross_entropy((x @ W.T).float(), y)
  torch_chunked  F.linear_cross_entropy(..., options=LinearCrossEntropyOptions()) where torch has it
  liger        LigerFusedLinearCrossEntropyLoss, when importable
  cce          cut_cross_entropy.linear_cross_entropy, when importable
Accuracy: relative error (L2 norm) of loss, dX and dW against a float64 computation of the same inputs.
Data: logits std ~4 with labels sampled from the model's own softmax ("realistic"), or near-uniform
logits; a fraction of labels set to -100.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from fused_lm_loss import FusedLMLoss  # noqa: E402

SHAPES = {
    "llama3-8b": (8192, 4096, 128256),
    "qwen2.5-7b": (8192, 3584, 152064),
    "gemma2-2b": (8192, 2304, 256000),
    "qwen2.5-0.5b": (8192, 896, 151936),
    "llama3-8b-32k": (32768, 4096, 128256),
}
GiB = 2.0**30


# ----------------------------------------------------------------------------- inputs and references
def make_inputs(n, h, v, *, dtype, realistic=True, ignore_frac=0.1, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, h, device="cuda", generator=gen, dtype=torch.float32)
    std = 4.0 if realistic else 0.05
    w = torch.randn(v, h, device="cuda", generator=gen, dtype=torch.float32) * (std / math.sqrt(h))
    x, w = x.to(dtype), w.to(dtype)
    labels = torch.empty(n, dtype=torch.long, device="cuda")
    for s in range(0, n, 1024):  # labels ~ softmax(logits), chunked to stay small
        logits = (x[s : s + 1024].float() @ w.float().T)
        labels[s : s + 1024] = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(1)
    labels[torch.rand(n, device="cuda", generator=gen) < ignore_frac] = -100
    return x, w, labels


def float64_reference(x, w, labels, chunk=1024):
    """Mean cross-entropy and its dX, dW in float64, chunked so the N x V float64 logits never exist."""
    x64, w64 = x.double(), w.double()
    valid = labels != -100
    n_valid = max(int(valid.sum()), 1)
    loss = torch.zeros((), dtype=torch.float64, device=x.device)
    dx = torch.zeros_like(x64)
    dw = torch.zeros_like(w64)
    for s in range(0, x.shape[0], chunk):
        z = x64[s : s + chunk] @ w64.T
        y = labels[s : s + chunk]
        m = valid[s : s + chunk]
        lse = torch.logsumexp(z, -1)
        yz = z.gather(1, y.clamp(min=0)[:, None]).squeeze(1)
        loss += ((lse - yz) * m).sum()
        g = torch.softmax(z, -1)
        g[torch.arange(len(y), device=z.device), y.clamp(min=0)] -= 1
        g *= (m.double() / n_valid)[:, None]
        dx[s : s + chunk] = g @ w64
        dw += g.T @ x64[s : s + chunk]
        del z, g
    return loss / n_valid, dx, dw


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


# ----------------------------------------------------------------------------- implementations
def impl_fused(**options):
    def run(x, w, y, scaling):
        return FusedLMLoss(**options)(x, w, y, scaling=scaling)

    return run


def impl_fused_one_stream(x, w, y, scaling):
    """Default options with G @ W and G.T @ h on the same stream (A/B of chunked.OVERLAP_GRAD_MATMULS)."""
    from fused_lm_loss import chunked

    chunked.OVERLAP_GRAD_MATMULS = False
    try:
        return FusedLMLoss()(x, w, y, scaling=scaling)
    finally:
        chunked.OVERLAP_GRAD_MATMULS = True


def impl_eager(x, w, y, scaling):
    return F.cross_entropy((x @ w.T).float(), y, ignore_index=-100)


def impl_torch_chunked(x, w, y, scaling):
    return F.linear_cross_entropy(x, w, y, ignore_index=-100, options=torch.nn.LinearCrossEntropyOptions())


def load_peers():
    peers = {}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
        peers["liger"] = lambda x, w, y, scaling: liger(w, x, y)
    except Exception as e:  # noqa: BLE001 - any import failure means "not installed here"
        print(f"liger unavailable: {e!r}")
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        peers["cce"] = lambda x, w, y, scaling: cce(x, w, y, ignore_index=-100)
    except Exception as e:  # noqa: BLE001
        print(f"cce unavailable: {e!r}")
    return peers


def implementations(include_variants=True):
    impls = {"fused": impl_fused()}
    if include_variants:
        impls["fused_bf16acc"] = impl_fused(accum_dtype=None)
        impls["fused_fp32logits"] = impl_fused(logits_dtype=torch.float32)
        impls["fused_1stream"] = impl_fused_one_stream
    impls["eager"] = impl_eager
    if hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions"):
        impls["torch_chunked"] = impl_torch_chunked
    impls.update(load_peers())
    return impls


# ----------------------------------------------------------------------------- timing
_flush = None


def flush_l2():
    global _flush
    if _flush is None:
        _flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    _flush.zero_()


def time_cuda(fn, *, budget_ms=1500.0, min_runs=5, max_runs=40, warmup=2):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    t_start = time.perf_counter()
    while len(times) < max_runs:
        flush_l2()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        if len(times) >= min_runs and (time.perf_counter() - t_start) * 1e3 > budget_ms:
            break
    return statistics.median(times), times


def floor_fn(x, w, mode):
    """The matmuls a fused loss cannot avoid, on the full batch, in the input dtype."""
    g = torch.randn(x.shape[0], w.shape[0], device="cuda", dtype=x.dtype)

    def run():
        torch.mm(x, w.T)
        if mode != "forward":
            torch.mm(g, w)
        if mode == "train":
            torch.mm(g.T, x)

    return run, g


def step_fn(impl, x, w, y, mode, scaling):
    """One loss evaluation (+ backward unless forward-only), gradients reset like an optimizer step."""
    def run():
        x.grad = None
        w.grad = None
        ctx = torch.no_grad() if mode == "forward" else nullcontext()
        with ctx:
            loss = impl(x, w, y, scaling)
        if mode != "forward":
            (loss * scaling).backward()
        return loss

    return run


def measure(impl, x, w, y, mode, scaling=1.0, budget_ms=1500.0):
    """(median ms, extra peak GiB beyond inputs + gradients)."""
    x.requires_grad_(mode == "train" or mode == "frozen_head")
    w.requires_grad_(mode == "train")
    fn = step_fn(impl, x, w, y, mode, scaling)
    fn()  # compile / autotune outside the measurements
    torch.cuda.synchronize()
    x.grad = w.grad = None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    grads = sum(t.grad.numel() * t.grad.element_size() for t in (x, w) if t.grad is not None)
    extra = (torch.cuda.max_memory_allocated() - base - grads) / GiB
    ms, _ = time_cuda(fn, budget_ms=budget_ms)
    return ms, extra


def accuracy(impl, x, w, y, ref, scaling=1.0):
    x.requires_grad_(True)
    w.requires_grad_(True)
    x.grad = w.grad = None
    loss = impl(x, w, y, scaling)
    (loss * scaling).backward()
    ref_loss, ref_dx, ref_dw = ref
    out = (rel_err(loss.detach(), ref_loss), rel_err(x.grad / scaling, ref_dx), rel_err(w.grad / scaling, ref_dw))
    x.grad = w.grad = None
    return out


# ----------------------------------------------------------------------------- the run
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--quick", action="store_true", help="Llama-3-8B shape, main scenario only")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--sweep", action="store_true", help="also sweep chunk sizes and kernel launch shapes")
    parser.add_argument("--main-only", action="store_true", help="only the main scenario (realistic, 10%% ignored, train)")
    parser.add_argument("--peers-main-only", action="store_true", help="time eager and the peers in the main scenario only")
    parser.add_argument("--budget-ms", type=float, default=1500.0, help="timing budget per measurement")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    props = torch.cuda.get_device_properties(0)
    env = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": props.name,
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
    }
    print(json.dumps(env))
    impls = implementations()
    for name in list(impls):
        if name in ("liger", "cce"):
            mod = __import__({"liger": "liger_kernel", "cce": "cut_cross_entropy"}[name])
            env[name] = getattr(mod, "__version__", "installed")
    shapes = ["llama3-8b"] if args.quick else args.shapes.split(",")
    rows = []

    def record(**row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)

    for shape in shapes:
        n, h, v = SHAPES[shape]
        torch.cuda.empty_cache()
        scenarios = [("realistic", 0.1, "train", torch.bfloat16)]
        if not (args.quick or args.main_only) and not shape.endswith("32k"):
            scenarios += [
                ("realistic", 0.5, "train", torch.bfloat16),
                ("uniform", 0.1, "train", torch.bfloat16),
                ("realistic", 0.1, "forward", torch.bfloat16),
                ("realistic", 0.1, "frozen_head", torch.bfloat16),
                ("realistic", 0.1, "train", torch.float16),
            ]
        for data, ignore, mode, dtype in scenarios:
            x, w, y = make_inputs(n, h, v, dtype=dtype, realistic=data == "realistic", ignore_frac=ignore)
            scaling = 2.0**14 if dtype == torch.float16 else 1.0
            key = dict(shape=shape, n=n, h=h, v=v, data=data, ignore=ignore, mode=mode, dtype=str(dtype)[6:])
            fmode = {"train": "train", "forward": "forward", "frozen_head": "frozen"}[mode]
            run, g = floor_fn(x, w, fmode)
            floor_ms, _ = time_cuda(run, budget_ms=args.budget_ms)
            del g
            torch.cuda.empty_cache()
            record(**key, impl="floor", ms=floor_ms, ratio=1.0)
            main_case = data == "realistic" and ignore == 0.1 and mode == "train" and dtype == torch.bfloat16
            ref = float64_reference(x, w, y) if main_case and not shape.endswith("32k") else None
            if dtype == torch.float16 and not args.quick:
                ref = float64_reference(x, w, y)
            for name, impl in impls.items():
                if not main_case and name == "fused_1stream":
                    continue
                if not main_case and name in ("fused_bf16acc", "fused_fp32logits") and dtype != torch.float16:
                    if not (name == "fused_bf16acc" and mode == "train"):
                        continue
                if not main_case and args.peers_main_only and not name.startswith("fused"):
                    continue
                row = dict(key, impl=name)
                try:
                    ms, extra = measure(impl, x, w, y, mode, scaling, budget_ms=args.budget_ms)
                    row.update(ms=ms, ratio=ms / floor_ms, extra_gib=extra)
                    if ref is not None:
                        row.update(zip(("err_loss", "err_dx", "err_dw"), accuracy(impl, x, w, y, ref, scaling)))
                except Exception as e:  # noqa: BLE001 - a peer failing (OOM, unsupported) is a result too
                    row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
                x.grad = w.grad = None
                torch.cuda.empty_cache()
                record(**row)
            del x, w, y, ref
        if args.sweep and shape != "llama3-8b-32k":
            sweep(shape, record)
    write_table(rows, env, args.out)


def sweep(shape, record):
    """Chunk sizes, accumulator dtypes, fp32 logits, and the two-stream overlap; main scenario only."""
    from fused_lm_loss import chunked

    n, h, v = SHAPES[shape]
    x, w, y = make_inputs(n, h, v, dtype=torch.bfloat16)
    run, g = floor_fn(x, w, "train")
    floor_ms, _ = time_cuda(run)
    del g
    key = dict(shape=shape, n=n, h=h, v=v, data="realistic", ignore=0.1, mode="train", dtype="bfloat16", sweep=True)

    def point(label, **options):
        ms, extra = measure(impl_fused(**options), x, w, y, "train", budget_ms=800)
        record(**key, impl=label, ms=ms, ratio=ms / floor_ms, extra_gib=extra)

    for accum in (torch.float32, None):
        for chunk in (None, 512, 2048, 4096):
            point(f"fused chunk={chunk} accum={accum}", chunk_size=chunk, accum_dtype=accum)
    for chunk in (1024, 2048):
        point(f"fused_fp32logits chunk={chunk}", chunk_size=chunk, logits_dtype=torch.float32)
    chunked.OVERLAP_GRAD_MATMULS = False
    point("fused no-overlap")
    chunked.OVERLAP_GRAD_MATMULS = True


def write_table(rows, env, out):
    lines = [
        f"{env['date']} · {env['gpu']} · torch {env['torch']} · triton {env['triton']} · CUDA {env['cuda']}"
        + "".join(f" · {k} {env[k]}" for k in ("liger", "cce") if k in env),
        "",
        "| shape | data | ignored | mode | dtype | impl | ms | × floor | extra GiB | err loss | err dX | err dW |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda r, k, f: (f.format(r[k]) if k in r else "")  # noqa: E731
    for r in rows:
        if "error" in r:
            cells = [r["shape"], r["data"], f"{r['ignore']:.0%}", r["mode"], r["dtype"], r["impl"], r["error"][:60]]
            lines.append("| " + " | ".join(cells) + " |" * 6)
            continue
        cells = [r["shape"], r["data"], f"{r['ignore']:.0%}", r["mode"], r["dtype"], r["impl"], fmt(r, "ms", "{:.2f}"),
                 fmt(r, "ratio", "{:.2f}×"), fmt(r, "extra_gib", "{:.3f}"), fmt(r, "err_loss", "{:.1e}"),
                 fmt(r, "err_dx", "{:.1e}"), fmt(r, "err_dw", "{:.1e}")]
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    plot(rows, out)


def plot(rows, out):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    main = [r for r in rows if r.get("mode") == "train" and r.get("data") == "realistic" and r.get("ignore") == 0.1
            and r.get("dtype") == "bfloat16" and "ratio" in r and not r.get("sweep") and r["impl"] != "fused_1stream"]
    shapes = list(dict.fromkeys(r["shape"] for r in main))
    impls = list(dict.fromkeys(r["impl"] for r in main))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / max(len(impls), 1)
    for i, impl in enumerate(impls):
        vals = [next((r["ratio"] for r in main if r["shape"] == s and r["impl"] == impl), 0) for s in shapes]
        ax.bar([j + i * width for j in range(len(shapes))], vals, width, label=impl)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes)
    ax.set_ylabel("forward+backward time / matmul floor")
    ax.set_title("LM loss, bf16, realistic logits, 10% ignored (lower is better)")
    ax.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "speed.png"), dpi=110)


if __name__ == "__main__":
    main()
