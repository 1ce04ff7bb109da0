#!/bin/bash
# On a lent GPU: the runtime-speed issue's GPU figures (random Llama-3.1-8B-shaped decode vs HBM bandwidth,
# the verify sweep, the EAGLE3 train step on a Qwen2.5-7B-shaped target).
source scripts/gpu/common.sh

stamp setup; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
$PY -c "import jax, specjax.train; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -2
stamp decode8b; [ "${T1:-100}" = 0 ] || decode8b "" ${T1:-100} 45 --profile-dir /tmp/trace8b
stamp verify; timeout -k 5 ${T2:-70} $PY -m specjax.bench spec --verify-sweep 1,8,16,32,64 --random-llama-8b 2>&1 | tail -20
stamp train7b; timeout -k 5 ${T3:-90} $PY -m specjax.bench train --model-config configs/models/qwen2.5-7b.json --batch 8 --seq-len 1024 --steps 4 --warmup 2 --json $OUT/train7b.json 2>&1 | tail -15
stamp done
