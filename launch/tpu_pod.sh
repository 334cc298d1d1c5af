#!/usr/bin/env bash
# A TPU pod slice: the same launch on every TPU VM worker, at once, through gcloud.
#
#   launch/tpu_pod.sh --tpu NAME --zone ZONE [--project PROJECT] [--repo-dir DIR] --config CONFIG
#                     [--dry-run] [-- key.path=value ...]
#
# Runs `gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all --command "..."`, the command being
# `cd DIR && PY -c <libtpu check> && CPPO_DISTRIBUTED=auto PY -m cppo_jax.launch --config CONFIG
# overrides...` on each worker, PY being CPPO_PYTHON (default .venv/bin/python, relative to DIR): the
# check refuses, naming the fix, a Python without libtpu (pip install -e ".[tpu]"). CPPO_DISTRIBUTED=auto makes cppo_jax.parallel.distributed call jax.distributed.initialize() without
# arguments: on a TPU VM JAX reads the coordinator, the worker count and this worker's id from the TPU
# metadata. DIR (default ~/cppo_jax) must hold this repository and PY's environment on every worker, e.g. copied
# with `gcloud compute tpus tpu-vm scp --recurse --worker=all`. Only process 0 (worker 0) writes logs and
# exports; trainer.out_dir must be a folder every worker can write (a shared disk, a gcsfuse mount).
# --dry-run prints the command without running anything.
set -euo pipefail

DRY_RUN=0
TPU=""
ZONE=""
PROJECT=""
REPO_DIR="~/cppo_jax"
CONFIG=""
OVERRIDES=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) DRY_RUN=1; shift ;;
        --tpu) TPU="$2"; shift 2 ;;
        --zone) ZONE="$2"; shift 2 ;;
        --project) PROJECT="$2"; shift 2 ;;
        --repo-dir) REPO_DIR="$2"; shift 2 ;;
        --config) CONFIG="$2"; shift 2 ;;
        --) shift; OVERRIDES=("$@"); break ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "$0: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
if [[ -z "$TPU" || -z "$ZONE" || -z "$CONFIG" ]]; then
    echo "usage: $0 --tpu NAME --zone ZONE [--project P] [--repo-dir DIR] --config CONFIG [--dry-run] [-- overrides]" >&2
    exit 2
fi

PY="${CPPO_PYTHON:-.venv/bin/python}"
# Each worker first checks that its Python has the TPU runtime (libtpu), without starting it.
CHECK='import importlib.util as u, sys; u.find_spec("libtpu") or sys.exit("tpu_pod.sh: this worker'"'"'s Python has no libtpu: pip install -e .[tpu] into it, or set CPPO_PYTHON")'
REMOTE="cd $REPO_DIR && $(printf '%q' "$PY") -c $(printf '%q' "$CHECK") && CPPO_DISTRIBUTED=auto"
REMOTE+=" $(printf '%q' "$PY") -m cppo_jax.launch --config $(printf '%q' "$CONFIG")"
for o in "${OVERRIDES[@]}"; do REMOTE+=" $(printf '%q' "$o")"; done
GCLOUD=(gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE")
if [[ -n "$PROJECT" ]]; then GCLOUD+=(--project "$PROJECT"); fi
GCLOUD+=(--worker=all --command "$REMOTE")

printf '+'; printf ' %q' "${GCLOUD[@]}"; echo
if [[ $DRY_RUN -eq 1 ]]; then
    exit 0
fi
"${GCLOUD[@]}"
