#!/bin/bash
# Call 3 on a lent GPU (after stash.sh carried two GGUF parts): the SmolLM2 head pipeline, then the GPU benches
# (BENCHES=0: the pipeline only).
bash scripts/gpu/pipeline.sh
[ "${BENCHES:-1}" = 0 ] || bash scripts/gpu/benches.sh
