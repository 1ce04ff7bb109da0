#!/bin/bash
# Call 3 on a lent GPU (after stash.sh carried two GGUF parts): the SmolLM2 head pipeline, then the GPU benches.
bash scripts/gpu/pipeline.sh
bash scripts/gpu/benches.sh
