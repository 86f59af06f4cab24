#!/usr/bin/env bash
# The Hugging Face / peft / TRL integration tests and the examples on CUDA, then bench_models.py (one training
# step of three HF models: transformers' loss, Liger, TRL's fused head, ours), in one device call (~8 min).
# The wheels of run_on_h200.sh (.whl/, named in the call's carry) bring Liger and TRL; with trl and datasets
# there, tests/integrations/test_trainer.py's SFTTrainer test runs too instead of skipping.
#   MODELS="--models qwen2.5-0.5b --modes lora"   flags for bench_models.py (default: every model and mode)
#   TESTS=0 / EXAMPLES=0 / MODELS=0               skip a part
#   HF_TEST_DEVICE=cpu                            the tests on CPU tensors (as CI runs them)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
if [ "${TESTS:-1}" != 0 ]; then
    # models and batches on the GPU (tests/conftest.py sets the default device), so our Triton kernels run
    FUSED_LM_LOSS_TEST_DEVICE=${HF_TEST_DEVICE:-cuda} timeout "${HF_TEST_TIMEOUT:-150}" \
        python3 -m pytest -q -p no:cacheprovider -rf tests/integrations 2>&1 | tee "$OUT/hf_tests.log" \
        | grep -E "passed|failed|^FAILED|^ERROR" | tail -n 20
fi
if [ "${EXAMPLES:-1}" != 0 ]; then
    timeout 60 python3 examples/lora_finetune.py --steps 100 2>&1 | tee "$OUT/example.log" | tail -5
    timeout 60 torchrun --nproc_per_node 2 examples/vocab_parallel.py --backend gloo --vocab 32000 --hidden 1024 \
        --tokens 2048 --dtype bfloat16 2>&1 | tee "$OUT/vp.log" | tail -3
    # TRL's SFTTrainer, TRL's own head beside ours (needs the trl / datasets wheels)
    timeout 120 python3 examples/sft_trl.py --steps 20 2>&1 | tee "$OUT/sft_trl.log" | tail -14
    timeout 120 python3 examples/sft_trl.py --steps 20 --lora 2>&1 | tee "$OUT/sft_trl_lora.log" | tail -14
fi
if [ "${MODELS:-}" != 0 ]; then
    # shellcheck disable=SC2086  # flags
    timeout 300 python3 benchmarks/bench_models.py ${MODELS:-} --out "$OUT" > "$OUT/models.log" 2>&1
    echo "bench_models exited $?"
    cat "$OUT/models.md" 2>/dev/null || grep -v "Warning\|warn" "$OUT/models.log" | tail -n 30
fi
