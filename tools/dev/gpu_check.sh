#!/usr/bin/env bash
# Issue 43's prepared GPU check: one device-machine call, at most BUDGET_S (default 480) seconds of work.
#   OUT=dir [COMMIT=sha] bash tools/dev/gpu_check.sh          # on the GPU machine, repository root
#   DRY=1 OUT=dir bash tools/dev/gpu_check.sh                 # the rehearsal: every step at toy sizes on a CPU
# Records the device and versions first, then runs the steps in priority order, each under its own timeout
# (NAME_S overrides a step's, e.g. BENCH_1B_S=150; never past the budget), its output in $OUT/NAME.log.
# $OUT/summary.json (tools/dev/gpu_summary.py) is rewritten after every step, so a call cut short keeps it.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, installed or not
OUT=${OUT:-/tmp/gpu_check}; DRY=${DRY:-0}; BUDGET_S=${BUDGET_S:-480}; PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"; rm -f "$OUT/steps.jsonl"
summary() { "$PYTHON" tools/dev/gpu_summary.py "$OUT" "$@"; }

# step NAME CAP_S COMMAND...: COMMAND under min(${NAME}_S or CAP_S, the budget left), then recorded
step() {
  local name=$1 cap_var="${1^^}_S" cap=$2 limit start rc status
  [ "$DRY" = 1 ] && cap=120  # a toy step on a shared CPU: its GPU limit means nothing there
  limit=${!cap_var:-$cap}; shift 2
  (( limit > BUDGET_S - SECONDS )) && limit=$((BUDGET_S - SECONDS))
  if (( limit < 1 )); then
    summary record "$name" skipped --note "${limit} s left for it (BUDGET_S=$BUDGET_S, $cap_var=${!cap_var:-$cap})"
    return
  fi
  echo "== $name (at most ${limit} s): $*"
  start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1; rc=$?
  case $rc in 0) status=ok ;; 124|137) status="timed out" ;; *) status=failed ;; esac
  tail -n 3 "$OUT/$name.log"
  summary record "$name" "$status" --seconds $((SECONDS - start)) --rc "$rc" --limit "$limit" --command "$*"
}

if [ "$DRY" = 1 ]; then  # toy sizes on the CPU: proves every command line and the summary, measures nothing
  # --compile traced by dynamo and AOTAutograd without Inductor's C++ build (the suite's choice too: minutes on a CPU)
  export TORCH_COMPILE_OVERRIDE_BACKENDS="${TORCH_COMPILE_OVERRIDE_BACKENDS->=0:aot_eager}"
  GPU_TESTS=(tests/test_gpu_training.py -n 0)
  TINY=(--model tiny --num-layers 1 --hidden-size 64 --ffn-hidden-size 176 --num-attention-heads 2
        --num-query-groups 2 --vocab-size 256 --seq-length 32)
  BENCH=(--config preset "${TINY[@]}" --micro-batch-size 2 --device cpu --dtype fp32 --modes eager
         --iters 1 --rounds 1 --warmup-iters 1)
  PRETRAIN=("${TINY[@]}" --micro-batch-size 2 --global-batch-size 4 --train-iters 2 --log-interval 1)
  KERNELS=(--device cpu --sizes tiny --no-compile --repeats 1)
  PROFILE=("${BENCH[@]}")
  MOE=(--model tiny-moe --num-layers 1 --vocab-size 256 --seq-length 32 --micro-batch-size 2 --global-batch-size 2
       --train-iters 2 --log-interval 1)
  CP=(--cp 2 --seq-length 8 --heads 2 --groups 1 --head-dim 4 --iters 1 --warmup-iters 0)
  SUITE=(tests/test_scripts.py -k bash_parses -n 0)
else
  GPU_TESTS=(-n 0)
  BENCH=(--config 1B --device cuda --dtype bf16 --iters 8 --rounds 3)
  PRETRAIN=(--model llama-1b --seq-length 2048 --micro-batch-size 4 --global-batch-size 64 --bf16
            --use-distributed-optimizer --vocab-size 32000 --train-iters 8 --log-interval 4)
  KERNELS=(--sizes 1b 8b)
  PROFILE=(--config 1B --device cuda --dtype bf16 --modes eager --iters 1 --rounds 1 --warmup-iters 1)
  MOE=(--model tiny-moe --bf16 --vocab-size 32000 --seq-length 2048 --micro-batch-size 4 --global-batch-size 8
       --train-iters 6 --log-interval 3)
  CP=(--seq-length 8192 --iters 5)
  SUITE=(-n "${WORKERS:-14}" --dist load)
fi
MOCK=(--mock-data --tokenizer-type NullTokenizer --eval-iters 0)
PYTEST=("$PYTHON" -m pytest -v -p no:cacheprovider -p no:benchmark)

summary start --dry "$DRY" --budget "$BUDGET_S" || exit 1  # the device, versions and commit, before anything can fail
step gpu_tests 60 "${PYTEST[@]}" -m gpu "${GPU_TESTS[@]}" --junitxml="$OUT/gpu_tests.xml"
step bench_1b 150 "$PYTHON" tools/bench/train_throughput.py "${BENCH[@]}" --peers hf,minimal --json "$OUT/bench_1b.json"
step pretrain_eager 45 "$PYTHON" pretrain_gpt.py "${PRETRAIN[@]}" "${MOCK[@]}"
step pretrain_compile 70 "$PYTHON" pretrain_gpt.py "${PRETRAIN[@]}" "${MOCK[@]}" --compile
step kernels 50 "$PYTHON" tools/bench/kernels.py "${KERNELS[@]}" --json "$OUT/kernels.json"
# one 1B step of megalite (and the minimal peer: the bench needs one), eager: where the GPU time goes
step profile_1b 30 "$PYTHON" tools/bench/train_throughput.py "${PROFILE[@]}" --peers minimal \
  --hf-iters 1 --hf-warmup-iters 1 --profile 25 --json "$OUT/profile_1b.json"
step moe_loop 15 "$PYTHON" pretrain_gpt.py "${MOE[@]}" "${MOCK[@]}"
step moe_grouped 15 "$PYTHON" pretrain_gpt.py "${MOE[@]}" "${MOCK[@]}" --moe-grouped-gemm
step cp_attention 35 "$PYTHON" tools/bench/cp_attention.py "${CP[@]}"
# pretrain_eager's run without gradient-accumulation fusion (its default): what the fusion is worth here
step pretrain_unfused 45 "$PYTHON" pretrain_gpt.py "${PRETRAIN[@]}" "${MOCK[@]}" --no-gradient-accumulation-fusion
step suite "$BUDGET_S" "${PYTEST[@]}" -m "not gpu" "${SUITE[@]}" --junitxml="$OUT/suite.xml"
echo "== $OUT/summary.json"; cat "$OUT/summary.json"
