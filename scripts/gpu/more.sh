#!/bin/bash
# Call 4 on a lent GPU, right after full.sh (the machine still warm, /root/work kept): regenerate the prompts the
# first pass did not reach (regenerate resumes past the conversations already in regen.jsonl), then fine-tune the
# head full.sh trained on everything, export it and pack it into $OUT like full.sh. Budget knobs: TR (regeneration
# seconds; 0 skips it), RB (rows per batch), STEPS (optimizer steps of 32 x 512), TT (training seconds, a hard stop), LR.
source scripts/gpu/common.sh
W=${W:-/root/work}
[ -d $W/ckpt ] && [ -f $W/regen.jsonl ] || { echo "error: run full.sh first (no $W/ckpt or $W/regen.jsonl)"; exit 2; }
[ "${TR:-150}" = 0 ] || { stamp regen; regen ${TR:-150} ${RB:-512}; }
stamp train; train_head ${TT:-175} $W/ckpt $W/ckpt2 $OUT/train2.log --optimizer.lr ${LR:-2e-4} --training.epochs 20 \
  --training.max_steps ${STEPS:-400} --logging.every 20 --logging.eval_every 100
stamp pack; pack $W/ckpt2; stamp done
