#!/usr/bin/env bash
# ZeRO vs DDP on the GPT model: optimizer state per rank, peak RSS, bytes sent and
# step time for adamw (DDP), zero1 and zero2 on 1..4 ranks, one launch per setup
# (peak RSS is a per-process high-water mark). Lines go to docs/zero_memory.jsonl.
#   scripts/zero_memory.sh                 # preset 'comm' (12.8M params), 8 steps
#   PRESET=small STEPS=4 RANKS="2 4" scripts/zero_memory.sh
source "$(dirname "$0")/_venv.sh"
PRESET="${PRESET:-comm}"
STEPS="${STEPS:-8}"
RANKS="${RANKS:-1 2 3 4}"
OUT="${OUT:-docs/zero_memory.jsonl}"
mkdir -p "$(dirname "$OUT")"
: > "$OUT"
for n in $RANKS; do
    for opt in adamw zero1 zero2; do
        mpiexec -n "$n" python -m mpiring zero-bench --optimizer "$opt" --preset "$PRESET" \
            --steps "$STEPS" --json "$OUT" "$@"
    done
done
echo "zero_memory.sh: wrote $OUT" >&2
