#!/usr/bin/env bash
# megalite's parallelism on a laptop: the tiny LLaMA-style model (7.1M parameters) on the
# built-in corpus, 4 CPU processes as TP=2 x PP=2 (gloo), sequence parallelism on.
# 100 iterations; measured on 2 shared cores: 7.5 minutes (about 4 s per iteration, fewer with
# more cores), the loss falling from 9.0 (ln 8192) to 4.7, validation 5.2.
#
#   scripts/pretrain_cpu_demo.sh
#   TRAIN_ITERS=20 scripts/pretrain_cpu_demo.sh --log-interval 1   # extra arguments go to pretrain_gpt.py
#   DRY_RUN=1 scripts/pretrain_cpu_demo.sh                         # print each rank's plan and exit
#
# Environment overrides (default):
#   MODEL (tiny; tiny-moe: 8 experts, top-2, a shared expert, about tiny's active parameters)
#   TP (2), PP (2), NPROC (TP x PP; a multiple of it adds data parallelism)
#   TRAIN_ITERS (100), MICRO_BATCH_SIZE (4), GLOBAL_BATCH_SIZE (16), LR (1e-3), MIN_LR (1e-4)
#   LOG_INTERVAL (10), EVAL_INTERVAL (50), EVAL_ITERS (5), SAVE_DIR (runs/cpu_demo)
#   DATA_PATH, TOKENIZER_MODEL, TOKENIZER_TYPE (SentencePieceTokenizer): other token files
#     instead of the built-in corpus (which is built on first use, about 15 s)
#   and the launcher's (scripts/launch.sh): DRY_RUN, PYTHON, OMP_NUM_THREADS (cores / NPROC)
set -euo pipefail
# shellcheck source=scripts/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/launch.sh"

TP=${TP:-2}
PP=${PP:-2}
PROCS_PER_NODE=${NPROC:-$((TP * PP))}
TRAIN_ITERS=${TRAIN_ITERS:-100}

args=(
  --model "${MODEL:-tiny}"
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  --micro-batch-size "${MICRO_BATCH_SIZE:-4}" --global-batch-size "${GLOBAL_BATCH_SIZE:-16}"
  --train-iters "$TRAIN_ITERS" --lr "${LR:-1e-3}" --min-lr "${MIN_LR:-1e-4}" --lr-decay-style cosine
  --lr-warmup-iters "$((TRAIN_ITERS / 10))"
  --log-interval "${LOG_INTERVAL:-10}" --eval-interval "${EVAL_INTERVAL:-50}" --eval-iters "${EVAL_ITERS:-5}"
  --save "${SAVE_DIR:-runs/cpu_demo}"
  --distributed-backend gloo # CPU processes, even on a machine with a GPU
)
if ((TP > 1)); then
  args+=(--sequence-parallel)
fi
if [[ -n ${DATA_PATH:-} ]]; then
  args+=(--data-path "$DATA_PATH" --tokenizer-type "${TOKENIZER_TYPE:-SentencePieceTokenizer}"
    --tokenizer-model "${TOKENIZER_MODEL:?TOKENIZER_MODEL must be set with DATA_PATH}")
fi

megalite_launch "${args[@]}" "$@"
