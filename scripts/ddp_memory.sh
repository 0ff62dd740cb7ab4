#!/usr/bin/env bash
# What DDP costs in memory: peak RSS of a few GPT training steps per setup (compute
# alone, mpiring DDP with and without gradient_as_bucket_view, torch DDP), one
# launch per setup (peak RSS is a per-process high-water mark). Prints a table of
# each setup's extra memory over compute alone, in MiB and in gradient copies;
# the lines go to out/ddp_memory.jsonl.
#   scripts/ddp_memory.sh                 # preset 'comm' (12.8M params, 49 MiB gradients), 2 ranks
#   RANKS="2 4" STEPS=5 scripts/ddp_memory.sh
source "$(dirname "$0")/_venv.sh"
PRESET="${PRESET:-comm}"
STEPS="${STEPS:-5}"
RANKS="${RANKS:-2}"
OUT="${OUT:-out/ddp_memory.jsonl}"
mkdir -p "$(dirname "$OUT")"
: > "$OUT"
for n in $RANKS; do
    for setup in compute ddp ddp-view torch-ddp torch-ddp-view; do
        mpiexec -n "$n" python -m mpiring bench-ddp --memory "$setup" --preset "$PRESET" \
            --steps "$STEPS" --batch-size 1 --json "$OUT" "$@"
    done
done
python - "$OUT" <<'PY'
import json, sys
from mpiring.tools.bench.memory import memory_table
print(memory_table([json.loads(line) for line in open(sys.argv[1]) if line.strip()]))
PY
