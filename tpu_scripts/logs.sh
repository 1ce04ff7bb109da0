#!/usr/bin/env bash
# Follow the log of worker 0 (metrics print there), or show the tail of every host.
#   ./logs.sh              # follow training on worker 0 (Ctrl-C stops watching, not training)
#   ./logs.sh all          # last 20 lines of every host
#   ./logs.sh serve        # follow the server log on worker 0
set -euo pipefail
cd "$(dirname "$0")"
source ./env.sh

case "${1:-train}" in
  all)   tpu_ssh all "echo \"== \$(hostname)\"; tail -n 20 ~/${TRAIN_LOG}" ;;
  serve) tpu_ssh 0 "tail -n 50 -f ~/${SERVE_LOG}" ;;
  *)     tpu_ssh 0 "tail -n 50 -f ~/${TRAIN_LOG}" ;;
esac
