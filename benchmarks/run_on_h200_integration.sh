#!/usr/bin/env bash
# One training step of three HF models (bench_models.py: transformers' loss, Liger, TRL's fused head, ours),
# the Hugging Face / peft / TRL integration tests on CUDA tensors, and the examples, in one device call
# (~8 min with the defaults). The wheels of run_on_h200.sh (.whl/, named in the call's carry) bring Liger and
# TRL (with datasets, the SFTTrainer tests and examples/sft_trl.py run instead of skipping).
#   MODELS="--models qwen2.5-0.5b --modes lora"   flags for bench_models.py (default: every model and mode)
#   MODELS_TIMEOUT / HF_TEST_TIMEOUT              seconds for those parts (default 300 / 150)
#   HF_TEST_DEVICE=cpu                            the tests on CPU tensors (as CI runs them)
#   EXAMPLES=sft                                  only examples/sft_trl.py (full fine-tune and LoRA; SFT_TIMEOUT each)
#   TESTS=0 / EXAMPLES=0 / MODELS=0               skip a part
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
if [ "${MODELS:-}" != 0 ]; then
    # shellcheck disable=SC2086  # flags
    timeout "${MODELS_TIMEOUT:-300}" python3 benchmarks/bench_models.py ${MODELS:-} --out "$OUT" > "$OUT/models.log" 2>&1
    echo "bench_models exited $?"
    cat "$OUT/models.md" 2>/dev/null || grep -v "Warning\|warn" "$OUT/models.log" | tail -n 30
fi
if [ "${TESTS:-1}" != 0 ]; then
    # models and batches on the GPU (tests/conftest.py sets the default device), so our Triton kernels run
    FUSED_LM_LOSS_TEST_DEVICE=${HF_TEST_DEVICE:-cuda} timeout "${HF_TEST_TIMEOUT:-150}" \
        python3 -m pytest -q -p no:cacheprovider -rf tests/integrations > "$OUT/hf_tests.log" 2>&1
    echo "pytest tests/integrations exited $?"
    grep -E "passed|failed|^FAILED|^ERROR" "$OUT/hf_tests.log" | tail -n 20
fi
if [ "${EXAMPLES:-1}" != 0 ]; then
    # TRL's SFTTrainer, TRL's own head beside ours (needs the trl / datasets wheels)
    timeout "${SFT_TIMEOUT:-90}" python3 examples/sft_trl.py --steps 20 > "$OUT/sft_trl.log" 2>&1
    echo "sft_trl exited $?"; tail -n 14 "$OUT/sft_trl.log"
    timeout "${SFT_TIMEOUT:-90}" python3 examples/sft_trl.py --steps 20 --lora > "$OUT/sft_trl_lora.log" 2>&1
    echo "sft_trl --lora exited $?"; tail -n 14 "$OUT/sft_trl_lora.log"
fi
if [ "${EXAMPLES:-1}" = 1 ]; then
    timeout 60 python3 examples/lora_finetune.py --steps 100 > "$OUT/example.log" 2>&1
    echo "lora_finetune exited $?"; tail -n 5 "$OUT/example.log"
    timeout 60 torchrun --nproc_per_node 2 examples/vocab_parallel.py --backend gloo --vocab 32000 --hidden 1024 \
        --tokens 2048 --dtype bfloat16 > "$OUT/vp.log" 2>&1
    echo "vocab_parallel exited $?"; tail -n 3 "$OUT/vp.log"
fi
