#!/usr/bin/env bash
# The speed goals that need a core per rank, measured on a host that has them.
#
# On a 2-core machine 3 and 4 ranks share cores, and DDP's communication thread
# has no idle core to hide on. This runs the collective and DDP benches of
# docs/performance.md with a core per rank, and one to spare per rank for DDP:
#   * bench all_reduce (native, ring, ring-seg, auto) and broadcast (native,
#     pipelined), 8 B to 64 MiB, on 2, 3 and 4 ranks, then the ratio grids
#     (scripts/speed_summary.py);
#   * bench-ddp on the issue's setting (comm GPT, 1 x 64 tokens per rank) on 2
#     and 4 ranks, one compute thread per rank.
#
#   scripts/core_per_rank.sh              # needs >= 8 cores; skips (exit 0) on fewer
#   FORCE=1 scripts/core_per_rank.sh      # run anyway (shared cores: not the point)
#
# Environment (all optional): PYTHON (default python3; a set-up .venv is used
# when present), CORES_DIR (default out/core-per-rank, where logs and JSON go),
# BUDGET_S (default 240: the whole script's time; each collective run gets a
# sixth of it, each DDP run a quarter).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
    export PATH="$ROOT/.venv/bin:$PATH"
else
    PY="${PYTHON:-python3}"
fi
LOGS="${CORES_DIR:-$ROOT/out/core-per-rank}"
BUDGET_S="${BUDGET_S:-240}"
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
CORES=$("$PY" -c 'import os; print(len(os.sched_getaffinity(0)))' 2>/dev/null || nproc)
if [ "$CORES" -lt 8 ] && [ "${FORCE:-0}" != 1 ]; then
    echo "core_per_rank: SKIP: $CORES cores here; 4 ranks and a spare core each need 8 (FORCE=1 runs anyway)"
    exit 0
fi
if ! command -v mpiexec >/dev/null 2>&1; then
    echo "core_per_rank: FAIL: no mpiexec on PATH"
    exit 1
fi
FAILED=0
part() {  # part SECONDS LOG cmd...: one time-boxed run, its output kept in LOG
    local secs="$1" log="$2"; shift 2
    echo "+ $*" >"$log"
    timeout "$secs" "$@" >>"$log" 2>&1
    local rc=$?
    if [ "$rc" != 0 ]; then
        FAILED=1
        echo "core_per_rank: FAIL (rc=$rc${rc/124/, timed out after ${secs}s}): $*"
        tail -5 "$log"
    fi
}
echo "core_per_rank: $CORES cores; $(uptime | sed 's/.*load/load/')"
share=$((BUDGET_S / 6))      # each of three collective runs
ddp_share=$((BUDGET_S / 4))  # each of two DDP runs (torch's start-up, five modes)
for n in 2 3 4; do
    part "$share" "$LOGS/speed-$n.txt" mpiexec -n "$n" "$PY" -m mpiring bench \
        -c all_reduce,broadcast --algo native,ring,ring-seg,auto,pipelined \
        -b 8 -e 64M -f 2 -n 10 -w 2 --json "$LOGS/speed-$n.json"
done
files=()
for n in 2 3 4; do [ -s "$LOGS/speed-$n.json" ] && files+=("$LOGS/speed-$n.json"); done
if [ "${#files[@]}" -gt 0 ]; then
    # From 1 MiB for the rings and the pipeline; auto's small sizes as counts.
    "$PY" scripts/speed_summary.py --from 1M "${files[@]}" | tee "$LOGS/summary.txt"
    "$PY" scripts/speed_summary.py --brief "${files[@]}" | tee -a "$LOGS/summary.txt"
fi
for n in 2 4; do
    part "$ddp_share" "$LOGS/ddp-$n.txt" mpiexec -n "$n" "$PY" -m mpiring bench-ddp --preset comm \
        --batch-size 1 -n 10 -w 2 --modes compute,ddp,naive,flat-mpi,torch-ddp
    grep -E "^# (mpiring|malloc)|^ +(compute|ddp|naive|flat-mpi|torch-ddp) " "$LOGS/ddp-$n.txt"
done
if [ "$FAILED" = 0 ]; then echo "core_per_rank: PASS"; else echo "core_per_rank: FAIL"; fi
exit "$FAILED"
