"""TRL's SFTTrainer with fused_lm_loss: the metrics TRL logs, beside the same run on TRL's own fused head.

    python examples/sft_trl.py                        # tiny random Llama on CPU (~1 min)
    python examples/sft_trl.py --lora                 # LoRA on q/v (a frozen lm_head: per-row gradients)
    python examples/sft_trl.py --model ./my-hf-dir    # a local causal LM and its tokenizer (GPU: real sizes)

TRL 1.x computes the SFT loss with a fused LM head of its own (per-token log-probabilities, entropy and
top-1 without the logits). ``fused_lm_loss.patch(model)`` makes that head run on fused_lm_loss's kernels;
nothing else in the script changes. The example trains twice from the same seed on the same data, once
unpatched (TRL's head) and once patched, each in a fresh process, and prints loss, entropy and
mean_token_accuracy per step side by side, then the step time and peak memory of each (on CUDA; on a CPU
running the tiny model those say nothing about the GPU kernels and are not shown).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

METRICS = ("loss", "entropy", "mean_token_accuracy")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="local Hugging Face model directory (default: a tiny random Llama)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lora", action="store_true", help="LoRA on q_proj / v_proj (lm_head frozen)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args()


def build(args: argparse.Namespace):
    """(model, tokenizer, rows of token ids) for the tiny random Llama or the local model directory."""
    import transformers

    torch.manual_seed(0)
    if args.model:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        vocab = tokenizer.vocab_size
    else:
        from tokenizers import Tokenizer, models

        vocab = 4096
        fast = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1"))
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=fast, pad_token="t0", eos_token="t2", unk_token="t1"
        )
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=args.seq_len,
        )
        model = transformers.LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(1)
    rows = []
    motifs = torch.randint(3, vocab, (4, 8), generator=generator)  # four short motifs, repeated: easy to learn
    for k in range(args.batch_size * args.steps):
        ids = motifs[k % 4].repeat(-(-args.seq_len // 8))[: args.seq_len].tolist()
        prompt = args.seq_len // 4  # completion-only: the first quarter is a prompt without loss
        rows.append({"input_ids": ids, "completion_mask": [0] * prompt + [1] * (args.seq_len - prompt)})
    return model, tokenizer, rows


def train(args: argparse.Namespace, patched: bool) -> dict:
    """One SFT run in this fresh process: TRL's logged metrics per step, median step time, peak memory."""
    import datasets
    import transformers
    import trl

    import fused_lm_loss

    model, tokenizer, rows = build(args)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))
    if patched:
        fused_lm_loss.patch(model)  # <- the one line: TRL's fused head now runs on fused_lm_loss's kernels
    cuda = args.device == "cuda"
    config = trl.SFTConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.batch_size, max_steps=args.steps,
        logging_steps=1, learning_rate=3e-3, report_to=[], save_strategy="no", seed=0, use_cpu=not cuda,
        bf16=cuda, completion_only_loss=True, max_length=args.seq_len, disable_tqdm=True, log_level="error",
    )

    class Timer(transformers.TrainerCallback):
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

    timer = Timer()
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=tokenizer, callbacks=[timer])
    trainer.remove_callback(transformers.PrinterCallback)  # the table below prints what it would
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    logs = [{k: log[k] for k in METRICS if k in log} for log in trainer.state.log_history if "loss" in log]
    return {
        "logs": logs,
        "seconds": statistics.median(timer.times[2:] or timer.times),
        "peak": torch.cuda.max_memory_allocated() if cuda else None,
    }


def main() -> None:
    args = parse_args()
    results = {}
    for name, patched in (("TRL's head", False), ("fused_lm_loss", True)):
        with mp.get_context("spawn").Pool(1) as pool:  # fresh processes: clean memory statistics
            results[name] = pool.apply(train, (args, patched))
    theirs, ours = results["TRL's head"]["logs"], results["fused_lm_loss"]["logs"]
    print(f"\nSFTTrainer, {args.steps} steps of {args.batch_size} x {args.seq_len} tokens on {args.device}"
          f"{' (LoRA q/v)' if args.lora else ''}: TRL's own fused head vs patched with fused_lm_loss")
    header = "".join(f"{m:>22s}" for m in METRICS)
    print(f"{'step':>5s}{header}")
    for step, (a, b) in enumerate(zip(theirs, ours), 1):
        print(f"{step:>5d}" + "".join(f"{a[m]:>11.5f} /{b[m]:>9.5f}" for m in METRICS))
    worst = {m: max(abs(a[m] - b[m]) for a, b in zip(theirs, ours)) for m in METRICS}
    print("largest difference: " + ", ".join(f"{m} {d:.1e}" for m, d in worst.items()))
    if args.device == "cuda":
        for name, r in results.items():
            print(f"{name:>14s}: median step {r['seconds'] * 1e3:.1f} ms, peak memory {r['peak'] / 2**30:.2f} GiB")
    else:
        print("(CPU: step time and memory are not shown; on a GPU the script prints both)")


if __name__ == "__main__":
    main()
