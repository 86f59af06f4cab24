#!/usr/bin/env bash
# What we run on the H200 (device tool), in one call: the GPU test suite, the integration tests, the
# examples on CUDA, then the benchmark. Liger-Kernel and Cut Cross-Entropy travel as wheels in .whl/
# (pip download --no-deps liger-kernel cut-cross-entropy), installed here without network.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
FUSED_LM_LOSS_TEST_DEVICE=cuda python3 -m pytest -q -s -p no:cacheprovider \
    --ignore tests/test_distributed.py --ignore tests/integrations tests 2>&1 | tee "$OUT/tests.log" | tail -3
python3 -m pytest -q -p no:cacheprovider tests/integrations 2>&1 | tee "$OUT/hf_tests.log" | tail -2
python3 examples/lora_finetune.py --steps 100 2>&1 | tee "$OUT/example.log" | tail -5
torchrun --nproc_per_node 2 examples/vocab_parallel.py --backend gloo --vocab 32000 --hidden 1024 \
    --tokens 2048 --dtype bfloat16 2>&1 | tee "$OUT/vp.log" | tail -3
python3 benchmarks/bench_lm_loss.py --shapes llama3-8b,llama3-8b-32k,qwen2.5-7b,gemma2-2b,qwen2.5-0.5b \
    --out "$OUT" > "$OUT/bench.log" 2>&1
tail -n 80 "$OUT/table.md"
