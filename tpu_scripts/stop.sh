#!/usr/bin/env bash
# Stop training (SIGTERM on every host: each saves the checkpoint of the current step, then exits) or serving.
#   ./stop.sh              # training
#   ./stop.sh serve        # the server on worker 0
set -euo pipefail
cd "$(dirname "$0")"
source ./env.sh

what="${1:-train}"
if [[ "${what}" == "serve" ]]; then workers=0; pidfile=specjax-serve.pid; else workers=all; pidfile=specjax-train.pid; fi
tpu_ssh "${workers}" "
  if [[ -f ~/${pidfile} ]] && kill -0 \$(cat ~/${pidfile}) 2>/dev/null; then
    pid=\$(cat ~/${pidfile}); kill -TERM \$pid
    for i in \$(seq 1 300); do kill -0 \$pid 2>/dev/null || break; sleep 1; done
    if kill -0 \$pid 2>/dev/null; then echo \"\$(hostname): pid \$pid still running after 300 s\"; exit 1; fi
    echo \"\$(hostname): stopped pid \$pid\"; rm -f ~/${pidfile}
  else
    echo \"\$(hostname): nothing running\"
  fi"
