#!/bin/bash
# Calls 1-2 on a lent GPU: carry one GGUF part each onto the warm machine (a call carries at most 64 MiB).
mkdir -p /root/stash; cp .gpu1/q4part* .gpu2/q4part* /root/stash/ 2>/dev/null; ls -la /root/stash
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
