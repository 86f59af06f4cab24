#!/usr/bin/env bash
# What we run on the H200 (device tool), in one call of at most 10 minutes: the GPU test suite, the
# benchmark (PROFILE=1: also the per-step profile). Liger-Kernel and Cut Cross-Entropy travel as wheels in .whl/
# (pip download --no-deps liger-kernel cut-cross-entropy), installed here without network.
# The integration tests and examples on CUDA: benchmarks/run_on_h200_integration.sh.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
FUSED_LM_LOSS_TEST_DEVICE=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider \
    --ignore tests/test_distributed.py --ignore tests/integrations tests 2>&1 | tee "$OUT/tests.log" | tail -3
if [ -n "${PROFILE:-}" ]; then  # the per-step breakdown (~1 min); PROFILE="--shapes gemma2-2b" picks flags
    [ "$PROFILE" = 1 ] && PROFILE="--profile --variants"
    timeout 150 python3 benchmarks/profile_chunk.py $PROFILE > "$OUT/profile.log" 2>&1
    grep -v "^-\|Self CPU\|^ *Name\|nvjet\|void\|Warn\|warn" "$OUT/profile.log" | cut -c1-200
fi
timeout 330 python3 benchmarks/bench_lm_loss.py --shapes llama3-8b,llama3-8b-32k,qwen2.5-7b,gemma2-2b,qwen2.5-0.5b \
    --peers-main-only --budget-ms 800 --out "$OUT" > "$OUT/bench.log" 2>&1
tail -n 80 "$OUT/table.md" 2>/dev/null || tail -n 30 "$OUT/bench.log"
