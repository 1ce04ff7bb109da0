#!/usr/bin/env bash
# Create the TPU VM slice (default: v4-32, 4 hosts x 4 chips) with the plain Ubuntu TPU image.
#   ./create.sh                 # uses tpu_scripts/env.sh
#   PREFLIGHT_CONFIG=qwen2.5-7b.yaml ./create.sh   # first compile that recipe's train step for ${ACCELERATOR_TYPE}
#                                                  # on this machine (pip install "specjax[tpu]"); no pod if it fails
set -euo pipefail
cd "$(dirname "$0")"
source ./env.sh

extra=()
if [[ "${SPOT}" == "1" ]]; then extra+=(--spot); fi

if [[ -n "${PREFLIGHT_CONFIG:-}" ]]; then
  JAX_PLATFORMS=cpu python -m specjax.preflight train --config "$(local_config "${PREFLIGHT_CONFIG}")" \
    --topology "${ACCELERATOR_TYPE}"
fi

echo "creating ${ACCELERATOR_TYPE} '${TPU_NAME}' in ${ZONE} (project ${PROJECT})"
gcloud compute tpus tpu-vm create "${TPU_NAME}" \
  --project "${PROJECT}" --zone "${ZONE}" \
  --accelerator-type "${ACCELERATOR_TYPE}" --version "${TPU_VERSION}" ${extra[@]+"${extra[@]}"}
gcloud compute tpus tpu-vm describe "${TPU_NAME}" --project "${PROJECT}" --zone "${ZONE}" \
  --format="value(state,acceleratorType)"
echo "next: ./install.sh"
