#!/usr/bin/env bash
# One device-machine call: the suite with CUDA present, then the 1B throughput figures.
# Usage (on the GPU machine, repository root): OUT=dir bash tools/dev/gpu_check.sh [tests|bench|all]
# Full logs go to $OUT; failures and summaries print.
set -u
export PYTHONUNBUFFERED=1
what=${1:-all}
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
summary='(passed|failed|FAILED|ERROR|gpu-marked|Timeout|SKIPPED)'
# The suite needs this checkout installed (tests/conftest.py); offline, so no build isolation.
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout "${GPU_TESTS_S:-150}" python3 -m pytest -q -m gpu -n 0 --timeout 120 -p no:benchmark 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "$summary"
  # the rest in parallel; -v prints each outcome as it lands, so a cut-off run still names its failures
  timeout "${CPU_TESTS_S:-230}" python3 -m pytest -v -m "not gpu" -n "${WORKERS:-14}" --dist load --timeout 150 -p no:benchmark 2>&1 \
    | tee "$OUT/suite.log" | grep -E "$summary" | grep -v " PASSED "
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout "${BENCH_S:-170}" python3 tools/bench/train_throughput.py --device cuda --config 1B --dtype bf16 \
    --iters 8 --rounds 3 --peers hf,minimal 2>&1 | tee "$OUT/bench.log" | tail -25
fi
