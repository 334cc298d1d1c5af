#!/usr/bin/env bash
# One 8-GPU node: the vLLM rollout server on GPU 0, the JAX trainer on the other GPUs.
#
#   launch/gpu_node.sh [--dry-run] --model MODEL_DIR --config CONFIG [--port PORT] [--gpus N]
#                      [--weights-dir DIR] [-- key.path=value ...]
#
# MODEL_DIR is a local Hugging Face folder (e.g. Qwen2.5-1.5B-Instruct or Qwen2.5-7B-Instruct); the server
# starts from it and the trainer loads it too (model.path), so both hold the same weights at step 0. Weight
# pushes go through WEIGHTS_DIR (default /dev/shm/cppo_weights_PORT: memory, no disk; for 7B in fp32 that is
# ~30 GB of shared memory per slot, two slots), which both processes see at the same path.
#
# Steps: (1) CUDA_VISIBLE_DEVICES=0 launch/vllm_server.sh MODEL_DIR PORT (waits for /health; float32 weights
# like the trainer's, so the push check holds at its default tolerance; --gpu-memory-utilization 0.85, prefix
# caching), (2) CUDA_VISIBLE_DEVICES=1..N-1 python -m cppo_jax.launch
# --config CONFIG rollout.backend=vllm rollout.vllm_url=http://127.0.0.1:PORT ..., (3) stop the server when
# the trainer exits (also on errors and Ctrl-C). The server listens on 127.0.0.1 only: its weight-reload
# routes are unauthenticated.
# The trainer's mesh is `python -m cppo_jax.plan --pick-mesh` for the N-1 GPUs of GPU_MEMORY_GB GB each
# (default: nvidia-smi's, else 80): one that divides the questions per step and fits, or a refusal with
# the plan's figures and the layouts that fit. --dry-run prints the commands without running anything.
set -euo pipefail

DRY_RUN=0
MODEL=""
CONFIG=""
PORT="${VLLM_PORT:-8011}"
GPUS="${NUM_GPUS:-8}"
WEIGHTS_DIR=""
OVERRIDES=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) DRY_RUN=1; shift ;;
        --model) MODEL="$2"; shift 2 ;;
        --config) CONFIG="$2"; shift 2 ;;
        --port) PORT="$2"; shift 2 ;;
        --gpus) GPUS="$2"; shift 2 ;;
        --weights-dir) WEIGHTS_DIR="$2"; shift 2 ;;
        --) shift; OVERRIDES=("$@"); break ;;
        -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
        *) echo "$0: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
if [[ -z "$MODEL" || -z "$CONFIG" ]]; then
    echo "usage: $0 [--dry-run] --model MODEL_DIR --config CONFIG [--port PORT] [--gpus N] [-- overrides]" >&2
    exit 2
fi
if (( GPUS < 2 )); then
    echo "$0: --gpus must be at least 2 (one for vLLM, the rest for the trainer), got $GPUS" >&2
    exit 2
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WEIGHTS_DIR="${WEIGHTS_DIR:-/dev/shm/cppo_weights_$PORT}"
URL="http://127.0.0.1:$PORT"
TRAIN_GPUS="$(seq -s, 1 $(( GPUS - 1 )))"
PID_FILE="${TMPDIR:-/tmp}/cppo_vllm_$PORT.pid"
PY="${PYTHON:-$ROOT/.venv/bin/python}"

if [[ -z "${GPU_MEMORY_GB:-}" ]]; then
    GPU_MEMORY_GB="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 1 2>/dev/null \
        | awk '{printf "%.0f", $1 * 1.048576 / 1000}')" || true
fi
MESH_LINE="$("$PY" -m cppo_jax.plan --pick-mesh --config "$CONFIG" --devices $(( GPUS - 1 )) \
    --device-memory-gb "${GPU_MEMORY_GB:-80}" "model.path=$MODEL" "${OVERRIDES[@]}")" || {
    echo "$0: no trainer mesh fits $(( GPUS - 1 )) GPUs of ${GPU_MEMORY_GB:-80} GB (see above); --gpus is one more than the trainer's GPUs" >&2
    exit 2
}
read -r -a MESH <<< "$MESH_LINE"

SERVER=(env CUDA_VISIBLE_DEVICES=0 VLLM_DTYPE="${VLLM_DTYPE:-float32}"
        VLLM_MAX_MODEL_LEN="${VLLM_MAX_MODEL_LEN:-4096}" VLLM_PID_FILE="$PID_FILE"
        "$ROOT/launch/vllm_server.sh" "$MODEL" "$PORT" --enable-prefix-caching)
TRAINER=(env CUDA_VISIBLE_DEVICES="$TRAIN_GPUS" CPPO_VLLM_URL="$URL"
         "$PY" -m cppo_jax.launch --config "$CONFIG"
         rollout.backend=vllm "rollout.vllm_url=$URL" "rollout.weights_dir=$WEIGHTS_DIR"
         "model.path=$MODEL" "${MESH[@]}" "${OVERRIDES[@]}")

show() {  # print a command, quoting only what needs it
    local out="+" a
    for a in "$@"; do
        if [[ "$a" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+=" $a"; else out+=" $(printf '%q' "$a")"; fi
    done
    echo "$out"
}
show "${SERVER[@]}"
show "${TRAINER[@]}"
echo "+ kill -- -\$(cat $PID_FILE)   # when the trainer exits"
if [[ $DRY_RUN -eq 1 ]]; then
    exit 0
fi

mkdir -p "$WEIGHTS_DIR"
stop_server() {
    if [[ -f "$PID_FILE" ]]; then
        kill -- "-$(cat "$PID_FILE")" 2>/dev/null || true
        rm -f "$PID_FILE"
    fi
}
trap stop_server EXIT INT TERM
"${SERVER[@]}"
"${TRAINER[@]}"
