# Sourced by the device scripts (on the device machine's copy of the tree): specjax importable without pip, through
# links specjax/{train,serve,configs} as the installed package maps them; the image's python3 and packages.
set -u
REPO=$(pwd)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for d in train serve configs; do [ -e "$REPO/specjax/$d" ] || ln -s "$REPO/$d" "$REPO/specjax/$d"; done
if [ -d "$REPO/.whl" ] && ls "$REPO"/.whl/*.whl >/dev/null 2>&1 && [ ! -d /root/site/gguf ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site "$REPO"/.whl/*.whl
fi
export PYTHONPATH=$REPO:/root/site
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.85}
PY=${PY:-python3}
stamp() { echo "=== $(date +%T) $*"; }

# The steps pipeline.sh and more.sh share (W: the work folder on the device).
regen() {  # regen SECONDS BATCH: answer the carried prompts into $W/regen.jsonl (resumes past what is there)
  JAX_DEFAULT_MATMUL_PRECISION=${REGEN_PRECISION:-default} timeout -s TERM -k 20 "$1" $PY -m specjax.train.regenerate \
    --model $W/smol --data .gpu3/prompts.jsonl --out $W/regen.jsonl --max-turns 1 --max-prompt-tokens 256 \
    --max-new-tokens 256 --batch-size "$2" --chunk "$2" ${EXTRA_REGEN:-} 2>&1 | tr '\r' '\n' | grep -v "^\s*$" | tail -40
  echo "regenerated: $(wc -l < $W/regen.jsonl) conversations, $(wc -c < $W/regen.jsonl) bytes"
}
train_head() {  # train_head SECONDS INIT CKPT LOG [flags]: fine-tune INIT on $W/regen.jsonl (32 x 512 steps)
  local secs=$1 init=$2 ckpt=$3 log=$4; shift 4
  timeout -s TERM -k 30 "$secs" $PY -m specjax.train --config configs/smollm2-135m.yaml --model.path $W/smol \
    --head.init_from "$init" --data.paths "[$W/regen.jsonl]" --training.batch_size ${TB:-32} --data.buckets "[512]" \
    --checkpoint.dir "$ckpt" --checkpoint.every 50 --logging.progress false "$@" ${EXTRA_TRAIN:-} > "$log" 2>&1
  echo "train rc=$?"; grep -v "^\s*$" "$log" | tail -25
}
decode8b() {  # decode8b TAG SECONDS LINES [flags]: the random Llama-3.1-8B-shaped bf16 decode (bench decode), its JSON
  local tag=$1 secs=$2 lines=$3; shift 3  # to $OUT/decode8b$TAG.json, the last LINES lines of its output shown
  timeout -k 5 "$secs" $PY -m specjax.bench decode --random-llama-8b --new-tokens 128 --repeats 3 \
    --json "$OUT/decode8b$tag.json" "$@" 2>&1 | grep -v "^\s*$" | grep -v "^W0000\|^I0000" | tail -"$lines"
}
pack() {  # pack CKPT: export the head (bf16 HF EAGLE3) and bring it back with the conversations, in 15 MB parts
  rm -rf $W/pk; mkdir -p $W/pk
  $PY -m specjax.convert export-head "$1" $W/pk/head --dtype bfloat16 2>&1 | tail -2
  gzip -c $W/regen.jsonl > $W/pk/regen.jsonl.gz
  tar cf $W/result.tar -C $W/pk head regen.jsonl.gz && split -b 15000000 -d $W/result.tar $OUT/result.tar.
  ls -la $OUT
}
