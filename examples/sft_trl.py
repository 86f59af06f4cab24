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
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl_side_by_side import VOCAB, run_logged, side_by_side, step_timer, word_tokenizer  # noqa: E402

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
        vocab, tokenizer = VOCAB, word_tokenizer()
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
    """One SFT run in this fresh process (``trl_side_by_side.run_logged``)."""
    import datasets
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
    timer = step_timer(cuda)
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=tokenizer, callbacks=[timer])
    return run_logged(trainer, timer, METRICS, cuda)


def main() -> None:
    args = parse_args()
    side_by_side(train, args, f"SFTTrainer, {args.steps} steps of {args.batch_size} x {args.seq_len} tokens on "
                 f"{args.device}{' (LoRA q/v)' if args.lora else ''}", METRICS, "TRL's head")


if __name__ == "__main__":
    main()
