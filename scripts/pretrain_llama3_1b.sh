#!/usr/bin/env bash
# Llama 3.2 1B (the `llama3.2-1b` preset: 16 layers, hidden 2048, GQA with 8 key/value heads,
# vocabulary 128256, tied embeddings) on one node of 8 x 80 GB GPUs, from scratch in the LLaMA
# style: sequence 8192, 512 x 8192 = 4M tokens per batch, AdamW (0.9, 0.95, eps 1e-5, weight
# decay 0.1), lr 3e-4 with 2000 warm-up iterations and cosine decay to 3e-5, grad clipping 1.0,
# bf16. TRAIN_ITERS 25000 is about 100B tokens; set your own budget (Meta's model saw up to 9T
# tokens and was distilled from larger models, which this recipe does not do).
#
# Layout: DP=8 with the distributed optimizer; the dry run (DRY_RUN=1) gives about 32 GiB per
# GPU at micro-batch 2, of which 24 GiB are activations (the bf16 logits over the 128k vocabulary
# alone are 2 GiB per sequence); RECOMPUTE=full cuts the layers' share if you raise the micro-batch.
#
#   scripts/pretrain_llama3_1b.sh
#   MICRO_BATCH_SIZE=1 scripts/pretrain_llama3_1b.sh --log-interval 1   # extra arguments go to pretrain_gpt.py
#   DRY_RUN=1 scripts/pretrain_llama3_1b.sh                             # each rank's memory; no GPU needed
#
# Data: the Llama 3 tokenizer as a local Hugging Face folder (tokenizer.json, from the
# meta-llama/Llama-3.2-1B repository) and token files from
#   python tools/preprocess_data.py --input corpus/*.jsonl --output-prefix data/llama3 \
#       --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizers/llama3 --append-eod --workers 32
#
# Environment overrides (default):
#   DATA_PATH (data/llama3_text_document), TOKENIZER_TYPE (HuggingFaceTokenizer), TOKENIZER_MODEL (tokenizers/llama3),
#   SAVE_DIR (checkpoints/llama3.2-1b), LOAD_DIR (SAVE_DIR)
#   TP (1), PP (1); DP is what remains: NNODES x GPUS_PER_NODE / (TP x PP)
#   MICRO_BATCH_SIZE (2), GLOBAL_BATCH_SIZE (512), SEQ_LENGTH (8192), TRAIN_ITERS (25000),
#   LR (3e-4), MIN_LR (3e-5), WARMUP_ITERS (2000), RECOMPUTE (none; selective or full)
#   LOG_INTERVAL (10), EVAL_INTERVAL (1000), EVAL_ITERS (20), SAVE_INTERVAL (1000), EXIT_DURATION_MINS (none)
#   and the launcher's (scripts/launch.sh): GPUS_PER_NODE (8), NNODES (1), NODE_RANK, MASTER_ADDR,
#   MASTER_PORT, DRY_RUN, PYTHON, OMP_NUM_THREADS; CUDA_DEVICE_MAX_CONNECTIONS=1 is set when TP > 1
set -euo pipefail
# shellcheck source=scripts/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/launch.sh"

TP=${TP:-1}
PP=${PP:-1}
PROCS_PER_NODE=${GPUS_PER_NODE:-8}
SAVE_DIR=${SAVE_DIR:-checkpoints/llama3.2-1b}

args=(
  --model llama3.2-1b --seq-length "${SEQ_LENGTH:-8192}"
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  --use-distributed-optimizer --overlap-grad-reduce --bf16
  --micro-batch-size "${MICRO_BATCH_SIZE:-2}" --global-batch-size "${GLOBAL_BATCH_SIZE:-512}"
  --train-iters "${TRAIN_ITERS:-25000}"
  --lr "${LR:-3e-4}" --min-lr "${MIN_LR:-3e-5}" --lr-decay-style cosine --lr-warmup-iters "${WARMUP_ITERS:-2000}"
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 --clip-grad 1.0
  --data-path "${DATA_PATH:-data/llama3_text_document}" --split "969,30,1"
  --tokenizer-type "${TOKENIZER_TYPE:-HuggingFaceTokenizer}" --tokenizer-model "${TOKENIZER_MODEL:-tokenizers/llama3}"
  --save "$SAVE_DIR" --load "${LOAD_DIR:-$SAVE_DIR}" --save-interval "${SAVE_INTERVAL:-1000}" --exit-signal-handler
  --log-interval "${LOG_INTERVAL:-10}" --eval-interval "${EVAL_INTERVAL:-1000}" --eval-iters "${EVAL_ITERS:-20}"
)
megalite_gpu_options "$@"
megalite_launch "${args[@]}" "$@"
