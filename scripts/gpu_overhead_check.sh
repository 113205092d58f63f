#!/bin/bash
# Issue 48's GPU checks in one device call (carry .whl and .gpu: scripts/gpu_carry.sh first): gpu tests touching the changed paths, overhead.py on SmolLM2-135M's
# shape (overlap on / off), then Llama-3.1-8B's shape at batch 1. Everything lands in $OUT/r.tgz + logs.
# Knobs: TEST_S, TEST_K (the gpu tests), OVH_S, OVH_REPEAT (default 1 round: the device time is short), SCHED, BIG_S,
# OVH_MODES (default unguided,json-noclose; add json+ngram for the draft gate: an engine of its own, ~30 s more).
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 GUIDESPEC_TOKENIZER_DIR=$PWD/.gpu/tok
mkdir -p "$OUT/r"
nvidia-smi --query-gpu=name,memory.total --format=csv | tail -1
t0=$SECONDS
echo "=== tests"
timeout -k 5 ${TEST_S:-170} python3 -m pytest -m gpu -rs -v -p no:cacheprovider -o timeout=160 tests/worker/test_gpu.py \
  -k "${TEST_K:-padded_forward or greedy_output or graphs_equal_eager or bf16_default or speculative_greedy}" 2>&1 \
  | tee "$OUT/r/pytest.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -12
echo "tests done at $((SECONDS - t0)) s"
python3 -m benchmarks.random_model --preset smollm2-135m --output /tmp/m135 --tokenizer-from .gpu/tok >/dev/null 2>&1
echo "=== 135M overhead"
timeout -k 5 ${OVH_S:-200} python3 benchmarks/overhead.py --device cuda --model /tmp/m135 --batches 1,16,64 \
  --modes ${OVH_MODES:-unguided,json-noclose} --max-tokens 128 --repeat ${OVH_REPEAT:-1} --scheduling ${SCHED:-async,async-serial-worker} > "$OUT/r/ovh135.log" 2>&1
echo "rc=$? at $((SECONDS - t0)) s"; grep -E "^\| (unguided|json)" "$OUT/r/ovh135.log" | cut -c1-200
mv benchmarks/results/overhead-cuda-* "$OUT/r/" 2>/dev/null
if [ "${BIG_S:-200}" != 0 ]; then
  echo "=== 8B"
  timeout -k 5 ${BIG_S:-200} bash -c "python3 -m benchmarks.random_model --preset llama-3.1-8b --output /tmp/m8b --tokenizer-from .gpu/tok && \
    python3 benchmarks/overhead.py --device cuda --model /tmp/m8b --batches 1 --modes unguided --max-tokens 64 --repeat 1 --scheduling async" > "$OUT/r/ovh8b.log" 2>&1
  echo "rc=$? at $((SECONDS - t0)) s"; grep -E "^\| unguided|built" "$OUT/r/ovh8b.log" | cut -c1-200
  mkdir -p "$OUT/r/8b"; mv benchmarks/results/overhead-cuda-* "$OUT/r/8b/" 2>/dev/null
fi
tar czf "$OUT/r.tgz" -C "$OUT" r && rm -rf "$OUT/r"
echo "all done at $((SECONDS - t0)) s"
