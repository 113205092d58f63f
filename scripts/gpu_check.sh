#!/bin/bash
# The GPU checks of issues 22 and 23 on a bare GPU machine: the gpu tests, then the GPU benchmark.
#
# The machine needs torch, triton and transformers; the rest travel as wheels in .whl/ (see
# docs/benchmarks.md, "GPU: how to run it"), the default model's tokenizer in .gpu/tok/ (its
# tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json). Writes the
# logs and the benchmark's report under $OUT (default /tmp/out).
#   TEST_S, BENCH_S: time limits of the two parts, seconds (default 210 and 330; 0 skips the part)
#   TEST_ARGS: what pytest runs, in order (default: tests/worker)
#   PROFILE_S: with a time limit (seconds), torch's profiler on rank 0 over batch-16 guided and
#     unguided fused EAGLE steps first (scripts/gpu_profile_eagle.py; gzipped traces in $OUT/prof;
#     the device tool brings back 8 files at most: with it, BENCH_S=0 or fewer variants)
#   BENCH_ARGS: extra arguments for benchmarks/gpu.py; default: the grammar's share of a
#     batch-16 EAGLE step, fused / fused with unmasked drafts / draft steps only
#     (the whole call fits a 15-minute device budget; BENCH_ARGS="" runs every section)
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 GUIDESPEC_TOKENIZER_DIR=${GUIDESPEC_TOKENIZER_DIR:-$PWD/.gpu/tok}
OUT=${OUT:-/tmp/out}
BENCH_ARGS=${BENCH_ARGS-"--skip default eager guided spec mask --batch-sizes 16 --eagle-variants fused fused-unmasked draft-graph"}
mkdir -p "$OUT"
set -o pipefail
if [ "${PROFILE_S:-0}" != 0 ]; then
    echo "=== scripts/gpu_profile_eagle.py"
    start=$SECONDS
    GUIDESPEC_TORCH_PROFILER_DIR=/tmp/wprof OUT="$OUT/prof" timeout -k 5 "$PROFILE_S" python3 scripts/gpu_profile_eagle.py \
        >"$OUT/profile.log" 2>&1
    echo "profile rc=$? in $((SECONDS - start)) s"
    tail -5 "$OUT/profile.log"
fi
if [ "${TEST_S:-210}" != 0 ]; then
    echo "=== pytest -m gpu ${TEST_ARGS:-tests/worker}"
    start=$SECONDS
    timeout -k 5 "${TEST_S:-210}" python3 -m pytest -m gpu -rs -v -p no:cacheprovider -o timeout=180 ${TEST_ARGS:-tests/worker} 2>&1 \
        | tee "$OUT/pytest.log" | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" | tail -20
    echo "pytest rc=$? in $((SECONDS - start)) s"
fi
[ "${BENCH_S:-330}" = 0 ] && exit 0
echo "=== benchmarks/gpu.py"
start=$SECONDS
# shellcheck disable=SC2086
timeout -k 5 "${BENCH_S:-330}" python3 -m benchmarks.gpu --device cuda --preset smollm2-135m --batch-sizes 1 16 64 \
    --max-tokens 128 --tokenizer-from "$GUIDESPEC_TOKENIZER_DIR" --work-dir /tmp/gpu-model --output "$OUT/bench" \
    --trace-dir "$OUT/trace" \
    $BENCH_ARGS >"$OUT/bench.log" 2>&1
echo "bench rc=$? in $((SECONDS - start)) s"
grep -E "^\[|FAILED|Error" "$OUT/bench.log" | tail -40
cat "$OUT/bench/gpu.md" 2>/dev/null
