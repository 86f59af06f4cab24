"""One training step of Hugging Face models built from their configs (no downloads): tokens/s and peak memory.

    python benchmarks/bench_models.py --out results/                        # H200: ~3-4 min
    python benchmarks/bench_models.py --models qwen2.5-0.5b --modes lora --steps 20
    python benchmarks/bench_models.py --cpu --tiny                          # dry run: tiny configs, 2 steps
    python benchmarks/bench_models.py --zero3 --impls hf,fused              # under DeepSpeed ZeRO-3 (one GPU)

Models (bf16, random weights, the transformers default attention: sdpa, eager for Gemma 2):
  llama3-8b-2l   Llama-3-8B's dimensions (H 4096, V 128256, untied head) with 2 decoder layers
  qwen2.5-0.5b   Qwen2.5-0.5B at full depth (24 layers, H 896, V 151936, tied embeddings)
  gemma2-2b-2l   Gemma-2-2B's dimensions (H 2304, V 256000, tied, final logit softcap 30) with 2 layers
Batch --batch x --seq tokens (default 4 x 2048 = 8192), random ids, labels = the ids with 10% set to -100
(the model shifts them). Modes: full (every parameter trained) and lora (peft LoRA r=16 on q_proj and
v_proj: the lm_head is frozen). For each model, mode and implementation a fresh model (same seed) runs:
  hf       the model as transformers ships it (logits, then its own ForCausalLMLoss in fp32)
  liger    liger_kernel.transformers.apply_liger_kernel_to_{llama,qwen2,gemma2}(model=...,
           fused_linear_cross_entropy=True) with every other Liger kernel off (rope, RMSNorm, SwiGLU / GeGLU),
           so that only the loss differs; when importable
  trl      TRL's fused head as its trainers install it: trl.trainer.utils.add_fused_lm_head(model,
           outputs=SFT's ("log_probs", "entropy", "is_top1")), called with fused_lm_head=True; when
           trl.trainer.utils does not import (it needs datasets, pandas, accelerate), trl_kernel: the same
           forward (backbone, shift, only the non-ignored rows on CUDA, ChunkedLogProbFunction) written here
  fused    fused_lm_loss.patch(model)
Each step is forward + backward (gradients set to None before it; --adamw adds a torch AdamW step). Printed:
the median of --steps CUDA-event-timed steps after --warmup steps, tokens/s, the speed against hf, the
peak memory of one step beyond what was allocated before it (torch.cuda.max_memory_allocated delta:
activations, logits, gradients), and the first step's loss (all implementations see the same weights and
batch, so the losses should agree to ~1e-3). JSON rows and the table go to --out/models.json and models.md.

--zero3: each model runs under DeepSpeed ZeRO-3 on this one GPU (a world of one rank over NCCL; DeepSpeed's default
ZeRO-3 settings: parameters above 1e5 values partitioned, the lm_head among them; bf16 with DeepSpeed's fp32
master weights; DeepSpeed's SGD), and a step is forward + engine.backward + engine.step (its partitioned reduction
and update), HF's ZeRO-3 flag set as Trainer(deepspeed=...) sets it (TRL then gathers its head).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import peers  # noqa: E402  (benchmarks/peers.py)

GiB = 2.0**30
IMPLS = ("hf", "liger", "trl", "fused")
#: name -> (transformers model type, config keywords)
MODELS = {
    "llama3-8b-2l": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                   rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "gemma2-2b-2l": ("gemma2", dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=2,
                                    num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
                                    final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                                    query_pre_attn_scalar=256, sliding_window=4096, rms_norm_eps=1e-6,
                                    tie_word_embeddings=True)),
}
#: --tiny: the same families at toy sizes (CPU dry run)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1000)
TINY_EXTRA = {"gemma2": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=32)}


class Runner:
    def __init__(self, args):
        self.args = args
        self.device = torch.device("cpu" if args.cpu else "cuda")
        self.dtype = getattr(torch, args.dtype)

    # ---- models and batches
    def build(self, name: str, mode: str):
        from transformers import AutoConfig, AutoModelForCausalLM

        family, dims = MODELS[name]
        if self.args.tiny:
            dims = {**dims, **TINY, **TINY_EXTRA.get(family, {})}
        config = AutoConfig.for_model(family, **dims)
        torch.manual_seed(0)
        with torch.device(self.device):
            try:
                model = AutoModelForCausalLM.from_config(config, dtype=self.dtype)
            except TypeError:  # transformers < 4.56
                model = AutoModelForCausalLM.from_config(config, torch_dtype=self.dtype)
        model.train()
        if mode == "lora":
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                              task_type="CAUSAL_LM")
            model = get_peft_model(model, lora)
            model.train()
        return model

    def batch(self, vocab: int):
        gen = torch.Generator(device=self.device).manual_seed(1)
        ids = torch.randint(0, vocab, (self.args.batch, self.args.seq), device=self.device, generator=gen)
        labels = ids.clone()
        labels[torch.rand(ids.shape, device=self.device, generator=gen) < 0.1] = -100
        return ids, labels

    # ---- the implementations: each returns step(ids, labels) -> loss, or raises when unavailable
    def impl(self, impl: str, name: str, model):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if impl == "hf":
            return lambda ids, labels: model(input_ids=ids, labels=labels, use_cache=False).loss
        if impl == "fused":
            import fused_lm_loss

            patched = fused_lm_loss.patch(model)
            return lambda ids, labels: patched(input_ids=ids, labels=labels, use_cache=False).loss
        if impl == "liger":
            from liger_kernel.transformers import monkey_patch

            apply = getattr(monkey_patch, f"apply_liger_kernel_to_{MODELS[name][0]}")
            flags = {p: False for p, v in inspect.signature(apply).parameters.items() if isinstance(v.default, bool)}
            apply(**{**flags, "fused_linear_cross_entropy": True}, model=base)
            return lambda ids, labels: model(input_ids=ids, labels=labels, use_cache=False).loss
        if impl == "trl":
            module, add_fused_lm_head = peers.trl_kernel(), peers.trl_fused_head()
            if add_fused_lm_head is not None:
                add_fused_lm_head(base, outputs=peers.TRL_SFT_OUTPUTS)
                return lambda ids, labels: model(input_ids=ids, labels=labels, fused_lm_head=True, use_cache=False).loss
            return lambda ids, labels: trl_forward(module, base, ids, labels)
        raise ValueError(impl)

    # ---- timing
    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def measure(self, model, step, ids, labels):
        """(median ms, peak GiB beyond the memory before a step or None on CPU, first loss)."""
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = None
        if self.args.adamw:
            optimizer = torch.optim.AdamW(params, lr=1e-5, fused=self.device.type == "cuda")

        engine = zero3_engine(model, params, ids.shape[0]) if self.args.zero3 else None

        def one():
            if engine is not None:  # DeepSpeed's backward, partitioned reduction and update
                loss = step(ids, labels)
                engine.backward(loss)
                engine.step()
                return loss
            for p in params:
                p.grad = None
            loss = step(ids, labels)
            loss.backward()
            if optimizer is not None:
                optimizer.step()
            return loss

        first = float(one().detach())
        for _ in range(self.args.warmup - 1):
            one()
        self.sync()
        peak = None
        if self.device.type == "cuda":
            for p in params:
                p.grad = None
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            one()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / GiB
        times = []
        for _ in range(self.args.steps):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                one()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                one()
                times.append(1e3 * (time.perf_counter() - t0))
        if engine is not None:
            engine.destroy()
        return statistics.median(times), peak, first


def zero3_engine(model, params, batch: int):
    """``model`` under DeepSpeed ZeRO-3 (see --zero3). The model keeps being called directly: ZeRO-3's gathering
    hooks are on its modules."""
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
        "bf16": {"enabled": next(model.parameters()).dtype == torch.bfloat16}, "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-5}}, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    return engine


def trl_forward(module, model, ids, labels):
    """TRL's ``_fused_forward`` (add_fused_lm_head, trl 1.16) for SFT, when trl.trainer.utils does not
    import: the backbone alone, hidden[:, :-1] against labels[:, 1:], the head's weight and the config's
    softcap / logit scale into ChunkedLogProbFunction (peers.trl_sft_loss)."""
    hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
    head = model.get_output_embeddings()
    text_config = model.config.get_text_config()
    return peers.trl_sft_loss(
        module, hidden, head.weight, labels[:, 1:], bias=head.bias,
        softcap=getattr(text_config, "final_logit_softcapping", None),
        logit_scale=getattr(text_config, "logit_scale", None) or 1.0, outputs=peers.TRL_SFT_OUTPUTS,
    )


def write_table(rows, env, out):
    head = (f"{env['date']} · {env['device']} · torch {env['torch']} · transformers {env['transformers']} · "
            f"peft {env['peft']}" + "".join(f" · {k} {env[k]}" for k in ("liger", "trl") if env.get(k)))
    lines = [head, f"batch {env['batch']} x {env['seq']} tokens, 10% of labels ignored, {env['dtype']}"
             + (", AdamW step included" if env["adamw"] else ", forward + backward")
             + (f"; DeepSpeed {env['zero3']} ZeRO-3, its SGD step included" if env.get("zero3") else ""), "",
             "| model | mode | impl | ms | tokens/s | × hf speed | peak GiB | loss |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['mode']} | {r['impl']} | {r['error'][:90]} | | | | |")
            continue
        hf = next((x for x in rows if x["model"] == r["model"] and x["mode"] == r["mode"] and x["impl"] == "hf"
                   and "ms" in x), None)
        speed = f"{hf['ms'] / r['ms']:.2f}×" if hf else ""
        peak = "" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        lines.append(f"| {r['model']} | {r['mode']} | {r['impl']} | {r['ms']:.1f} | {r['tokens_per_s']:,.0f} | {speed} | "
                     f"{peak} | {r['loss']:.4f} |")
    table = "\n".join(lines)
    with open(os.path.join(out, "models.md"), "w") as f:
        f.write(table + "\n")
    print(table)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="folder for models.json / models.md")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--modes", default="full,lora")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--batch", type=int, default=None, help="sequences (default 4; --tiny 2)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; --tiny 64)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --cpu 2)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before timing (default 2; --cpu 1)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--adamw", action="store_true", help="include an AdamW step in each timed step")
    parser.add_argument("--cpu", action="store_true", help="run on CPU (with --tiny: a dry run)")
    parser.add_argument("--tiny", action="store_true", help="toy dimensions of the same model families")
    parser.add_argument("--zero3", action="store_true", help="under DeepSpeed ZeRO-3 (a world of one GPU)")
    args = parser.parse_args()
    args.batch = args.batch or (2 if args.tiny else 4)
    args.seq = args.seq or (64 if args.tiny else 2048)
    args.steps = args.steps or (2 if args.cpu else 10)
    args.warmup = max(1, args.warmup or (1 if args.cpu else 2))
    os.makedirs(args.out, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.zero3:
        import deepspeed

        for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                               MASTER_PORT="29511").items():
            os.environ.setdefault(key, value)
        deepspeed.init_distributed(dist_backend="gloo" if args.cpu else "nccl")
    import peft
    import transformers

    runner = Runner(args)
    env = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0) if not args.cpu else f"CPU ({platform.machine()})",
        "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
        "liger": peers.version("liger-kernel") if _importable("liger_kernel") else None,
        "trl": peers.version("trl") if _importable("trl") else None,
        "batch": args.batch, "seq": args.seq, "dtype": args.dtype, "adamw": args.adamw, "tiny": args.tiny,
        "zero3": args.zero3 and peers.version("deepspeed"),
    }
    rows = []
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            for impl in args.impls.split(","):
                row = dict(model=name, mode=mode, impl=impl)
                model = None
                try:
                    model = runner.build(name, mode)
                    step = runner.impl(impl, name, model)
                    if impl == "trl" and peers.trl_fused_head() is None:
                        row["impl"] = "trl_kernel"
                        env["trl_import"] = peers.trl_how()
                    ids, labels = runner.batch(model.config.get_text_config().vocab_size)
                    with zero3_flag(args.zero3):
                        ms, peak, loss = runner.measure(model, step, ids, labels)
                    row.update(ms=ms, tokens_per_s=ids.numel() / ms * 1e3, peak_gib=peak, loss=loss)
                except Exception as e:  # noqa: BLE001 - a missing peer or an OOM is a result too
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                model = step = None
                if runner.device.type == "cuda":
                    torch.cuda.empty_cache()
                rows.append(row)
                print(json.dumps(row), flush=True)
                with open(os.path.join(args.out, "models.json"), "w") as f:
                    json.dump({"env": env, "rows": rows}, f, indent=1)
    write_table(rows, env, args.out)


def zero3_flag(on: bool):
    """HF's "ZeRO-3 is on" flag, as Trainer(deepspeed=...) sets it, while a model runs under --zero3 (set after the
    model is built: with it, from_config would build the model partitioned)."""
    import contextlib

    if not on:
        return contextlib.nullcontext()
    from transformers.integrations import HfDeepSpeedConfig, unset_hf_deepspeed_config

    @contextlib.contextmanager
    def flag():
        config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
        try:
            yield config
        finally:
            unset_hf_deepspeed_config()

    return flag()


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


if __name__ == "__main__":
    main()
