"""TRL's DPOTrainer (or KTOTrainer) with fused_lm_loss: the metrics TRL logs, beside the same run on TRL's own head.

    python examples/dpo_trl.py                 # DPO, tiny random Llama on CPU (~1 min)
    python examples/dpo_trl.py --wpo           # DPO with WPO weighting (the head also gives log sum p^2)
    python examples/dpo_trl.py --kto           # KTO instead (desirable / undesirable completions)
    python examples/dpo_trl.py --lora          # LoRA on q/v: a frozen lm_head, the reference = adapter disabled

DPO and KTO ask TRL's fused LM head for the per-token log-probabilities, the entropy, the mean logit (the
``logits/*`` metrics) and, with WPO, log sum p^2; ``fused_lm_loss.patch(model)`` makes that head run on
fused_lm_loss's kernels (the reference model too, when it is patched). The script trains twice from the same
seed on the same data, unpatched and patched, each in a fresh process, and prints the logged metrics per step
side by side (and, on CUDA, the step time and peak memory of each).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl_side_by_side import VOCAB, run_logged, side_by_side, step_timer, word_tokenizer  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--kto", action="store_true", help="KTOTrainer instead of DPOTrainer")
    parser.add_argument("--wpo", action="store_true", help="DPO with WPO weighting (use_weighting=True)")
    parser.add_argument("--lora", action="store_true", help="LoRA on q_proj / v_proj (lm_head frozen)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args()


def build(args: argparse.Namespace):
    """(model, reference model or None, tokenizer, rows): a tiny random Llama, ``word_tokenizer``, and preference
    rows whose chosen completions repeat the prompt's first word."""
    import transformers

    torch.manual_seed(0)
    tokenizer = word_tokenizer()
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(config)
    reference = None if args.lora else transformers.LlamaForCausalLM(config)
    if reference is not None:
        reference.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(1)

    def words(n: int) -> list[str]:
        return [f"t{int(i)}" for i in torch.randint(3, VOCAB, (n,), generator=generator)]

    rows = []
    for k in range(args.batch_size * args.steps):
        prompt = words(8)
        good, bad = " ".join([prompt[0]] * 6), " ".join(words(6))
        if args.kto:
            rows.append({"prompt": " ".join(prompt), "completion": f" {good if k % 2 else bad} t2",
                         "label": bool(k % 2)})
        else:
            rows.append({"prompt": " ".join(prompt), "chosen": f" {good} t2", "rejected": f" {bad} t2"})
    return model, reference, tokenizer, rows


def metric_names(args: argparse.Namespace) -> tuple[str, ...]:
    if args.kto:
        return ("loss", "rewards/chosen", "logps/chosen", "logits/chosen", "entropy")
    return ("loss", "rewards/margins", "logps/chosen", "logits/chosen", "mean_token_accuracy")


def train(args: argparse.Namespace, patched: bool) -> dict:
    """One run in this fresh process (``trl_side_by_side.run_logged``)."""
    import datasets
    import trl

    import fused_lm_loss

    datasets.disable_progress_bars()
    model, reference, tokenizer, rows = build(args)
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])
    if patched:
        for m in (model, reference):  # <- the one line: TRL's fused head now runs on fused_lm_loss's kernels
            if m is not None:
                fused_lm_loss.patch(m)
    cuda = args.device == "cuda"
    common = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.batch_size, max_steps=args.steps,
                  logging_steps=1, learning_rate=1e-3, report_to=[], save_strategy="no", seed=0, use_cpu=not cuda,
                  bf16=cuda, disable_tqdm=True, log_level="error")
    if args.kto:
        config, trainer_class = trl.KTOConfig(**common), trl.KTOTrainer
    else:
        config, trainer_class = trl.DPOConfig(use_weighting=args.wpo, **common), trl.DPOTrainer
    timer = step_timer(cuda)
    trainer = trainer_class(model=model, ref_model=reference, args=config, processing_class=tokenizer,
                            train_dataset=datasets.Dataset.from_list(rows), peft_config=peft_config,
                            callbacks=[timer])
    return run_logged(trainer, timer, metric_names(args), cuda)


def main() -> None:
    args = parse_args()
    trainer = "KTOTrainer" if args.kto else f"DPOTrainer{' (WPO)' if args.wpo else ''}"
    side_by_side(train, args, f"{trainer}, {args.steps} steps of {args.batch_size} rows on {args.device}"
                 f"{' (LoRA q/v)' if args.lora else ''}", metric_names(args), "TRL's head")


if __name__ == "__main__":
    main()
