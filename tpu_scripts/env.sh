# Settings shared by every script here. Edit them, or override any of them in the environment:
#   TPU_NAME=my-pod ZONE=us-central2-b ./create.sh
# (sourced by the other scripts; not meant to be run on its own)

PROJECT="${PROJECT:-$(gcloud config get-value project 2>/dev/null)}"   # your GCP project
ZONE="${ZONE:-us-central2-b}"                 # a zone with v4 capacity (TRC grants: us-central2-b)
TPU_NAME="${TPU_NAME:-specjax-v4-32}"        # name of the TPU VM (pod slice)
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v4-32}" # 16 chips on 4 hosts; v4-8 = 1 host (enough for serving)
TPU_VERSION="${TPU_VERSION:-tpu-ubuntu2204-base}"
SPOT="${SPOT:-0}"                             # 1: create as a spot (preemptible) VM; training resumes after
REMOTE_DIR="${REMOTE_DIR:-specjax}"           # where the code lives on every host (relative to ~)
TRAIN_LOG="${TRAIN_LOG:-specjax-train.log}"   # in ~ on every host
SERVE_LOG="${SERVE_LOG:-specjax-serve.log}"   # in ~ on worker 0
SERVE_PORT="${SERVE_PORT:-30000}"

if [[ -z "${PROJECT}" ]]; then
  echo "error: set PROJECT (or run: gcloud config set project YOUR_PROJECT)" >&2
  exit 1
fi

# gcloud ... ssh on the hosts of the slice; WORKER=all (default) or a worker index.
tpu_ssh() {
  local worker="$1"; shift
  gcloud compute tpus tpu-vm ssh "${TPU_NAME}" --project "${PROJECT}" --zone "${ZONE}" \
    --worker="${worker}" --command "$*"
}

# Quote arguments for the remote shell; no arguments -> nothing (not an empty '' argument).
quote_args() {
  if [[ $# -gt 0 ]]; then printf '%q ' "$@"; fi
}

# A path for the remote shell: a leading ~/ stays expandable there, the rest is quoted.
remote_path() {
  if [[ "$1" == "~/"* ]]; then printf '~/%q' "${1#\~/}"; else printf '%q' "$1"; fi
}

tpu_scp() {  # tpu_scp WORKER LOCAL_PATH REMOTE_PATH
  gcloud compute tpus tpu-vm scp "$2" "${TPU_NAME}:$3" --project "${PROJECT}" --zone "${ZONE}" --worker="$1"
}

# A config path as the local preflight finds it: the scripts run in tpu_scripts/, so a path given from the checkout's
# root (configs/my.yaml) is read from there; a shipped config's name (qwen2.5-7b.yaml) as it is.
local_config() {
  if [[ "$1" != /* && -f "../$1" ]]; then printf '%s' "../$1"; else printf '%s' "$1"; fi
}

# Hosts of a v4 / v5p slice (its name counts TensorCores: 8 per host), 1 for any other name.
slice_hosts() {
  if [[ "${1:-}" =~ ^v(4|5p)-([0-9]+)$ ]]; then echo $(( BASH_REMATCH[2] > 8 ? BASH_REMATCH[2] / 8 : 1 )); else echo 1; fi
}
