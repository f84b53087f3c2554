# shellcheck shell=bash
# The launch step the scripts in this folder share. Sourced, not run:
#
#   source "$(dirname "${BASH_SOURCE[0]}")/launch.sh"
#   PROCS_PER_NODE=8 megalite_launch --model llama2-7b ... "$@"
#
# megalite_launch prints the command, then runs pretrain_gpt.py with the given arguments
# on NNODES x PROCS_PER_NODE processes under torchrun. What it reads from the environment:
#
#   NNODES          machines (default 1)
#   NODE_RANK, MASTER_ADDR, MASTER_PORT
#                   this machine's index and the rendezvous host:port (defaults 0, localhost,
#                   6000); on one machine with MASTER_PORT unset, torchrun --standalone picks a
#                   free port instead
#   RDZV_ENDPOINT, RDZV_ID
#                   host:port and job id of torchrun's c10d rendezvous, used instead of
#                   NODE_RANK / MASTER_ADDR when set (slurm/pretrain.sbatch sets them)
#   DRY_RUN=1       run `pretrain_gpt.py ... --dry-run --world-size NNODES*PROCS_PER_NODE` once,
#                   with plain python: the plan of every rank, no GPU and no data needed.
#                   Passing --dry-run (and optionally --world-size N) as an argument does the same.
#   PYTHON          the interpreter (default python)
#   TORCHRUN        the launcher (default torchrun, else $PYTHON -m torch.distributed.run)
#   OMP_NUM_THREADS default: this machine's cores / PROCS_PER_NODE (at least 1)
#   CUDA_DEVICE_MAX_CONNECTIONS
#                   default 1 when --tensor-model-parallel-size is above 1, as Megatron sets it
#                   (kernels and tensor-parallel collectives then start in issue order)

MEGALITE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# The value of the last --tensor-model-parallel-size in the arguments (argparse keeps the last), or 1.
megalite_tensor_parallel_size() {
  local tp=1
  while (($# > 0)); do
    if [[ $1 == --tensor-model-parallel-size && $# -gt 1 ]]; then
      tp=$2
    fi
    shift
  done
  echo "$tp"
}

# Whether the arguments hold the flag $1.
megalite_has_flag() {
  local flag=$1 arg
  shift
  for arg in "$@"; do
    [[ $arg == "$flag" ]] && return 0
  done
  return 1
}

# The arguments as one line a shell reads back the same (plain words stay unquoted).
megalite_quote() {
  local arg line=""
  for arg in "$@"; do
    if [[ $arg =~ ^[A-Za-z0-9_./=:,@+%-]+$ ]]; then
      line+="$arg "
    else
      line+="$(printf '%q' "$arg") "
    fi
  done
  echo "${line% }"
}

megalite_launch() {
  local nnodes=${NNODES:-1} per_node=${PROCS_PER_NODE:?PROCS_PER_NODE must be set by the calling script}
  local python=${PYTHON:-python}
  local -a command
  if [[ ${DRY_RUN:-0} == 1 ]] || megalite_has_flag --dry-run "$@"; then
    command=("$python" "$MEGALITE_ROOT/pretrain_gpt.py" "$@")
    megalite_has_flag --dry-run "$@" || command+=(--dry-run)
    megalite_has_flag --world-size "$@" || command+=(--world-size "$((nnodes * per_node))")
  else
    local -a launcher rendezvous
    if [[ -n ${TORCHRUN:-} ]]; then
      read -r -a launcher <<<"$TORCHRUN"
    elif command -v torchrun >/dev/null 2>&1; then
      launcher=(torchrun)
    else
      launcher=("$python" -m torch.distributed.run)
    fi
    if [[ -n ${RDZV_ENDPOINT:-} ]]; then
      rendezvous=(--rdzv_backend c10d --rdzv_endpoint "$RDZV_ENDPOINT" --rdzv_id "${RDZV_ID:-megalite}")
    elif ((nnodes == 1)) && [[ -z ${MASTER_PORT:-} ]]; then
      rendezvous=(--standalone)
    else
      rendezvous=(--node_rank "${NODE_RANK:-0}" --master_addr "${MASTER_ADDR:-localhost}"
        --master_port "${MASTER_PORT:-6000}")
    fi
    local cores
    cores=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((cores / per_node > 0 ? cores / per_node : 1))}
    if (($(megalite_tensor_parallel_size "$@") > 1)); then
      export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
    fi
    command=("${launcher[@]}" --nnodes "$nnodes" --nproc_per_node "$per_node" "${rendezvous[@]}"
      "$MEGALITE_ROOT/pretrain_gpt.py" "$@")
    echo "environment: OMP_NUM_THREADS=$OMP_NUM_THREADS CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-unset}"
  fi
  echo "command: $(megalite_quote "${command[@]}")"
  "${command[@]}"
}

# Appends to the calling script's `args` array the options the GPU scripts share, read from
# the environment: --sequence-parallel when the tensor-parallel size (in args or in the
# script's own arguments, "$@") is above 1, RECOMPUTE=selective|full (none: off) and
# EXIT_DURATION_MINS=M (stop and save after M minutes, e.g. before a SLURM time limit).
# The script's own arguments come after args on the command line, so they still win.
megalite_gpu_options() {
  if (($(megalite_tensor_parallel_size "${args[@]}" "$@") > 1)); then
    args+=(--sequence-parallel)
  fi
  if [[ -n ${RECOMPUTE:-} && ${RECOMPUTE} != none ]]; then
    args+=(--recompute-granularity "$RECOMPUTE")
  fi
  if [[ -n ${EXIT_DURATION_MINS:-} ]]; then
    args+=(--exit-duration-in-mins "$EXIT_DURATION_MINS")
  fi
}
