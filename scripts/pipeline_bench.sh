#!/usr/bin/env bash
# docs/pipeline-bench.md from one run: bench-pp on 2 ranks (one thread each) for the
# small and the tiny GPT, each launched LAUNCHES times (default 3: one launch's ratios
# move with the machine, so the page gives every launch's goals and their median), their
# JSON and output in out/pipeline/ (small.json, small-2.json, ...), then the page written
# from them (scripts/pipeline_page.py). About five minutes on 2 cores (sets up .venv on
# first use).
#   scripts/pipeline_bench.sh               # writes docs/pipeline-bench.md
#   LAUNCHES=1 scripts/pipeline_bench.sh    # one launch of each
#   QUICK=1 scripts/pipeline_bench.sh       # a smoke run: the page stays in out/pipeline/
# Measure on a quiet machine if you can: other jobs on the same cores move every number.
source "$(dirname "$0")/_venv.sh"
if [ -n "${LAUNCHES:-}" ] && ! [[ "$LAUNCHES" =~ ^[1-9][0-9]*$ ]]; then
    # Checked before the old results go: a loop of no launches would write an empty page.
    echo "scripts/pipeline_bench.sh: LAUNCHES=$LAUNCHES: give a whole number >= 1" >&2
    exit 2
fi
OUT="${PIPE_DIR:-out/pipeline}"  # its own variable: PERF_DIR is performance.sh's
mkdir -p "$OUT"
rm -f "$OUT"/small*.json "$OUT"/small*.txt "$OUT"/tiny*.json "$OUT"/tiny*.txt "$OUT"/machine.json
unset MPIRING_TRACE MPIRING_LOG MPIRING_CHECK MPIRING_IDLE
if [ "${QUICK:-0}" = 1 ]; then
    PAGE="$OUT/pipeline-bench.md"; SMALL=(--m 2 -n 1 -w 0); TINY=(--m 2 -n 1 -w 0)
    LAUNCHES="${LAUNCHES:-1}"
else
    PAGE=docs/pipeline-bench.md; SMALL=(-n 12); TINY=(-n 12 -w 3)
    LAUNCHES="${LAUNCHES:-3}"
fi
COMMIT="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
git diff --quiet HEAD -- mpiring scripts 2>/dev/null || COMMIT="$COMMIT with local changes"
load() { cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo "?"; }
BEFORE="$(load)"
for k in $(seq 1 "$LAUNCHES"); do
    # The first launch is the one printed and drawn on the page: small.json, then small-2.json.
    SUFFIX=""; DRAW=""
    if [ "$k" = 1 ]; then DRAW=1f1b:8,zb:8,interleaved:8,interleaved-zb:8,zbv:8,dualpipev:8
    else SUFFIX="-$k"; fi
    mpiexec -n 2 python -m mpiring bench-pp "${SMALL[@]}" --draw "$DRAW" \
        --json "$OUT/small$SUFFIX.json" > "$OUT/small$SUFFIX.txt"
    mpiexec -n 2 python -m mpiring bench-pp --preset tiny "${TINY[@]}" --draw "" \
        --json "$OUT/tiny$SUFFIX.json" > "$OUT/tiny$SUFFIX.txt"
done
printf '{"cores": %s, "load_before": "%s", "load_after": "%s"}\n' \
    "$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 0)" "$BEFORE" "$(load)" > "$OUT/machine.json"
python scripts/pipeline_page.py "$OUT" --commit "$COMMIT" > "$PAGE"
echo "wrote $PAGE" >&2
