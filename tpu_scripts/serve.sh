#!/usr/bin/env bash
# Serve the target with its trained EAGLE3 head on a one-host TPU VM (a v4-8: its 4 chips, TP=4), OpenAI-compatible
# HTTP on port ${SERVE_PORT}.
#   TPU_NAME=specjax-serve ./serve.sh TARGET HEAD [extra python -m specjax.serve flags]
#   TPU_NAME=specjax-serve ./serve.sh Qwen/Qwen2.5-7B-Instruct '~/heads/qwen2.5-7b-eagle3'
# HEAD is an HF-format head folder on that VM (quote a ~/ path: it is the VM's home); README.md section 3 exports one
# there from the training checkpoint. One process on one host of a multi-host slice would wait at TPU start-up for
# the other hosts, so a multi-host VM is refused (its type asked of gcloud). The preflight here needs specjax with its tpu extra
# on this machine; SKIP_PREFLIGHT=1 skips it.
set -euo pipefail
cd "$(dirname "$0")"
source ./env.sh

if [[ $# -lt 2 ]]; then
  echo "usage: $0 TARGET_MODEL_PATH HEAD_PATH [extra serve flags]" >&2
  exit 2
fi
TARGET="$1"; HEAD="$2"; shift 2
ACCEL="$(gcloud compute tpus tpu-vm describe "${TPU_NAME}" --project "${PROJECT}" --zone "${ZONE}" \
  --format='value(acceleratorType)')"
if [[ "$(slice_hosts "${ACCEL}")" != 1 ]]; then
  echo "error: ${TPU_NAME} is a ${ACCEL} ($(slice_hosts "${ACCEL}") hosts): serve on a one-host VM, e.g." \
       "TPU_NAME=specjax-serve ACCELERATOR_TYPE=v4-8 ./create.sh, then ./install.sh and ./serve.sh with that" \
       "TPU_NAME (README.md section 3)" >&2
  exit 2
fi
TP="${TP:-4}"
NUM_STEPS="${NUM_STEPS:-5}"; TOPK="${TOPK:-4}"; DRAFT_TOKENS="${DRAFT_TOKENS:-8}"
ARGS="$(quote_args "$@")"

# Preflight here first (no TPU needed): every program the server runs (prefill buckets, the EAGLE3 step) must compile
# for one host's chips (SERVE_TOPOLOGY, default v4-8 = the 4 chips of worker 0) and fit their HBM. The model's shape
# comes from TARGET (a local folder, or a hub id with a shipped shape) or PREFLIGHT_MODEL; SKIP_PREFLIGHT=1 skips.
if [[ "${SKIP_PREFLIGHT:-0}" != 1 ]]; then
  HEAD_FLAG=(); [[ -d "${HEAD}" ]] && HEAD_FLAG=(--speculative-draft-model-path "${HEAD}")
  echo "preflight: compiling the server's programs for ${SERVE_TOPOLOGY:-v4-8} (SKIP_PREFLIGHT=1 skips)"
  JAX_PLATFORMS=cpu python -m specjax.preflight serve --model-path "${PREFLIGHT_MODEL:-${TARGET}}" \
    --speculative-algorithm EAGLE3 ${HEAD_FLAG[@]+"${HEAD_FLAG[@]}"} --speculative-num-steps "${NUM_STEPS}" \
    --speculative-eagle-topk "${TOPK}" --speculative-num-draft-tokens "${DRAFT_TOKENS}" --tp "${TP}" \
    --topology "${SERVE_TOPOLOGY:-v4-8}" --largest-bucket-only "$@"
fi

tpu_ssh 0 "set -euo pipefail
  . ~/specjax-venv/bin/activate; cd ~/${REMOTE_DIR}
  nohup python -m specjax.serve --model-path $(remote_path "${TARGET}") \
    --speculative-algorithm EAGLE3 --speculative-draft-model-path $(remote_path "${HEAD}") \
    --speculative-num-steps ${NUM_STEPS} --speculative-eagle-topk ${TOPK} \
    --speculative-num-draft-tokens ${DRAFT_TOKENS} --tp ${TP} --host 0.0.0.0 --port ${SERVE_PORT} ${ARGS} \
    > ~/${SERVE_LOG} 2>&1 &
  echo \$! > ~/specjax-serve.pid
  echo \"\$(hostname): server pid \$(cat ~/specjax-serve.pid), log ~/${SERVE_LOG}\""
echo "watch: ./logs.sh serve    test: see README.md (curl through an ssh tunnel)    stop: ./stop.sh serve"
