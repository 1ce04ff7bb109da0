#!/bin/bash
# On a lent GPU: the 8B decode (random Llama-3.1-8B-shaped weights, bf16, batch 1) under XLA flag sets, one process
# each (XLA reads XLA_FLAGS when its backend starts), so the fraction of the HBM bandwidth can be compared across
# code-generation choices in one call. The first set is JAX's defaults and is profiled (--profile-dir: the device's
# time per token by kernel, busy against idle). Budget: about 35 s per set on an H200 (the eighth and forty-sixth
# sessions' runs took 33 s), so the three default sets fit after full.sh and more.sh in a 15-minute lease.
# FLAGSETS: sets separated by ';' (an empty set = the defaults), e.g. add
# ';--xla_gpu_enable_triton_gemm=false --xla_gpu_graph_min_graph_size=1'.
source scripts/gpu/common.sh
FLAGSETS=${FLAGSETS:-";--xla_gpu_enable_triton_gemm=false;--xla_gpu_enable_command_buffer="}
IFS=';' read -r -a SETS <<< "$FLAGSETS"
i=0
for flags in "${SETS[@]}"; do
  stamp "decode8b flags [${flags:-defaults}]"
  prof=""; [ $i = 0 ] && prof="--profile-dir /tmp/trace8b"
  XLA_FLAGS="$flags" timeout -k 5 ${T1:-90} $PY -m specjax.bench decode --random-llama-8b --new-tokens 128 --repeats 3 \
    --json $OUT/decode8b.$i.json $prof 2>&1 | grep -v "^\s*$" | grep -v "^W0000\|^I0000" | tail -$([ $i = 0 ] && echo 40 || echo 6)
  i=$((i + 1))
done
stamp done
