#!/usr/bin/env bash
# Copy this checkout (git HEAD plus uncommitted tracked changes) to every host, install specjax with JAX for TPU,
# and fetch the small real model and data into each host's cache.
#   ./install.sh
set -euo pipefail
cd "$(dirname "$0")"
source ./env.sh
REPO_ROOT="$(cd .. && pwd)"
TARBALL="$(mktemp -t specjax-XXXXXX).tar.gz"
trap 'rm -f "${TARBALL}"' EXIT

echo "packing ${REPO_ROOT}"
(cd "${REPO_ROOT}" && git ls-files -z | tar --null -czf "${TARBALL}" -T -)

echo "copying to all hosts of ${TPU_NAME}"
tpu_scp all "${TARBALL}" "specjax.tar.gz"

echo "installing on all hosts"
tpu_ssh all "set -euo pipefail
  mkdir -p ~/${REMOTE_DIR} && tar -xzf ~/specjax.tar.gz -C ~/${REMOTE_DIR} && rm ~/specjax.tar.gz
  # the image's Python is 3.10 and specjax's jax needs 3.11+: uv (from PyPI) makes a venv on a managed Python 3.12
  sudo apt-get -qq update >/dev/null && sudo apt-get -qq install -y python3-pip >/dev/null
  python3 -m pip install -q --user uv
  ~/.local/bin/uv venv -q --python 3.12 --seed --allow-existing ~/specjax-venv
  . ~/specjax-venv/bin/activate
  pip install -q --upgrade pip
  # the tpu extra pins jax[tpu] (libtpu) at the version the test suite runs on; gcs: gs:// checkpoint folders
  pip install -q -e ~/${REMOTE_DIR}'[tpu,gcs]' -f https://storage.googleapis.com/jax-releases/libtpu_releases.html
  python -c 'import jax; jax.distributed.initialize(); print(jax.process_index(), jax.local_device_count(), jax.device_count(), jax.devices()[0].device_kind)'
  cd ~/${REMOTE_DIR}
  python -m specjax.convert fetch-sharegpt
  python -m specjax.convert fetch-smollm2 || echo 'note: SmolLM2 fetch failed (only the smollm2 config needs it)'
"
echo "next: ./train.sh configs/qwen2.5-7b.yaml --checkpoint.dir gs://YOUR_BUCKET/run1"
