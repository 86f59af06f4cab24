"""TRL's DistillationTrainer with fused_lm_loss: the metrics TRL logs, beside the same run on TRL's own divergence.

    python examples/distill_trl.py               # beta 0.5 (generalized JSD), tiny random Llamas on CPU (~1 min)
    python examples/distill_trl.py --beta 0      # forward KL(teacher || student); --beta 1: reverse KL

The distillation trainer computes its loss with ``ChunkedDivergenceFunction`` (the teacher's and the student's
heads, tile by tile, the student's gradients recomputed in backward). With the student patched
(``fused_lm_loss.patch(student)``) it runs ``fused_lm_loss.fused_divergence`` instead: the teacher's matmul once,
the student's gradients made in forward. Two runs from the same seed, each in a fresh process; the logged metrics
per step side by side (and, on CUDA, the step time and peak memory of each).
"""
from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dpo_trl import VOCAB, StepTimer, word_tokenizer  # noqa: E402

METRICS = ("loss", "entropy", "completions/mean_length")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args()


def train(args: argparse.Namespace, patched: bool) -> dict:
    import datasets
    import transformers
    import trl

    import fused_lm_loss

    datasets.disable_progress_bars()
    torch.manual_seed(0)
    student_config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    teacher_config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    student, teacher = transformers.LlamaForCausalLM(student_config), transformers.LlamaForCausalLM(teacher_config)
    if patched:
        fused_lm_loss.patch(student)  # <- the one line: the trainer's divergence runs on fused_lm_loss
    generator = torch.Generator().manual_seed(1)
    rows = [{"prompt": " ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (8,), generator=generator))}
            for _ in range(args.batch_size * args.steps)]
    cuda = args.device == "cuda"
    config = trl.DistillationConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.batch_size, max_steps=args.steps,
        logging_steps=1, learning_rate=1e-3, report_to=[], save_strategy="no", seed=0, use_cpu=not cuda, bf16=cuda,
        beta=args.beta, max_completion_length=16, disable_tqdm=True, log_level="error",
    )
    timer = StepTimer(cuda)
    trainer = trl.DistillationTrainer(model=student, teacher_model=teacher, args=config,
                                      train_dataset=datasets.Dataset.from_list(rows),
                                      processing_class=word_tokenizer(), callbacks=[timer])
    trainer.remove_callback(transformers.PrinterCallback)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    logs = [{k: log[k] for k in METRICS if k in log} for log in trainer.state.log_history if "loss" in log]
    return {"logs": logs, "seconds": statistics.median(timer.times[2:] or timer.times),
            "peak": torch.cuda.max_memory_allocated() if cuda else None}


def main() -> None:
    args = parse_args()
    results = {}
    for name, patched in (("TRL's divergence", False), ("fused_lm_loss", True)):
        with mp.get_context("spawn").Pool(1) as pool:  # fresh processes: clean memory statistics
            results[name] = pool.apply(train, (args, patched))
    theirs, ours = results["TRL's divergence"]["logs"], results["fused_lm_loss"]["logs"]
    names = [m for m in METRICS if theirs and m in theirs[0]]
    print(f"\nDistillationTrainer (beta {args.beta}), {args.steps} steps of {args.batch_size} prompts on {args.device}: "
          "TRL's own divergence vs the student patched with fused_lm_loss")
    print(f"{'step':>5s}" + "".join(f"{m:>28s}" for m in names))
    for step, (a, b) in enumerate(zip(theirs, ours), 1):
        print(f"{step:>5d}" + "".join(f"{a.get(m, math.nan):>14.5f} /{b.get(m, math.nan):>12.5f}" for m in names))
    worst = {m: max(abs(a[m] - b[m]) for a, b in zip(theirs, ours) if m in a and m in b) for m in names}
    print("largest difference: " + ", ".join(f"{m} {d:.1e}" for m, d in worst.items()))
    if args.device == "cuda":
        for name, r in results.items():
            print(f"{name:>16s}: median step {r['seconds'] * 1e3:.1f} ms, peak memory {r['peak'] / 2**30:.2f} GiB")
    else:
        print("(CPU: step time and memory are not shown; on a GPU the script prints both)")


if __name__ == "__main__":
    main()
