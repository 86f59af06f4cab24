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
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl_side_by_side import VOCAB, run_logged, side_by_side, step_timer, word_tokenizer  # noqa: E402

METRICS = ("loss", "entropy", "completions/mean_length")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args()


def train(args: argparse.Namespace, patched: bool) -> dict:
    """One run in this fresh process (``trl_side_by_side.run_logged``)."""
    import datasets
    import transformers
    import trl

    import fused_lm_loss

    datasets.disable_progress_bars()
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    student = transformers.LlamaForCausalLM(transformers.LlamaConfig(hidden_size=64, **shape))
    teacher = transformers.LlamaForCausalLM(transformers.LlamaConfig(hidden_size=128, **shape))  # a wider teacher
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
    timer = step_timer(cuda)
    trainer = trl.DistillationTrainer(model=student, teacher_model=teacher, args=config,
                                      train_dataset=datasets.Dataset.from_list(rows),
                                      processing_class=word_tokenizer(), callbacks=[timer])
    return run_logged(trainer, timer, METRICS, cuda)


def main() -> None:
    args = parse_args()
    side_by_side(train, args, f"DistillationTrainer (beta {args.beta}), {args.steps} steps of {args.batch_size} "
                 f"prompts on {args.device}", METRICS, "TRL's divergence")


if __name__ == "__main__":
    main()
