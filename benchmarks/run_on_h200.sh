#!/usr/bin/env bash
# What we run on the H200 (device tool), in calls of at most 10 minutes: the GPU test suite, the loss benchmark
# with every row (~6 min), and, with PROFILE=..., one profile script (~2 min). Each step runs under `timeout`;
# logs and results go to $OUT. On a fresh machine the whole GPU suite takes ~6.5 min (Triton compiles
# every kernel variant: tests/kernels ~3 min cold, 0.5 min warm; the rest ~3.3 min; 2026-12-04): run it in a call of its own
# (BENCH=0 TEST_TIMEOUT=500), or name a part in TESTS beside the benchmark (TESTS=0 for none).
#   PROFILE="steps"                            benchmarks/profile_steps.py (any flags may follow the name:
#   PROFILE="timeline --shapes qwen2.5-0.5b"   PROFILE="forward --repeats 5"); PROFILE=1 means "steps"
# AB_ROOT=.old (another checkout of the repo, carried): the fused rows for this tree and that one, interleaved.
# HF/peft tests on CUDA, the examples and bench_models.py: benchmarks/run_on_h200_integration.sh.
#
# Wheels to carry (the device has no network; .whl/ is git-ignored: name it in the call's carry). Made here,
# in the repo root, with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
#     liger-kernel==0.8.5 cut-cross-entropy==25.1.1 trl==1.16.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18
# (2.6 MiB). liger-kernel and cut-cross-entropy need only torch and triton, which the device has. TRL's kernel
# file needs only transformers (5.17 there); trl.trainer.utils (add_fused_lm_head, which the kernel's
# backward also imports) needs accelerate, pandas, pyarrow, huggingface_hub, numpy, psutil, jinja2, pyyaml
# (there) and datasets (not there), whose own needs dill and multiprocess are not there either (filelock,
# requests, httpx, tqdm, xxhash, fsspec are). Without datasets the benchmarks still run TRL's kernel alone
# (benchmarks/peers.py). Keep one version of each wheel in .whl/.
#
# Quack (the quack_* rows) needs NVIDIA's CuTe DSL, too large for one call: pack it with
# `bash ../shared/device/pack_cute_dsl.sh .cute 4.8.1 0.6.5`, run `bash .cute/a/unpack.sh` in a call carrying
# .cute/a, then, in the next call (the machine still warm) carrying .cute/b, pass the path that
# `bash .cute/b/install.sh` prints as CUTE_PYTHONPATH. Session 14 also unzipped .cute/b/cuda_pathfinder-*.whl into
# /tmp/cute-site after install.sh (`python3 -c "import zipfile, glob; zipfile.ZipFile(glob.glob(
# '.cute/b/cuda_pathfinder*.whl')[0]).extractall('/tmp/cute-site')"`): a `pip install --target` of all the wheels
# at once dropped cuda.pathfinder here (cuda-bindings shares its `cuda` folder), and cuda.bindings needs it.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}${CUTE_PYTHONPATH:+:$CUTE_PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# TESTS / TESTS_AFTER: pytest paths to run before / after the benchmark (TESTS=0: none; split at spaces, so no
# quoted -k expressions: name test ids instead); *_TIMEOUT: seconds
run_tests() {  # $1: log name, $2: timeout, the rest: paths
    local log=$1 limit=$2
    shift 2
    FUSED_LM_LOSS_TEST_DEVICE=cuda timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rf "$@" \
        > "$OUT/$log" 2>&1
    echo "pytest $* exited $?"
    grep -E "passed|failed|^FAILED|^ERROR" "$OUT/$log" | tail -n 15
}
if [ "${TESTS:-1}" != 0 ]; then
    [ "${TESTS:-1}" = 1 ] && TESTS="--ignore tests/test_distributed.py --ignore tests/integrations tests"
    # shellcheck disable=SC2086
    run_tests tests.log "${TEST_TIMEOUT:-100}" $TESTS
fi
if [ -n "${PROFILE:-}" ]; then
    [ "$PROFILE" = 1 ] && PROFILE=steps
    # shellcheck disable=SC2086  # the script's name, then its flags
    set -- $PROFILE
    script=benchmarks/profile_$1.py
    shift
    timeout "${PROFILE_TIMEOUT:-150}" python3 "$script" "$@" > "$OUT/profile.log" 2>&1
    echo "$script $* exited $?"
    grep -v "Warn\|warn" "$OUT/profile.log" | cut -c1-220 | tail -n 120
fi
if [ -n "${AB_ROOT:-}" ]; then
    # A/B against another checkout of the library (e.g. `git archive COMMIT | tar -x -C .old`, carried): the
    # benchmark with AB_FLAGS for this tree and AB_ROOT in turn, AB_ROUNDS times, each in its own process
    AB_FLAGS=${AB_FLAGS:-"--rows fused --main-only --budget-ms 300"}
    for round in $(seq "${AB_ROUNDS:-2}"); do
        for side in this "$AB_ROOT"; do
            name=ab_${round}_$(basename "$side")
            # shellcheck disable=SC2086
            FUSED_LM_LOSS_ROOT=$([ "$side" = this ] || echo "$PWD/$side") timeout "${AB_TIMEOUT:-120}" \
                python3 benchmarks/bench_lm_loss.py $AB_FLAGS --out "$OUT/$name" > "$OUT/$name.log" 2>&1
            echo "$name exited $?"
            grep -E "\| (floor|fused[a-z_]*) \|" "$OUT/$name/table.md" 2>/dev/null | cut -d'|' -f2,7-10
        done
    done
fi
if [ "${BENCH:-1}" != 0 ]; then
    BENCH_FLAGS=${BENCH_FLAGS:-"--shapes llama3-8b,llama3-8b-32k,qwen2.5-7b,gemma2-2b,qwen2.5-0.5b --peers-main-only --budget-ms 800"}
    # shellcheck disable=SC2086
    timeout "${BENCH_TIMEOUT:-400}" python3 benchmarks/bench_lm_loss.py $BENCH_FLAGS --out "$OUT" > "$OUT/bench.log" 2>&1
    echo "bench_lm_loss exited $?"
    grep "unavailable\|^{\"date" "$OUT/bench.log" | cut -c1-300
    cat "$OUT/table.md" 2>/dev/null || tail -n 40 "$OUT/bench.log"
fi
if [ -n "${TESTS_AFTER:-}" ]; then
    # shellcheck disable=SC2086
    run_tests tests_after.log "${TEST_AFTER_TIMEOUT:-100}" $TESTS_AFTER
fi
