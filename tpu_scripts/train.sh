#!/usr/bin/env bash
# Launch training on every host of the slice (the same command everywhere; jax.distributed connects them).
#   ./train.sh CONFIG [--section.key VALUE ...]
#   ./train.sh configs/qwen2.5-7b.yaml --checkpoint.dir gs://my-bucket/qwen-eagle3
# Re-running the same command after a stop resumes from the last checkpoint (a preempted spot slice is recreated
# first: README.md). The preflight here needs specjax with its tpu extra on this machine; SKIP_PREFLIGHT=1 skips it.
set -euo pipefail
cd "$(dirname "$0")"
source ./env.sh

if [[ $# -lt 1 ]]; then
  echo "usage: $0 CONFIG [--section.key VALUE ...]" >&2
  exit 2
fi
CONFIG="$1"; shift
ARGS="$(quote_args "$@")"
HF_ENV=""
if [[ -n "${HF_TOKEN:-}" ]]; then HF_ENV="export HF_TOKEN=$(printf '%q' "${HF_TOKEN}");"; fi

# Preflight here first (no TPU needed): the train step must compile for the pod's topology and fit its HBM.
if [[ -n "${ACCELERATOR_TYPE:-}" && "${SKIP_PREFLIGHT:-0}" != 1 ]]; then
  echo "preflight: compiling the train step for ${ACCELERATOR_TYPE} (SKIP_PREFLIGHT=1 skips)"
  JAX_PLATFORMS=cpu python -m specjax.preflight train --config "$(local_config "${CONFIG}")" \
    --topology "${ACCELERATOR_TYPE}" "$@"
fi
echo "starting training on all hosts of ${TPU_NAME}: ${CONFIG} ${ARGS}"
tpu_ssh all "set -euo pipefail; ${HF_ENV}
  . ~/specjax-venv/bin/activate; cd ~/${REMOTE_DIR}
  if [[ -f ~/specjax-train.pid ]] && kill -0 \$(cat ~/specjax-train.pid) 2>/dev/null; then
    echo \"\$(hostname): training already running (pid \$(cat ~/specjax-train.pid))\"; exit 1; fi
  nohup python -m specjax.train --config ${CONFIG} --multihost.auto true ${ARGS} > ~/${TRAIN_LOG} 2>&1 &
  echo \$! > ~/specjax-train.pid
  echo \"\$(hostname): started pid \$(cat ~/specjax-train.pid), log ~/${TRAIN_LOG}\""
echo "watch:  ./logs.sh        stop:  ./stop.sh"
