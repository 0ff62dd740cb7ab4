#!/usr/bin/env bash
# docs/performance.md from one run: the benches on 2 and 4 ranks with modest sizes,
# their JSON in out/performance/, then the page and its pictures written from it
# (scripts/performance_page.py). About 8 minutes on 2 cores (sets up .venv on first use).
#   scripts/performance.sh                 # writes docs/performance.md and docs/*.png
#   QUICK=1 scripts/performance.sh         # a smoke run of a minute: page and PNGs stay in out/
#   HOSTFILE=hostfiles/mpich-localhost scripts/performance.sh
# PERF_DIR (default out/performance) is where the raw results go; the page names the commit. Measure on a quiet
# machine if you can: other jobs on the same cores move every absolute number.
source "$(dirname "$0")/_hostfile.sh"  # first: a bad HOSTFILE stops before any set-up
source "$(dirname "$0")/_venv.sh"
OUT="${PERF_DIR:-out/performance}"
rm -rf "$OUT"
mkdir -p "$OUT"
# No tuned table: the run measures what a fresh clone's algo="auto" runs.
export MPIRING_CACHE="$(cd "$OUT" && pwd)/cache"
unset MPIRING_TRACE MPIRING_LOG MPIRING_CHECK MPIRING_IDLE
if [ "${QUICK:-0}" = 1 ]; then
    PAGE="$OUT/performance.md"; PICS="$OUT"
    MAX=256K; ITERS=3; BIG=1M; STEPS=2; HOOK_STEPS=4
else
    PAGE=docs/performance.md; PICS=docs
    MAX=64M; ITERS=10; BIG=16M; STEPS=5; HOOK_STEPS=60
fi
: > "$OUT/commands.txt"
run() {  # run LOG cmd...: one launch, its command kept for the page, its output in LOG
    local log="$1"; shift
    local a line=""
    for a in "$@"; do [[ "$a" == *" "* ]] && a="\"$a\""; line+="${line:+ }$a"; done
    echo "$line" >> "$OUT/commands.txt"
    echo "== $*" >&2
    "$@" > "$OUT/$log" 2>&1 || { echo "performance.sh: failed: $* (see $OUT/$log)" >&2; tail -20 "$OUT/$log" >&2; exit 1; }
}
mpi() { run "$1" mpiexec "${HOSTARGS[@]}" -n "$2" python -m mpiring "${@:3}"; }
if [ -z "${PERF_COMMIT:-}" ]; then  # PERF_COMMIT: set it when running from an export
    PERF_COMMIT="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    git diff --quiet HEAD -- mpiring scripts 2>/dev/null || PERF_COMMIT="$PERF_COMMIT with local changes"
fi
python scripts/performance_page.py machine "$OUT/machine.json" --commit "$PERF_COMMIT"
for n in 2 4; do
    mpi "bench-$n.txt" "$n" bench -c all_reduce \
        --algo native,ring,ring-seg,recursive-doubling,halving-doubling,auto,gloo \
        -b 16 -e "$MAX" -f 4 -n "$ITERS" -w 2 --model --progress off --json "$OUT/bench-$n.json"
done
# Broadcast on 4 ranks: with 2 there is nothing to pipeline (S = 1).
mpi bcast-4.txt 4 bench -c broadcast --algo native,ring,pipelined -b 1K -e "$MAX" -f 4 \
    -n "$ITERS" -w 2 --progress off --json "$OUT/bcast-4.json"
mpi chunks.txt 4 bench --sweep-chunks "$BIG" -n "$ITERS" -w 2 --progress off --json "$OUT/chunks.json"
mpi ps.txt 4 bench --ps "$BIG" -n "$ITERS" -w 2 --progress off --json "$OUT/ps.json"
for n in 2 4; do
    mpi "ddp-$n.txt" "$n" bench-ddp --preset comm --batch-size 1 -n "$STEPS" -w 1 \
        --modes compute,ddp,naive,flat-mpi,ps,torch-ddp --progress off --json "$OUT/ddp-$n.json"
done
mpi zero-steps-4.txt 4 zero-bench --optimizer adamw,zero1,zero2 --preset comm --steps "$STEPS"
for opt in adamw zero1 zero2; do  # peak RSS is per process: one launch per setup
    mpi "zero-$opt-4.txt" 4 zero-bench --optimizer "$opt" --preset comm --steps 3 \
        --json "$OUT/zero-memory.jsonl"
done
mpi hooks.txt 2 hook-curves --preset small --steps "$HOOK_STEPS" --eval-every 20 --out "$OUT/hooks"
for n in 2 4; do
    mpi "check-cost-$n.txt" "$n" check-cost --sizes 4K,64M
done
mpi trace.txt 4 allreduce --size 16M --iters 1 --algo ring --trace "$OUT/trace"
if python -c "import matplotlib" 2>/dev/null; then
    run timeline.txt python -m mpiring trace plot "$OUT/trace" -o "$PICS/timeline.png" \
        --title "ring AllReduce of 16 MiB on 4 ranks"
fi
python scripts/performance_page.py machine --end "$OUT/machine.json"
python scripts/performance_page.py page "$OUT" --page "$PAGE" --pictures "$PICS"
