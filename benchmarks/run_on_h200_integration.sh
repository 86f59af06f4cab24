#!/usr/bin/env bash
# The Hugging Face / peft integration tests and the examples on CUDA (device tool, one call).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/integrations 2>&1 | tee "$OUT/hf_tests.log" | tail -2
timeout 60 python3 examples/lora_finetune.py --steps 100 2>&1 | tee "$OUT/example.log" | tail -5
timeout 60 torchrun --nproc_per_node 2 examples/vocab_parallel.py --backend gloo --vocab 32000 --hidden 1024 \
    --tokens 2048 --dtype bfloat16 2>&1 | tee "$OUT/vp.log" | tail -3
