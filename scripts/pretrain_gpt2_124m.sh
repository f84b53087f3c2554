#!/usr/bin/env bash
# GPT-2 small (124M) on one node of 8 GPUs, with the recipe of nanoGPT / llm.c's GPT-2 runs:
# sequence 1024, 512 x 1024 = 0.5M tokens per batch, 19073 iterations (10B tokens), AdamW
# (0.9, 0.95, weight decay 0.1), lr 6e-4 with 700 warm-up iterations and cosine decay to 6e-5,
# grad clipping 1.0, bf16, no dropout (GPT-2's 0.1 helps fine-tuning, not large-data pretraining).
#
# Layout: DP=8 (the model fits one GPU many times over) with the distributed optimizer; the
# dry run (DRY_RUN=1) gives about 13 GiB per GPU at micro-batch 32, mostly activations.
#
#   scripts/pretrain_gpt2_124m.sh
#   GPUS_PER_NODE=1 scripts/pretrain_gpt2_124m.sh          # one GPU: 16 micro-batches of 32 per iteration
#   DRY_RUN=1 scripts/pretrain_gpt2_124m.sh                # each rank's memory; no GPU needed
#
# Data: GPT-2's tokenizer as a local Hugging Face folder (e.g. `huggingface-cli download gpt2
# --local-dir tokenizers/gpt2`) and token files from
#   python tools/preprocess_data.py --input corpus/*.jsonl --output-prefix data/gpt2 \
#       --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizers/gpt2 --append-eod --workers 32
#
# Environment overrides (default):
#   DATA_PATH (data/gpt2_text_document), TOKENIZER_TYPE (HuggingFaceTokenizer), TOKENIZER_MODEL (tokenizers/gpt2),
#   SAVE_DIR (checkpoints/gpt2-124m), LOAD_DIR (SAVE_DIR)
#   TP (1), PP (1); DP is what remains: NNODES x GPUS_PER_NODE / (TP x PP)
#   MICRO_BATCH_SIZE (32), GLOBAL_BATCH_SIZE (512), TRAIN_ITERS (19073), LR (6e-4), MIN_LR (6e-5),
#   WARMUP_ITERS (700), RECOMPUTE (none; selective or full)
#   LOG_INTERVAL (10), EVAL_INTERVAL (250), EVAL_ITERS (20), SAVE_INTERVAL (1000), EXIT_DURATION_MINS (none)
#   and the launcher's (scripts/launch.sh): GPUS_PER_NODE (8), NNODES (1), NODE_RANK, MASTER_ADDR,
#   MASTER_PORT, DRY_RUN, PYTHON, OMP_NUM_THREADS; CUDA_DEVICE_MAX_CONNECTIONS=1 is set when TP > 1
set -euo pipefail
# shellcheck source=scripts/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/launch.sh"

TP=${TP:-1}
PP=${PP:-1}
PROCS_PER_NODE=${GPUS_PER_NODE:-8}
SAVE_DIR=${SAVE_DIR:-checkpoints/gpt2-124m}

args=(
  --model gpt2-124m --hidden-dropout 0.0 --attention-dropout 0.0
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  --use-distributed-optimizer --overlap-grad-reduce --bf16
  --micro-batch-size "${MICRO_BATCH_SIZE:-32}" --global-batch-size "${GLOBAL_BATCH_SIZE:-512}"
  --train-iters "${TRAIN_ITERS:-19073}"
  --lr "${LR:-6e-4}" --min-lr "${MIN_LR:-6e-5}" --lr-decay-style cosine --lr-warmup-iters "${WARMUP_ITERS:-700}"
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0
  --data-path "${DATA_PATH:-data/gpt2_text_document}" --split "969,30,1"
  --tokenizer-type "${TOKENIZER_TYPE:-HuggingFaceTokenizer}" --tokenizer-model "${TOKENIZER_MODEL:-tokenizers/gpt2}"
  --save "$SAVE_DIR" --load "${LOAD_DIR:-$SAVE_DIR}" --save-interval "${SAVE_INTERVAL:-1000}" --exit-signal-handler
  --log-interval "${LOG_INTERVAL:-10}" --eval-interval "${EVAL_INTERVAL:-250}" --eval-iters "${EVAL_ITERS:-20}"
)
megalite_gpu_options "$@"
megalite_launch "${args[@]}" "$@"
