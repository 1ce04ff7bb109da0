#!/bin/bash
# Call 4 on a lent GPU, right after full.sh (the machine still warm, /root/work kept): regenerate the prompts the
# first pass did not reach (regenerate resumes past the conversations already in regen.jsonl), then fine-tune the
# head full.sh trained on everything, export it and pack it into $OUT like full.sh. Budget knobs: TR (regeneration
# seconds), STEPS (optimizer steps of 32 x 512), TT (training seconds, a hard stop), LR.
source scripts/gpu/common.sh
W=${W:-/root/work}
[ -d $W/ckpt ] && [ -f $W/regen.jsonl ] || { echo "error: run full.sh first (no $W/ckpt or $W/regen.jsonl)"; exit 2; }
stamp regen; JAX_DEFAULT_MATMUL_PRECISION=${REGEN_PRECISION:-default} timeout -s TERM -k 15 ${TR:-150} \
  $PY -m specjax.train.regenerate --model $W/smol --data .gpu3/prompts.jsonl --out $W/regen.jsonl --max-turns 1 \
  --max-prompt-tokens 256 --max-new-tokens 256 --batch-size ${RB:-512} --chunk ${RC:-512} 2>&1 | tr '\r' '\n' \
  | grep -v "^\s*$" | tail -12
echo "regenerated: $(wc -l < $W/regen.jsonl) conversations"
stamp train; timeout -s TERM -k 20 ${TT:-175} $PY -m specjax.train --config configs/smollm2-135m.yaml \
  --model.path $W/smol --head.init_from $W/ckpt --data.paths "[$W/regen.jsonl]" --training.batch_size 32 \
  --optimizer.lr ${LR:-2e-4} --training.epochs 20 --training.max_steps ${STEPS:-400} --data.buckets "[512]" \
  --checkpoint.dir $W/ckpt2 --checkpoint.every 50 --logging.every 20 --logging.eval_every 100 \
  --logging.progress false > $OUT/train2.log 2>&1; echo "train rc=$?"
grep -v "^\s*$" $OUT/train2.log | grep -i "eval\|done\|error\|train:" | tail -8
stamp export; $PY -m specjax.convert export-head $W/ckpt2 $W/head2 --dtype bfloat16 2>&1 | tail -1
rm -rf $W/pk; mkdir -p $W/pk; cp -r $W/head2 $W/pk/head; gzip -c $W/regen.jsonl > $W/pk/regen.jsonl.gz
tar cf $W/r2.tar -C $W/pk head regen.jsonl.gz && split -b 15000000 -d $W/r2.tar $OUT/result.tar.
ls -la $OUT; stamp done
