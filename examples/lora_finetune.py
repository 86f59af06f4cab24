"""LoRA fine-tuning with the fused LM loss beside the same fine-tuning unpatched: loss curves and memory.

    python examples/lora_finetune.py                      # tiny random Llama, built-in text, 1-2 min on CPU
    python examples/lora_finetune.py --no-lora-lm-head    # LoRA on attention + MLP only (lm_head frozen)
    python examples/lora_finetune.py --model ./my-hf-dir  # a local Hugging Face causal LM and its tokenizer

LoRA adapts attention, MLP and (by default) lm_head; the lm_head adapter is fused into the loss as a
low-rank term, so its gradients are exact too. The model trains on a short built-in text (byte-level
tokens, or the model's tokenizer with --model).
The one line that matters is ``fused_lm_loss.patch(model)``: in training the logits are never
materialized (``outputs.logits`` is None) while the loss and gradients stay those of the model. The
example trains the patched model and an unpatched copy from the same seed on the same batches, each in a
fresh process, and prints both loss curves, their largest difference, and the peak memory of each. (Over
long runs any two fp32 trainings whose sums are ordered differently drift apart, as round-off grows under
the optimizer; over the default 50 steps the curves agree to ~1e-6.)

Memory: on CUDA, ``torch.cuda.max_memory_allocated`` over the training steps. On CPU there is no allocator
statistic: the peak resident set size (RSS) growth over the steps after warm-up is reported, coarse (the C
allocator may keep freed pages) but honest. Step times are printed on CUDA only: on a CPU running the tiny
model they say nothing about the GPU kernels.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import fused_lm_loss  # noqa: E402
from fused_lm_loss import FusedLMLoss  # noqa: E402

TEXT = (
    "The mill stood where the river bent twice before reaching the town. Every spring the water rose "
    "over the lower steps, and every summer the miller painted the wheel a brighter shade of green, as "
    "if colour alone could keep the wood from rotting. Children came to watch the paddles climb out of "
    "the current and fall back in, counting the turns until they lost track somewhere past a hundred. "
    "In the evenings the miller wrote down what had been ground that day: barley on Mondays, rye when "
    "the farmers from the hills arrived, and wheat whenever the weather allowed the carts to cross the "
    "old stone bridge. He kept the ledgers on a shelf above the door, one for every year, and when the "
    "shelf was full he built another one beside it. Nobody asked him to keep such careful records, but "
    "he said that a river remembers everything and a miller should try to do the same. "
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="local Hugging Face model directory (default: a tiny random Llama)")
    parser.add_argument("--steps", type=int, default=50, help="training steps (each variant)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--lora-lm-head",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also put a LoRA adapter on lm_head, fused into the loss as a low-rank term (default: on)",
    )
    parser.add_argument("--vocab-size", type=int, default=8192, help="vocabulary of the tiny model (bytes use 256)")
    parser.add_argument(
        "--chunk-size",
        type=int,
        help="token rows per fused-loss chunk (default: automatic on GPU; 64 on CPU, where the automatic "
        "size, made for a 256 MiB GPU budget, would take this small batch in one chunk)",
    )
    args = parser.parse_args()
    if args.chunk_size is None and torch.device(args.device).type == "cpu":
        args.chunk_size = 64
    return args


def load_model(args: argparse.Namespace, seed: int = 0):
    """(model, token ids of TEXT) for the tiny random Llama or the local model directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model)
        if args.device == "cpu":  # bf16 matmuls are slow on most CPUs
            model = model.float()
        ids = AutoTokenizer.from_pretrained(args.model)(TEXT * 4)["input_ids"]
    else:
        config = LlamaConfig(
            vocab_size=args.vocab_size,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=args.seq_len,
        )
        model = LlamaForCausalLM(config)
        ids = list(TEXT.encode("utf-8"))
    return model.to(args.device), torch.tensor(ids, device=args.device)


def add_lora(model, lm_head: bool):
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    if lm_head:
        targets.append("lm_head")
    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=targets)
    return get_peft_model(model, config)


def random_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=generator)
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])


def train_step(model, optimizer, batch: torch.Tensor, device: str) -> float:
    device_type = torch.device(device).type
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=device_type == "cuda"):
        loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def train(args: argparse.Namespace, fused: bool) -> dict:
    """Fine-tune (patched or not) in this fresh process: per-step losses, peak memory, median step time."""
    model, tokens = load_model(args)
    model = add_lora(model, args.lora_lm_head)
    if fused:
        fused_lm_loss.patch(model, FusedLMLoss(chunk_size=args.chunk_size))  # <- the one line
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    generator = torch.Generator().manual_seed(0)
    cuda = torch.device(args.device).type == "cuda"
    losses, times, base = [], [], None
    for step in range(args.steps):
        if step == 2:  # after warm-up (allocator, optimizer state)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else _rss_bytes()
        start = time.perf_counter()
        losses.append(train_step(model, optimizer, random_batch(tokens, args.batch_size, args.seq_len, generator),
                                 args.device))  # .item() inside: synchronizes
        times.append(time.perf_counter() - start)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    else:
        # ru_maxrss (KiB on Linux) is the process's lifetime peak, reached during one of the (alike) steps;
        # minus the RSS after warm-up it approximates one step's transient memory
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    vocab = (model.get_base_model() if hasattr(model, "get_base_model") else model).config.vocab_size
    return {"losses": losses, "peak": max(peak, 0), "seconds": statistics.median(times[2:] or times), "vocab": vocab}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def compare(args: argparse.Namespace) -> None:
    print(f"LoRA fine-tuning, {args.steps} steps of {args.batch_size} x {args.seq_len} tokens on {args.device}: "
          "fused_lm_loss.patch(model) beside the unpatched model (same seed, same batches)")
    results = {}
    for name, fused in (("fused", True), ("unpatched", False)):
        with mp.get_context("spawn").Pool(1) as pool:  # a fresh process each: clean peak statistics
            results[name] = pool.apply(train, (args, fused))
    fused, plain = results["fused"]["losses"], results["unpatched"]["losses"]
    every = max(1, args.steps // 10)
    print(f"\n{'step':>6s}{'fused loss':>12s}{'unpatched':>12s}{'difference':>12s}")
    for step in sorted({*range(0, args.steps, every), args.steps - 1}):
        print(f"{step + 1:>6d}{fused[step]:>12.4f}{plain[step]:>12.4f}{fused[step] - plain[step]:>12.1e}")
    worst = max(abs(a - b) for a, b in zip(fused, plain))
    print(f"largest loss difference over {args.steps} steps: {worst:.2e} "
          f"(loss {fused[0]:.3f} -> {fused[-1]:.3f}; a uniform guess is {math.log(results['fused']['vocab']):.3f})")
    cuda = torch.device(args.device).type == "cuda"
    what = "peak extra memory" if cuda else "peak RSS growth"
    print(f"\n{'':12s}{what:>20s}" + (f"{'median step':>14s}" if cuda else ""))
    for name, r in results.items():
        print(f"{name:12s}{r['peak'] / 2**20:>16.1f} MiB" + (f"{r['seconds'] * 1e3:>11.1f} ms" if cuda else ""))
    saved = results["unpatched"]["peak"] - results["fused"]["peak"]
    print(f"memory saved by the fused loss: {saved / 2**20:.1f} MiB" + ("" if cuda else
          " (CPU: RSS growth is coarse; on CUDA this is torch.cuda.max_memory_allocated; CPU step times are "
          "not shown: they say nothing about the GPU kernels)"))


def main() -> None:
    compare(parse_args())


if __name__ == "__main__":
    main()
