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
  if [ $i = 0 ]; then XLA_FLAGS="$flags" decode8b ".$i" ${T1:-90} 45 --profile-dir /tmp/trace8b
  else XLA_FLAGS="$flags" decode8b ".$i" ${T1:-90} 6; fi
  i=$((i + 1))
done
stamp done
