#!/usr/bin/env bash
# The long measurement: every bench at full sizes (8 B to 256 MiB, 2-4 ranks), for
# digging into one part (sets up .venv on first use). Tables, JSON and pictures go to
# out/perf/; docs/performance.md comes from scripts/performance.sh instead (one run).
#   scripts/perf.sh                 # everything (a few minutes on 2 cores)
#   ONLY=allreduce scripts/perf.sh  # one part: allreduce, speed, chunks, ps, ddp, trace
#   HOSTFILE=hostfiles/mpich-localhost scripts/perf.sh
# Measure on a quiet machine: other jobs on the same cores change every number.
source "$(dirname "$0")/_hostfile.sh"  # first: a bad HOSTFILE stops before any set-up
source "$(dirname "$0")/_venv.sh"
OUT=out/perf
mkdir -p "$OUT"
run() { [ -z "${ONLY:-}" ] || [ "$ONLY" = "$1" ]; }
uptime > "$OUT/load.txt"
if run allreduce; then
    for n in 2 4; do
        echo "== all_reduce on $n ranks: ring vs native (MPI_Allreduce) vs gloo, 4 KiB to 64 MiB ==" >&2
        mpiexec "${HOSTARGS[@]}" -n "$n" python -m mpiring bench -b 4K -e 64M --stepfactor 2 -n 20 -w 3 \
            --algo ring,native,gloo --model --json "$OUT/allreduce-$n.json" \
            --plot "$OUT/busbw-$n.png" | tee "$OUT/allreduce-$n.txt"
    done
fi
if run speed; then
    for n in 2 3 4; do
        echo "== $n ranks: ring, ring-seg and auto vs MPI_Allreduce, pipelined vs MPI_Bcast, 8 B to 256 MiB ==" >&2
        mpiexec "${HOSTARGS[@]}" -n "$n" python -m mpiring bench -c all_reduce,broadcast \
            --algo native,ring,ring-seg,auto,pipelined -b 8 -e 256M -f 2 -n 20 -w 3 \
            --json "$OUT/speed-$n.json" | tee "$OUT/speed-$n.txt"
    done
    for n in 2 4; do
        for view in "" --grad-as-bucket-view; do
            echo "== DDP step on $n ranks, the issue's setting (comm GPT, 1 x 64 tokens) $view ==" >&2
            mpiexec "${HOSTARGS[@]}" -n "$n" python -m mpiring bench-ddp --preset comm --batch-size 1 \
                -n 10 -w 2 --modes compute,ddp,naive,flat-mpi,torch-ddp --bucket-sweep 8 $view \
                | tee "$OUT/ddp-speed-$n${view:+-view}.txt"
        done
    done
    OUT="$OUT/ddp_memory.jsonl" RANKS=2 "$(dirname "$0")/ddp_memory.sh" | tee "$OUT/ddp_memory.txt"
fi
if run chunks; then
    echo "== pipelined Broadcast: S against the model's S* ==" >&2
    mpiexec "${HOSTARGS[@]}" -n 4 python -m mpiring bench --sweep-chunks 16M -n 10 -w 2 \
        --json "$OUT/chunks.json" | tee "$OUT/chunks.txt"
fi
if run ps; then
    echo "== parameter server vs ring AllReduce, K = 2..4 ==" >&2
    mpiexec "${HOSTARGS[@]}" -n 4 python -m mpiring bench --ps 16M -n 10 -w 2 --json "$OUT/ps.json" \
        --plot "$OUT/ps.png" | tee "$OUT/ps.txt"
fi
if run ddp; then
    echo "== DDP step: compute vs ddp vs naive vs ps vs torch-ddp, bucket sweep ==" >&2
    mpiexec "${HOSTARGS[@]}" -n 4 python -m mpiring bench-ddp --preset comm --batch-size 2 -n 5 -w 1 \
        --bucket-sweep 1,4 \
        --json "$OUT/ddp.json" --plot "$OUT/ddp.png" | tee "$OUT/ddp.txt"
fi
if run trace; then
    echo "== a traced ring AllReduce: timeline and step diagram ==" >&2
    rm -rf "$OUT/trace"
    mpiexec "${HOSTARGS[@]}" -n 4 python -m mpiring allreduce --size 16M --iters 1 --trace "$OUT/trace"
    python -m mpiring trace merge "$OUT/trace" -o "$OUT/trace.json"
    python -m mpiring trace plot "$OUT/trace" -o "$OUT/timeline.png" \
        --title "ring AllReduce of 16 MiB on 4 ranks"
    rm -rf "$OUT/trace-small"
    mpiexec "${HOSTARGS[@]}" -n 4 python -m mpiring allreduce --size 1K --iters 1 --trace "$OUT/trace-small"
    python -m mpiring trace explain "$OUT/trace-small" | tee "$OUT/explain.txt"
fi
uptime >> "$OUT/load.txt"
