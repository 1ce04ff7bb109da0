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
