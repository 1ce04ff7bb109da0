#!/usr/bin/env bash
# Create the TPU VM slice (default: v4-32, 4 hosts x 4 chips) with the plain Ubuntu TPU image.
#   ./create.sh                 # uses tpu_scripts/env.sh
set -euo pipefail
cd "$(dirname "$0")"
source ./env.sh

extra=()
if [[ "${SPOT}" == "1" ]]; then extra+=(--spot); fi

echo "creating ${ACCELERATOR_TYPE} '${TPU_NAME}' in ${ZONE} (project ${PROJECT})"
gcloud compute tpus tpu-vm create "${TPU_NAME}" \
  --project "${PROJECT}" --zone "${ZONE}" \
  --accelerator-type "${ACCELERATOR_TYPE}" --version "${TPU_VERSION}" "${extra[@]}"
gcloud compute tpus tpu-vm describe "${TPU_NAME}" --project "${PROJECT}" --zone "${ZONE}" \
  --format="value(state,acceleratorType)"
echo "next: ./install.sh"
