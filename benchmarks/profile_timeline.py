"""Where one fused training step's GPU time goes: kernels, busy vs idle time, from torch.profiler.

    python benchmarks/profile_timeline.py [--shapes qwen2.5-0.5b,gemma2-2b] [--scenarios train,train50,frozen]
                                          [--kernels] [--trace DIR]
    python benchmarks/profile_timeline.py --shapes tiny        # CPU dry run: the host ops of each step only
    python benchmarks/profile_timeline.py --divergence reverse_kl --shapes qwen2.5-0.5b --scenarios train,frozen

For each shape and scenario (train: lm_head and hidden states get gradients, 10% of labels ignored;
train50: 50% ignored; frozen: the lm_head frozen, 10% ignored) one FusedLMLoss() forward+backward is
timed (do_bench median, × the floor of its full-batch matmuls), then profiled: three steps, each after an
L2 flush and between two spin kernels that mark where it starts and ends, and the last one is read.
It prints
  - the profiled step's length, the GPU's busy time (the union of kernel, copy and fill intervals: two
    streams may overlap) and idle time, when the first matmul starts, and the kernel count;
  - kernel time by kind (matmuls, each Triton kernel, other) and the idle time by the kernel it waited for;
  - the six longest gaps; the copies and fills;
  - the host: when the first matmul was called after the step began, when the end marker was launched,
    the host ops up to the first matmul and the last 40 host events (what the GPU waited for);
  - with --kernels: the profiler's table of the step's kernels (top 12 by GPU time).
--divergence KIND profiles ``fused_divergence(kind=KIND)`` (mean over the kept rows) instead, the student the
shape's inputs and the teacher the same hidden states with a perturbed weight; its floor adds the teacher's
logits matmul. --trace DIR writes each profile's Chrome trace there. CUPTI adds a little host time per launch: read the
idle times as an upper bound.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile

import torch

from common import DEVICE, SHAPES, bench, default_shapes, inputs, labels, sync
from fused_lm_loss import FusedLMLoss, fused_divergence

GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # copies count as busy too (a clone is a memcpy)
SCENARIOS = {"train": (0.1, True), "train50": (0.5, True), "frozen": (0.1, False)}  # ignored, lm_head trained


def is_gemm(name: str) -> bool:
    return "nvjet" in name or "gemm" in name.lower() or "xmma" in name or "cutlass" in name


def busy_and_gaps(kernels: list[dict], begin: float, end: float):
    """(busy us, gaps) of GPU intervals sorted by start, within [begin, end]: busy is their union; each gap is
    (us, the kernel before it, the kernel after it, its start relative to begin)."""
    busy, gaps, cursor, prev = 0.0, [], begin, "step start"
    for k in kernels:
        k_end = k["ts"] + k["dur"]
        if k["ts"] > cursor:
            gaps.append((k["ts"] - cursor, prev, k["name"], cursor - begin))
        busy += max(0.0, k_end - max(k["ts"], cursor))
        if k_end > cursor:
            cursor, prev = k_end, k["name"]
    if end > cursor:
        gaps.append((end - cursor, prev, "step end", cursor - begin))
    return busy, gaps


def host_ops(events: list[dict]) -> list[dict]:
    return sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")),
                  key=lambda e: e["ts"])


def print_host(events: list[dict], host0: float, until: float, tail_from: list[dict]) -> None:
    """The host's top-level ops from host0 to ``until``, then the last 40 of ``tail_from``, indented by nesting."""
    head = [e for e in host_ops(events) if host0 < e["ts"] <= until]
    for part in (head[:70], tail_from[-40:]):
        stack = []
        for e in part:
            while stack and e["ts"] >= stack[-1]:
                stack.pop()
            print(f"    {1e-3 * (e['ts'] - host0):7.3f} ms {e['dur']:6.0f} us {'  ' * len(stack)}{e['name'][:60]}")
            stack.append(e["ts"] + e["dur"])
        print("    ...")


def floors(x, w):
    """Full-batch cuBLAS floors (ms): train = x @ W.T + G @ W + G.T @ x, frozen = the first two, logits = the
    first."""
    full = torch.empty(x.shape[0], w.shape[0], device=DEVICE, dtype=x.dtype)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    logits = bench(lambda: torch.mm(x, w.t(), out=full))
    frozen = logits + bench(lambda: torch.mm(full, w, out=dx))
    return {"train": frozen + bench(lambda: torch.mm(full.t(), x, out=dw)), "frozen": frozen, "logits": logits}


def _divergence(hidden, weight, labels, *, teacher_weight, kind):
    return fused_divergence(hidden, weight, hidden.detach(), teacher_weight, labels, kind=kind)


def profile_scenario(name, scenario, x, w, floor, args):
    ignore, train_head = SCENARIOS[scenario]
    y = labels(name, ignore)
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_(train_head)
    loss_fn = FusedLMLoss()
    if args.divergence:
        teacher_w = w + 0.3 * w.float().std() * torch.randn_like(w)
        loss_fn = functools.partial(_divergence, teacher_weight=teacher_w, kind=args.divergence)

    def step():
        xr.grad = wr.grad = None
        loss_fn(xr, wr, y).backward()

    t = bench(step)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if DEVICE == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        flush = torch.empty(256 * 2**20, dtype=torch.int8, device=DEVICE)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):  # the last step is read
            if DEVICE == "cuda":
                flush.zero_()
                torch.cuda._sleep(10)  # spin_kernel: the step starts when it ends
            with torch.profiler.record_function("timed step"):
                step()
            if DEVICE == "cuda":
                torch.cuda._sleep(10)  # ... and ends when the next one starts
            sync()
    path = os.path.join(args.trace or tempfile.mkdtemp(), f"trace_{name}_{scenario}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    label = f"{name} {scenario}"
    if DEVICE != "cuda":  # dry run: the host side only
        ops = host_ops(events)
        host0 = [e for e in ops if e["name"] == "timed step"][-1]["ts"]
        print(f"\n{label}: {t:.2f} ms on CPU ({t / floor:.3f}× floor); the first host ops of the last step:")
        step_ops = [e for e in ops if e["ts"] > host0][:20]
        print_host(events, host0, step_ops[-1]["ts"] if step_ops else host0, [])
        return
    report(label, t, floor, events)
    if args.kernels:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=90))


def report(label: str, t: float, floor: float, events: list[dict]) -> None:
    """The printout for one profiled step (the last one between two spin kernels) of a Chrome trace."""
    ops = host_ops(events)
    host0 = [e for e in ops if e["name"] == "timed step"][-1]["ts"]
    work = sorted((e for e in events if e.get("cat") in GPU_WORK), key=lambda e: e["ts"])
    spins = [i for i, k in enumerate(work) if "spin_kernel" in k["name"]]
    first, last = spins[-2], spins[-1]
    begin, end = work[first]["ts"] + work[first]["dur"], work[last]["ts"]
    step_kernels = work[first + 1 : last]
    busy, gaps = busy_and_gaps(step_kernels, begin, end)
    first_gemm = next((k["ts"] - begin for k in step_kernels if is_gemm(k["name"])), float("nan"))
    print(f"\n{label}: bench {t:.2f} ms = {t / floor:.3f}× floor ({floor:.2f} ms); profiled step "
          f"{(end - begin) / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms = {busy / 1e3 / floor:.3f}× floor, idle "
          f"{sum(g[0] for g in gaps) / 1e3:.2f} ms in {len(gaps)} gaps; first matmul at {first_gemm / 1e3:.3f} ms; "
          f"{len(step_kernels)} kernels")
    by_kind = {}
    for k in step_kernels:
        kind = "matmul" if is_gemm(k["name"]) else k["name"] if k["name"].startswith("_") else "other"
        by_kind[kind] = by_kind.get(kind, 0.0) + k["dur"]
    print("  kernel time: " + "; ".join(f"{k} {v / 1e3:.3f} ms ({v / 1e3 / floor:.3f}×)"
                                        for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])))
    by_next = {}
    for g in gaps:
        by_next[g[2][:50]] = by_next.get(g[2][:50], 0.0) + g[0]
    print("  idle before: " + "; ".join(f"{k} {v:.0f} us" for k, v in sorted(by_next.items(), key=lambda kv: -kv[1])[:8]))
    for g in sorted(gaps, key=lambda g: -g[0])[:6]:
        print(f"  gap {g[0]:.0f} us at {g[3] / 1e3:.3f} ms: {g[1][:45]} -> {g[2][:45]}")
    copies = [k for k in step_kernels if k.get("cat") != "kernel"]
    print("  copies and fills: " + "; ".join(f"{k['name'][:30]} {k['dur']:.0f} us at {(k['ts'] - begin) / 1e3:.3f} ms"
                                           for k in copies[:8]))
    runtime = [e for e in events if e.get("cat") == "cuda_runtime" and e.get("ph") == "X"]
    end_launch = next(e for e in runtime if e.get("args", {}).get("correlation") == work[last]["args"]["correlation"])
    mm = [e for e in ops if e["ts"] > host0 and e["name"] in ("aten::mm", "aten::addmm")]
    first_mm = mm[0]["ts"] if mm else host0
    print(f"  host: first matmul called {1e-3 * (first_mm - host0):.3f} ms after the step began, end marker launched "
          f"at {1e-3 * (end_launch['ts'] - host0):.3f} ms; ops until the first matmul, then the last 40 host events:")
    tail = [e for e in sorted(ops + runtime, key=lambda e: e["ts"]) if host0 < e["ts"] <= end_launch["ts"]]
    print_host(events, host0, first_mm, tail)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=None, help=f"of {','.join(SHAPES)} (default: all but tiny; CPU: tiny)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"of {','.join(SCENARIOS)}")
    parser.add_argument("--kernels", action="store_true", help="also the profiler's kernel table of each step")
    parser.add_argument("--trace", default=None, help="folder for the Chrome traces (default: a temporary one)")
    parser.add_argument("--divergence", default=None, choices=("forward_kl", "reverse_kl", "jsd"),
                        help="profile fused_divergence of this kind instead of the loss")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    for name in default_shapes(args.shapes):
        x, w, _ = inputs(name)
        floor = floors(x, w)
        if args.divergence:  # + the teacher's logits matmul
            floor = {kind: value + floor["logits"] for kind, value in floor.items()}
        for scenario in args.scenarios.split(","):
            profile_scenario(name, scenario, x, w, floor["train" if SCENARIOS[scenario][1] else "frozen"], args)
        x = w = None
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
