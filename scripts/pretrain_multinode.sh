#!/usr/bin/env bash
# A model script (default: pretrain_llama2_7b.sh) across several machines with torchrun.
# Run the same command on every machine, each with its own NODE_RANK:
#
#   NNODES=8 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=6000 scripts/pretrain_multinode.sh   # on node0
#   NNODES=8 NODE_RANK=1 MASTER_ADDR=node0 MASTER_PORT=6000 scripts/pretrain_multinode.sh   # on node1 ...
#
# Each machine starts GPUS_PER_NODE ranks; the world is NNODES x GPUS_PER_NODE and data
# parallelism is what remains after TP x PP. The model script's overrides apply (TP, PP,
# MICRO_BATCH_SIZE, DATA_PATH, ...; see its header), and extra arguments go to pretrain_gpt.py.
# Plan a layout before booking the machines (no GPU needed), e.g. 64 ranks = TP 8 x PP 2 x DP 4:
#
#   DRY_RUN=1 NNODES=8 TP=8 PP=2 scripts/pretrain_multinode.sh
#
# Environment (default): NNODES (required), NODE_RANK and MASTER_ADDR (required unless DRY_RUN=1),
#   MASTER_PORT (6000), GPUS_PER_NODE (8), MODEL_SCRIPT (pretrain_llama2_7b.sh: a name in this folder, or a path).
# Data paths, the tokenizer and SAVE_DIR must be on storage every machine sees.
set -euo pipefail

: "${NNODES:?set NNODES to the number of machines}"
if [[ ${DRY_RUN:-0} != 1 ]]; then
  : "${NODE_RANK:?set NODE_RANK to this machine\'s index, 0 to NNODES-1}"
  : "${MASTER_ADDR:?set MASTER_ADDR to the address of the machine with NODE_RANK 0}"
fi
export NNODES NODE_RANK MASTER_ADDR
export MASTER_PORT=${MASTER_PORT:-6000}
export GPUS_PER_NODE=${GPUS_PER_NODE:-8}

model_script=${MODEL_SCRIPT:-pretrain_llama2_7b.sh}
[[ $model_script == */* ]] || model_script="$(dirname "${BASH_SOURCE[0]}")/$model_script"
exec bash "$model_script" "$@"
