#!/usr/bin/env bash
# Delete the TPU VM slice (billing stops). Checkpoints on gs:// survive; anything only on the hosts is lost.
set -euo pipefail
cd "$(dirname "$0")"
source ./env.sh
gcloud compute tpus tpu-vm delete "${TPU_NAME}" --project "${PROJECT}" --zone "${ZONE}" --quiet
