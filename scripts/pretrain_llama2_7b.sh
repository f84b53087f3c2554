#!/usr/bin/env bash
# LLaMA-2 7B on one node of 8 x 80 GB GPUs, with LLaMA-2's published recipe: sequence 4096,
# 1024 x 4096 = 4M tokens per batch, AdamW (0.9, 0.95, eps 1e-5, weight decay 0.1),
# lr 3e-4 with 2000 warm-up iterations and cosine decay to 3e-5, grad clipping 1.0, bf16.
#
# Layout: TP=2 with sequence parallelism x DP=4 with the distributed optimizer. The dry run
# (DRY_RUN=1) gives about 38 GiB per GPU (6.3 params, 12.6 fp32 grads, 9.4 optimizer shard,
# 10.2 activations at micro-batch 1): room to spare. TP=1 x DP=8 would need about 65 GiB,
# too close to 80 GB; TP=8 (18 GiB) or TP=4 x PP=2 (20 GiB) fit too but spend more time in
# tensor-parallel communication. More nodes: scripts/pretrain_multinode.sh.
#
#   scripts/pretrain_llama2_7b.sh
#   TP=8 MICRO_BATCH_SIZE=2 scripts/pretrain_llama2_7b.sh --log-interval 1   # extra arguments go to pretrain_gpt.py
#   DRY_RUN=1 scripts/pretrain_llama2_7b.sh                                  # each rank's memory; no GPU needed
#
# Data: LLaMA-2's SentencePiece tokenizer (tokenizer.model from Meta) and token files from
#   python tools/preprocess_data.py --input corpus/*.jsonl --output-prefix data/llama2 \
#       --tokenizer-type Llama2Tokenizer --tokenizer-model tokenizers/llama2/tokenizer.model --append-eod --workers 32
#
# Environment overrides (default):
#   DATA_PATH (data/llama2_text_document), TOKENIZER_TYPE (Llama2Tokenizer),
#   TOKENIZER_MODEL (tokenizers/llama2/tokenizer.model), SAVE_DIR (checkpoints/llama2-7b), LOAD_DIR (SAVE_DIR)
#   TP (2), PP (1); DP is what remains: NNODES x GPUS_PER_NODE / (TP x PP)
#   MICRO_BATCH_SIZE (1), GLOBAL_BATCH_SIZE (1024), SEQ_LENGTH (4096), TRAIN_ITERS (500000: 2.1T tokens)
#   LR (3e-4), MIN_LR (3e-5), WARMUP_ITERS (2000), RECOMPUTE (none; selective or full)
#   LOG_INTERVAL (10), EVAL_INTERVAL (2000), EVAL_ITERS (20), SAVE_INTERVAL (1000), EXIT_DURATION_MINS (none)
#   and the launcher's (scripts/launch.sh): GPUS_PER_NODE (8), NNODES (1), NODE_RANK, MASTER_ADDR,
#   MASTER_PORT, DRY_RUN, PYTHON, OMP_NUM_THREADS; CUDA_DEVICE_MAX_CONNECTIONS=1 is set when TP > 1
set -euo pipefail
# shellcheck source=scripts/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/launch.sh"

TP=${TP:-2}
PP=${PP:-1}
PROCS_PER_NODE=${GPUS_PER_NODE:-8}
SAVE_DIR=${SAVE_DIR:-checkpoints/llama2-7b}

args=(
  --model llama2-7b --seq-length "${SEQ_LENGTH:-4096}"
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  --use-distributed-optimizer --overlap-grad-reduce --bf16
  --micro-batch-size "${MICRO_BATCH_SIZE:-1}" --global-batch-size "${GLOBAL_BATCH_SIZE:-1024}"
  --train-iters "${TRAIN_ITERS:-500000}"
  --lr "${LR:-3e-4}" --min-lr "${MIN_LR:-3e-5}" --lr-decay-style cosine --lr-warmup-iters "${WARMUP_ITERS:-2000}"
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 --clip-grad 1.0
  --data-path "${DATA_PATH:-data/llama2_text_document}" --split "969,30,1"
  --tokenizer-type "${TOKENIZER_TYPE:-Llama2Tokenizer}"
  --tokenizer-model "${TOKENIZER_MODEL:-tokenizers/llama2/tokenizer.model}"
  --save "$SAVE_DIR" --load "${LOAD_DIR:-$SAVE_DIR}" --save-interval "${SAVE_INTERVAL:-1000}" --exit-signal-handler
  --log-interval "${LOG_INTERVAL:-10}" --eval-interval "${EVAL_INTERVAL:-2000}" --eval-iters "${EVAL_ITERS:-20}"
)
megalite_gpu_options "$@"
megalite_launch "${args[@]}" "$@"
