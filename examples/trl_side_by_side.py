"""What the TRL examples (sft_trl.py, dpo_trl.py, distill_trl.py) share: a tiny word-level tokenizer, a step timer,
and running one training twice, unpatched and patched, each in a fresh process, then printing TRL's logged
metrics side by side."""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

VOCAB = 4096


def word_tokenizer():
    """A word-level tokenizer over "t0".."t4095", words split at spaces (for TRL's text datasets)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    fast = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    fast.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=fast, pad_token="t0", eos_token="t2", unk_token="t1")


def step_timer(cuda: bool):
    """A TrainerCallback timing each optimizer step (``.times``, seconds; synchronized on CUDA)."""
    import transformers

    class StepTimer(transformers.TrainerCallback):
        def __init__(self):
            self.times, self.start = [], None

        def on_step_begin(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.start)

    return StepTimer()


def run_logged(trainer, timer, metrics, cuda: bool) -> dict:
    """Train; TRL's logged ``metrics`` per step, the median step time, the peak memory (CUDA)."""
    import transformers

    trainer.remove_callback(transformers.PrinterCallback)  # the table printed at the end says what it would
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    logs = [{k: log[k] for k in metrics if k in log} for log in trainer.state.log_history if "loss" in log]
    return {"logs": logs, "seconds": statistics.median(timer.times[2:] or timer.times),
            "peak": torch.cuda.max_memory_allocated() if cuda else None}


def side_by_side(train: Callable, args, title: str, metrics, theirs_name: str = "TRL's own") -> None:
    """``train(args, patched)`` unpatched, then patched, each in a fresh process (clean memory statistics); print
    ``metrics`` per step as theirs / ours, the largest differences, and on CUDA time and memory."""
    results = {}
    for name, patched in ((theirs_name, False), ("fused_lm_loss", True)):
        with mp.get_context("spawn").Pool(1) as pool:
            results[name] = pool.apply(train, (args, patched))
    theirs, ours = results[theirs_name]["logs"], results["fused_lm_loss"]["logs"]
    names = [m for m in metrics if any(m in log for log in theirs)]
    print(f"\n{title}: {theirs_name} vs patched with fused_lm_loss (each cell: theirs / ours)")
    width = max(24, *(len(m) + 4 for m in names))
    print(f"{'step':>5s}" + "".join(f"{m:>{width}s}" for m in names))
    for step, (a, b) in enumerate(zip(theirs, ours), 1):  # (a step may not log every metric: KTO's */chosen)
        half = (width - 2) // 2
        print(f"{step:>5d}" + "".join(f"{a.get(m, math.nan):>{half}.5f} /{b.get(m, math.nan):>{half}.5f}"
                                      for m in names))
    worst = {m: max((abs(a[m] - b[m]) for a, b in zip(theirs, ours) if m in a and m in b), default=0.0)
             for m in names}
    print("largest difference: " + ", ".join(f"{m} {d:.1e}" for m, d in worst.items()))
    if args.device == "cuda":
        for name, r in results.items():
            print(f"{name:>16s}: median step {r['seconds'] * 1e3:.1f} ms, peak memory {r['peak'] / 2**30:.2f} GiB")
    else:
        print("(CPU: step time and memory are not shown; on a GPU the script prints both)")
