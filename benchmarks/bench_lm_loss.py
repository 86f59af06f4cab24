"""Speed, peak memory and accuracy of LM-loss implementations on one GPU, in one run.

    python benchmarks/bench_lm_loss.py --out results/            # everything (H200: ~5 min)
    python benchmarks/bench_lm_loss.py --quick                     # Llama-3-8B shape only
    python benchmarks/bench_lm_loss.py --cpu                       # dry run on CPU: a tiny shape, every row once

For each shape (N tokens, H hidden, V vocab; bf16) and scenario it times forward+backward (median of
CUDA-event timings after warm-up, L2 flushed before each run) and measures the peak memory beyond
the inputs and the gradient tensors, for:
  floor        the bf16 cuBLAS matmuls alone on the full batch: x @ W.T, G @ W, G.T @ x
               (forward-only: the first; frozen head: the first two)
  fused        fused_lm_loss (default options: bf16 logits, fp32 dW accumulator)
  fused_bf16acc, fused_fp32logits   the accum_dtype=None and logits_dtype=float32 variants
  fused_cublas fused with the Hopper path switched off (only where it serves: an sm90 GPU with the [hopper]
               extra), so that both chunks are timed in one call
  fused_compiled torch.compile(fullgraph=True) of a step calling FusedLMLoss() (main scenario only; the compile
               is warmed up outside the timing). Its backward always multiplies the saved gradients by
               grad_output / scaling (an operator may not return its inputs), where eager, for a factor
               of exactly 1, returns them as they are (only rounding those kept wide): this row is what that
               costs
  eager        F.cross_entropy((x @ W.T).float(), y)
  torch_chunked  F.linear_cross_entropy(..., options=LinearCrossEntropyOptions()) where torch has it
  liger        LigerFusedLinearCrossEntropyLoss, when importable
  cce          cut_cross_entropy.linear_cross_entropy, when importable
  trl_head     TRL's fused LM head kernel (trl.kernels.chunked_logprob.ChunkedLogProbFunction), called as
               add_fused_lm_head does for SFT (on CUDA only the non-ignored rows, log-probs only; loss =
               -sum(log_probs) / count), when importable (benchmarks/peers.py)
  token_sft    fused_lm_loss.token_stats(expected_grads="uniform"), loss = -sum(logprobs) / count: the
               per-token path with uniform per-token gradients (what SFTTrainer's head becomes when patched)
  token_rl, trl_rl   sum(a * logprobs) with fixed random per-token weights a (RL advantages), through
               token_stats and through TRL's head; in the frozen-head scenario the per-row gradients are
               formed in forward (token_stats) where TRL's head recomputes
  token_rl_kept  token_rl with keep_logits=True: the logits kept from forward for backward (trainable head
               only: three matmuls instead of four, N x V bf16 more memory)
  token_dpo, trl_dpo, token_dpo_kept   DPO's head call: sum(a * logprobs) with one fixed random weight per 512-token sequence
               (what DPO's sigmoid loss sends back), with the outputs DPOTrainer asks for (entropy, is_top1,
               mean_logits), through token_stats (_kept: keep_logits=True) and through TRL's head
Accuracy: relative error (L2 norm) of loss, dX and dW against a float64 computation of the same inputs.
Data: logits std ~4 with labels sampled from the model's own softmax ("realistic"), or near-uniform
logits; a fraction of labels set to -100.
--cpu: the same code on CPU tensors at a tiny shape (perf_counter timing, no memory numbers), to check that
every row runs before spending GPU time; the fused rows then use the library's default CPU backend.
"""
from __future__ import annotations

import argparse
import functools
import inspect
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

# FUSED_LM_LOSS_ROOT: time the library of another checkout (an A/B against an earlier commit, in one call)
sys.path.insert(0, os.environ.get("FUSED_LM_LOSS_ROOT") or os.path.join(os.path.dirname(__file__), ".."))
import peers  # noqa: E402  (benchmarks/peers.py)
import fused_lm_loss  # noqa: E402
from fused_lm_loss import FusedLMLoss  # noqa: E402

token_stats = getattr(fused_lm_loss, "token_stats", None)  # (not in checkouts before session 9)

SHAPES = {
    "llama3-8b": (8192, 4096, 128256),
    "qwen2.5-7b": (8192, 3584, 152064),
    "gemma2-2b": (8192, 2304, 256000),
    "qwen2.5-0.5b": (8192, 896, 151936),
    "llama3-8b-32k": (32768, 4096, 128256),
    "tiny": (512, 64, 1000),  # --cpu
}
GPU_SHAPES = "llama3-8b,llama3-8b-32k,qwen2.5-7b,gemma2-2b,qwen2.5-0.5b"
GiB = 2.0**30
DEVICE = "cuda"  # --cpu: "cpu"


# ----------------------------------------------------------------------------- inputs and references
def make_inputs(n, h, v, *, dtype, realistic=True, ignore_frac=0.1, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(n, h, device=DEVICE, generator=gen, dtype=torch.float32)
    std = 4.0 if realistic else 0.05
    w = torch.randn(v, h, device=DEVICE, generator=gen, dtype=torch.float32) * (std / math.sqrt(h))
    x, w = x.to(dtype), w.to(dtype)
    labels = torch.empty(n, dtype=torch.long, device=DEVICE)
    for s in range(0, n, 1024):  # labels ~ softmax(logits), chunked to stay small
        logits = (x[s : s + 1024].float() @ w.float().T)
        labels[s : s + 1024] = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(1)
    labels[torch.rand(n, device=DEVICE, generator=gen) < ignore_frac] = -100
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


def impl_fused_without_hopper_path():
    """``fused`` with the Hopper path (exp_epilogue.py) switched off for the call: cuBLAS + ``row_stats``, the
    chunk every other GPU takes, timed beside it in the same call."""
    import fused_lm_loss.kernels as kernels

    def run(x, w, y, scaling):
        served = kernels.supports_exp_epilogue
        kernels.supports_exp_epilogue = lambda hidden, weight: False  # gradients are made in forward
        try:
            return FusedLMLoss()(x, w, y, scaling=scaling)
        finally:
            kernels.supports_exp_epilogue = served

    return run


def hopper_path_serves() -> bool:
    """Whether the library takes the Hopper path on this GPU for a bf16 training step (the [hopper] extra)."""
    supported = getattr(getattr(fused_lm_loss, "exp_epilogue", None), "supported", None)  # (not before session 14)
    if DEVICE != "cuda" or supported is None:
        return False
    hidden = torch.zeros(8, 64, dtype=torch.bfloat16, device=DEVICE)
    return supported(hidden, torch.zeros(384, 64, dtype=torch.bfloat16, device=DEVICE))


def impl_fused_compiled():
    """torch.compile(fullgraph=True) of ``step(x, w, y) = FusedLMLoss()(x, w, y)``, one compiled step per
    gradient scale (a constant of the graph); dynamo recompiles per shape and grad mode, outside the timing
    (``measure`` calls the step once first)."""
    loss_fn = FusedLMLoss()
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):  # 5 shapes x 2 dtypes must not fall back to eager
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))

    @functools.lru_cache(maxsize=None)
    def compiled(scaling):
        def step(x, w, y):
            return loss_fn(x, w, y, scaling=scaling)

        return torch.compile(step, fullgraph=True, dynamic=False)

    return lambda x, w, y, scaling: compiled(scaling)(x, w, y)


def impl_eager(x, w, y, scaling):
    return F.cross_entropy((x @ w.T).float(), y, ignore_index=-100)


def impl_torch_chunked(x, w, y, scaling):
    return F.linear_cross_entropy(x, w, y, ignore_index=-100, options=torch.nn.LinearCrossEntropyOptions())


def peer_liger():
    loss = peers.liger_loss()
    return lambda x, w, y, scaling: loss(w, x, y)


def peer_cce():
    cce = peers.cce_loss()
    return lambda x, w, y, scaling: cce(x, w, y, ignore_index=-100)


def peer_trl_head():
    module = peers.trl_kernel()
    return lambda x, w, y, scaling: peers.trl_sft_loss(module, x, w, y)


def peer_quack(scaled_exp: bool):
    """Quack's chunked pipeline (cuBLAS-like CuTe GEMMs + a row kernel) or its scaled-exp pipeline (statistics
    and E = exp(z - k) from the logits GEMM's epilogue, per-(row, tile) factors in the gradient GEMMs' operand
    loads; sm90, bf16 only), chunks of 4096 rows (its default)."""
    def load():
        loss = peers.quack_loss()
        return lambda x, w, y, scaling: loss(x, w, y, ignore_index=-100, use_scaled_exp=scaled_exp)

    return load


#: peer name -> (its distribution, a loader returning impl(x, w, y, scaling)); each optional
PEERS = {"liger": ("liger-kernel", peer_liger), "cce": ("cut-cross-entropy", peer_cce), "trl_head": ("trl", peer_trl_head),
         "quack_chunked": ("quack-kernels", peer_quack(False)), "quack_scaled_exp": ("quack-kernels", peer_quack(True))}


def load_peers(env):
    """The importable peers; their versions into ``env``."""
    found = {}
    for name, (dist, load) in PEERS.items():
        try:
            found[name] = load()
            env[name] = peers.version(dist)
        except Exception as e:  # noqa: BLE001 - any import failure means "not installed here"
            print(f"{name} unavailable: {type(e).__name__}: {str(e)[:300]}")
    if "trl_head" in found:
        env["trl_import"] = peers.trl_how()
    if any(name.startswith("quack") for name in found):
        env["cutlass_dsl"] = peers.version("nvidia-cutlass-dsl")
    return found


def impl_token_sft(x, w, y, scaling):
    out = token_stats(x, w, y, expected_grads="uniform")
    return -out.logprobs.sum() / (y != -100).sum().clamp(min=1)


_token_weights: dict = {}


def rl_weights(y: torch.Tensor) -> torch.Tensor:
    """Fixed per-token weights for the RL rows (advantage-like: positive and negative, mean ~0), one set per
    label tensor."""
    key = (y.data_ptr(), y.shape)
    if key not in _token_weights:
        gen = torch.Generator(device=y.device).manual_seed(1)
        _token_weights.clear()
        _token_weights[key] = torch.randn(y.shape, device=y.device, generator=gen) / max(y.numel(), 1)
    return _token_weights[key]


def impl_token_rl(x, w, y, scaling):
    return (token_stats(x, w, y).logprobs * rl_weights(y)).sum()


def impl_token_rl_kept(x, w, y, scaling):
    return (token_stats(x, w, y, keep_logits=True).logprobs * rl_weights(y)).sum()


def peer_trl_rl():
    module = peers.trl_kernel()
    return lambda x, w, y, scaling: peers.trl_weighted_logprobs(module, x, w, y, rl_weights(y))


DPO_SEQUENCE = 512


def dpo_weights(y: torch.Tensor) -> torch.Tensor:
    """Fixed weights for the DPO rows: one per DPO_SEQUENCE-token sequence (DPO weights each sequence's summed
    log-probability), positive and negative."""
    key = ("dpo", y.data_ptr(), y.shape)
    if key not in _token_weights:
        gen = torch.Generator(device=y.device).manual_seed(2)
        n = y.numel()
        per_sequence = torch.randn(-(-n // DPO_SEQUENCE), device=y.device, generator=gen) / max(n, 1)
        _token_weights[key] = per_sequence.repeat_interleave(DPO_SEQUENCE)[:n].view(y.shape)
    return _token_weights[key]


def impl_token_dpo(x, w, y, scaling, keep_logits=False):
    out = token_stats(x, w, y, extra_outputs=("mean_logits",), keep_logits=keep_logits)
    return (out.logprobs * dpo_weights(y)).sum()


def impl_token_dpo_kept(x, w, y, scaling):
    return impl_token_dpo(x, w, y, scaling, keep_logits=True)


def peer_trl_dpo():
    module = peers.trl_kernel()
    outputs = ("log_probs", "entropy", "mean_logits", "is_top1")
    return lambda x, w, y, scaling: peers.trl_weighted_logprobs(module, x, w, y, dpo_weights(y), outputs=outputs)


#: rows whose objective is a weighted sum of log-probabilities (no forward-only mode, no cross-entropy reference)
WEIGHTED_ROWS = ("token_rl", "trl_rl", "token_rl_kept", "token_dpo", "token_dpo_kept", "trl_dpo")


def implementations(env, include_variants=True):
    impls = {"fused": impl_fused()}
    if include_variants:
        impls["fused_bf16acc"] = impl_fused(accum_dtype=None)
        impls["fused_fp32logits"] = impl_fused(logits_dtype=torch.float32)
    if hopper_path_serves():
        impls["fused_cublas"] = impl_fused_without_hopper_path()
    impls["fused_compiled"] = impl_fused_compiled()
    impls["eager"] = impl_eager
    if hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions"):
        impls["torch_chunked"] = impl_torch_chunked
    impls.update(load_peers(env))
    if token_stats is not None:
        impls["token_sft"] = impl_token_sft
        impls["token_rl"] = impl_token_rl
        if "keep_logits" in inspect.signature(token_stats).parameters:  # (not before session 11)
            impls["token_rl_kept"] = impl_token_rl_kept
        if "extra_outputs" in inspect.signature(token_stats).parameters:  # (not before session 12)
            impls["token_dpo"] = impl_token_dpo
            impls["token_dpo_kept"] = impl_token_dpo_kept
    if "trl_head" in impls:
        impls["trl_rl"] = peer_trl_rl()
        impls["trl_dpo"] = peer_trl_dpo()
    return impls


# ----------------------------------------------------------------------------- timing
_flush = None


def flush_l2():
    global _flush
    if DEVICE != "cuda":
        return
    if _flush is None:
        _flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    _flush.zero_()


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


HOST_LEAD_CYCLES = 0  # --host-lead-ms: GPU clock cycles of the spin that each timed run starts behind


def time_cuda(fn, *, budget_ms=1500.0, min_runs=5, max_runs=40, warmup=2):
    """(median ms, all ms) of ``fn`` by CUDA events, L2 flushed before each run; on CPU by perf_counter.

    With ``--host-lead-ms`` each run's clock starts after a GPU spin queued ahead of ``fn``, so that the host's
    work before ``fn``'s first kernel overlaps it, as it overlaps a model's own kernels in a training step."""
    if DEVICE != "cuda":
        min_runs, warmup = 1, 0
    for _ in range(warmup):
        fn()
    sync()
    times = []
    t_start = time.perf_counter()
    while len(times) < max_runs:
        flush_l2()
        if DEVICE == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if HOST_LEAD_CYCLES:
                torch.cuda._sleep(HOST_LEAD_CYCLES)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        if len(times) >= min_runs and (time.perf_counter() - t_start) * 1e3 > budget_ms:
            break
    return statistics.median(times), times


def spin_cycles(ms: float) -> int:
    """GPU clock cycles of ``torch.cuda._sleep`` that last about ``ms`` (calibrated on this GPU)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(10**6)  # (warm-up)
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    torch.cuda.synchronize()
    return int(10**7 * ms / start.elapsed_time(end))


def floor_fn(x, w, mode):
    """The matmuls a fused loss cannot avoid, on the full batch, in the input dtype."""
    g = torch.randn(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)

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
    """(median ms, extra peak GiB beyond inputs + gradients; None on CPU)."""
    x.requires_grad_(mode == "train" or mode == "frozen_head")
    w.requires_grad_(mode == "train")
    fn = step_fn(impl, x, w, y, mode, scaling)
    fn()  # compile / autotune outside the measurements
    sync()
    x.grad = w.grad = None
    if DEVICE != "cuda":  # no allocator statistics on CPU
        return time_cuda(fn, budget_ms=budget_ms)[0], None
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
    parser.add_argument("--shapes", default=None, help=f"comma-separated, of {','.join(SHAPES)} (default: "
                        f"{GPU_SHAPES}; --cpu: tiny)")
    parser.add_argument("--sweep", action="store_true", help="also sweep chunk sizes, accumulator dtypes, fp32 logits")
    parser.add_argument("--main-only", action="store_true", help="only the main scenario (realistic, 10%% ignored, train)")
    parser.add_argument("--peers-main-only", action="store_true", help="time eager and the peers in the main scenario only")
    parser.add_argument("--budget-ms", type=float, default=1500.0, help="timing budget per measurement")
    parser.add_argument("--cpu", action="store_true", help="dry run on CPU tensors (default shape: tiny)")
    parser.add_argument("--host-lead-ms", type=float, default=0.0, help="start each timed run behind a GPU spin "
                        "of this length, so that the host's work before the first kernel is hidden (a diagnostic: "
                        "how much of a row is the host's; every row and the floor alike)")
    parser.add_argument("--rows", default=None, help="comma-separated implementations to time (default: all)")
    parser.add_argument("--scenarios", default=None, help="comma-separated of main,50pct,uniform,forward,frozen,fp16 "
                        "(default: all; main only with --quick / --main-only)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = "cpu" if args.cpu else "cuda"
    os.makedirs(args.out, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    env = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_properties(0).name if DEVICE == "cuda" else f"CPU ({platform.machine()})",
        "torch": torch.__version__,
        "triton": peers.version("triton"),
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "library": os.path.abspath(os.path.dirname(fused_lm_loss.__file__)),
    }
    if args.host_lead_ms and DEVICE == "cuda":
        global HOST_LEAD_CYCLES
        HOST_LEAD_CYCLES = spin_cycles(args.host_lead_ms)
        env["host_lead_ms"] = args.host_lead_ms
    impls = implementations(env)
    if args.rows:
        impls = {name: impl for name, impl in impls.items() if name in args.rows.split(",")}
    print(json.dumps(env))
    shapes = (args.shapes or ("tiny" if args.cpu else GPU_SHAPES)).split(",")
    if args.quick:
        shapes = ["tiny" if args.cpu else "llama3-8b"]
    rows = []

    def record(**row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)

    for shape in shapes:
        n, h, v = SHAPES[shape]
        torch.cuda.empty_cache()
        named = {
            "main": ("realistic", 0.1, "train", torch.bfloat16),
            "50pct": ("realistic", 0.5, "train", torch.bfloat16),
            "uniform": ("uniform", 0.1, "train", torch.bfloat16),
            "forward": ("realistic", 0.1, "forward", torch.bfloat16),
            "frozen": ("realistic", 0.1, "frozen_head", torch.bfloat16),
            "fp16": ("realistic", 0.1, "train", torch.float16),
        }
        chosen = args.scenarios.split(",") if args.scenarios else list(named)
        if args.quick or args.main_only or shape.endswith("32k"):
            chosen = [c for c in chosen if c == "main"]
        scenarios = [named[c] for c in chosen]
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
                if not main_case and name == "fused_compiled":  # one compile per shape: main scenario only
                    continue
                if not main_case and name in ("fused_bf16acc", "fused_fp32logits") and dtype != torch.float16:
                    if not (name == "fused_bf16acc" and mode == "train"):
                        continue
                if not main_case and args.peers_main_only and not name.startswith("fused"):
                    if not (mode == "frozen_head" and name in ("token_rl", "trl_rl", "token_dpo", "trl_dpo")):
                        continue  # (the frozen-head targets)
                if name == "fused_cublas" and (mode == "forward" or dtype != torch.bfloat16):  # (= fused there)
                    continue
                if mode == "forward" and name in ("token_sft", *WEIGHTED_ROWS):
                    continue
                if mode == "frozen_head" and name in ("token_rl_kept", "token_dpo_kept"):  # (nothing is kept)
                    continue
                row = dict(key, impl=name)
                try:
                    ms, extra = measure(impl, x, w, y, mode, scaling, budget_ms=args.budget_ms)
                    row.update(ms=ms, ratio=ms / floor_ms, extra_gib=extra)
                    if ref is not None and name not in WEIGHTED_ROWS:  # (ref: the mean CE)
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
    """Chunk sizes, accumulator dtypes and fp32 logits (public options); main scenario only."""
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


def write_table(rows, env, out):
    lines = [
        f"{env['date']} · {env['gpu']} · torch {env['torch']} · triton {env['triton']} · CUDA {env['cuda']}"
        + "".join(f" · {k} {env[k]}" for k in ("liger", "cce", "trl_head", "quack_chunked", "cutlass_dsl", "host_lead_ms") if k in env),
        "",
        "| shape | data | ignored | mode | dtype | impl | ms | × floor | extra GiB | err loss | err dX | err dW |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda r, k, f: (f.format(r[k]) if r.get(k) is not None else "")  # noqa: E731
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
            and r.get("dtype") == "bfloat16" and "ratio" in r and not r.get("sweep")]
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
