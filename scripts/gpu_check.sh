#!/usr/bin/env bash
# One command on a machine with a GPU (no package index needed): install carried
# wheels, print `python -m mpiring info`, run the GPU tests, run a short GPU
# benchmark, measure the CPU collectives and DDP with a core per rank
# (scripts/core_per_rank.sh, where the host has 8 cores or more), and print a
# summary. Ends in under 10 minutes (GPU tests 4, benchmarks 2.5, CPU part 3 at most).
#
#   scripts/gpu_check.sh
#
# Environment (all optional):
#   PYTHON=python3       interpreter that has cupy, nvidia-nccl, torch, mpi4py, pytest
#   WHEELS=.whl          folder of extra wheels (e.g. the mpich wheel); see docs/gpu.md
#   NP=4                 ranks for the GPU tests (they use sub-communicators of 1..4 ranks)
#   GPU_CHECK_DIR=out/gpu-check   where logs and bench.json go
#   CORE_CHECK=0         leave out the CPU part; CORE_BUDGET_S=150 its time
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-$ROOT/.whl}"
NP="${NP:-4}"
LOGS="${GPU_CHECK_DIR:-$ROOT/out/gpu-check}"
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
START=$SECONDS
SUMMARY=()
FAILED=0

note() { printf '\n=== %s\n' "$*"; }
record() {  # record STATUS NAME SECONDS DETAIL
    SUMMARY+=("$(printf '%-5s %-34s %5ss  %s' "$1" "$2" "$3" "$4")")
    [ "$1" = FAIL ] && FAILED=1
    return 0
}
finish() {
    printf '\n=== gpu_check summary (%ss in all)\n' "$((SECONDS - START))"
    printf '%s\n' "${SUMMARY[@]}"
    if [ -s "$LOGS/bench.txt" ]; then
        printf -- '--- benchmark\n'
        cat "$LOGS/bench.txt"
    fi
    if [ -s "$LOGS/core-per-rank.txt" ]; then
        printf -- '--- CPU, a core per rank\n'
        grep -vE '^\+ ' "$LOGS/core-per-rank.txt"
    fi
    if [ "$FAILED" = 0 ]; then echo "gpu_check: PASS"; else echo "gpu_check: FAIL"; fi
    exit "$FAILED"
}

# --- 1. carried wheels ---------------------------------------------------------------
t=$SECONDS
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    note "installing $(ls "$WHEELS"/*.whl | wc -l) wheel(s) from $WHEELS"
    SITE="${TMPDIR:-/tmp}/mpiring-site"
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" \
            "$WHEELS"/*.whl; then
        # pip --target keeps only a wheel's Python files: the mpich wheel's data
        # (bin/mpiexec, lib/libmpi.so.12) has to be unpacked by hand.
        "$PY" - "$SITE" "$WHEELS"/*.whl <<'EOF'
import os, sys, zipfile
site, wheels = sys.argv[1], sys.argv[2:]
for whl in wheels:
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if len(parts) > 3 and parts[0].endswith(".data") and parts[1] == "data" \
                    and not info.is_dir():
                dest = os.path.join(site, *parts[2:])
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                with z.open(info) as src, open(dest, "wb") as out:
                    out.write(src.read())
                mode = (info.external_attr >> 16) & 0o777
                os.chmod(dest, mode or 0o644)
EOF
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
        export PATH="$SITE/bin:$PATH"
        export LD_LIBRARY_PATH="$SITE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        # mpi4py looks for libmpi in its own prefix; point it at the unpacked one.
        [ -e "$SITE/lib/libmpi.so.12" ] && export MPI4PY_LIBMPI="$SITE/lib/libmpi.so.12"
        record PASS "install wheels" "$((SECONDS - t))" "$(cd "$WHEELS" && ls *.whl | tr '\n' ' ')"
    else
        record FAIL "install wheels" "$((SECONDS - t))" "pip could not install $WHEELS/*.whl"
    fi
else
    record SKIP "install wheels" 0 "no $WHEELS/*.whl (using what $PY has)"
fi
# mpiring from this checkout: nothing to install.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# --- 2. MPI and launcher -------------------------------------------------------------
t=$SECONDS
if ! "$PY" -c "from mpi4py import MPI; MPI.Get_library_version()" >"$LOGS/mpi.txt" 2>&1; then
    record FAIL "MPI library" "$((SECONDS - t))" \
        "mpi4py finds no MPI library: put the mpich wheel in .whl/ (docs/gpu.md)"
    tail -5 "$LOGS/mpi.txt"
    finish
fi
if command -v mpiexec >/dev/null 2>&1; then
    LAUNCH=(mpiexec -n)
    record PASS "MPI library" "$((SECONDS - t))" "$("$PY" -c \
        'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0].strip())')"
else
    LAUNCH=()
    NP=1
    record FAIL "mpiexec" 0 "no mpiexec on PATH: only one rank (carry the mpich wheel)"
fi
run_ranks() {  # run_ranks SECONDS N cmd...: N ranks under mpiexec (one without it), time-boxed
    local secs="$1" n="$2"; shift 2
    if [ "${#LAUNCH[@]}" -gt 0 ]; then
        timeout "$secs" "${LAUNCH[@]}" "$n" "$@"
    else
        timeout "$secs" "$@"
    fi
}

# --- 3. what is here -----------------------------------------------------------------
note "nvidia-smi -L"
timeout 20 nvidia-smi -L 2>&1 || echo "(nvidia-smi not available)"
note "python -m mpiring info"
t=$SECONDS
if timeout 60 "$PY" -m mpiring info 2>&1 | tee "$LOGS/info.txt"; then
    record PASS "mpiring info" "$((SECONDS - t))" \
        "$(grep -E '^(GPUs|NCCL) ' "$LOGS/info.txt" | tr -s ' ' | tr '\n' ';' | cut -c1-90)"
else
    record FAIL "mpiring info" "$((SECONDS - t))" "see $LOGS/info.txt"
fi
NCCL_AT_LEAST_2_30=$("$PY" - <<'EOF' 2>/dev/null
from mpiring.backends.gpu import import_nccl, nccl_version_tuple
lib, _ = import_nccl()
print(int(lib is not None and nccl_version_tuple(lib.get_version()) >= (2, 30)))
EOF
)
if [ "${NCCL_AT_LEAST_2_30:-0}" = 1 ]; then
    # Two ranks of one NCCL communicator on this one GPU (experimental in NCCL 2.30).
    export NCCL_MULTI_RANK_GPU_ENABLE="${NCCL_MULTI_RANK_GPU_ENABLE:-1}"
fi

# --- 4. GPU tests --------------------------------------------------------------------
# test_gpu_review.py: the stream hand-over on one GPU (where a one-rank collective
# moves nothing, so test_gpu.py's stream check cannot fail), and the CPU-side
# checks of the CUDA calls against CuPy's and NCCL's real signatures.
GPU_TESTS=(tests/test_gpu.py tests/test_gpu_cpu_side.py tests/test_gpu_review.py)
note "GPU tests: mpiexec -n $NP pytest ${GPU_TESTS[*]}"
t=$SECONDS
run_ranks 240 "$NP" "$PY" -m pytest -q -rs -p no:cacheprovider \
    "${GPU_TESTS[@]}" 2>&1 | tee "$LOGS/tests.txt"
rc=${PIPESTATUS[0]}
counts=$(grep -E '[0-9]+ (passed|failed|skipped|error)' "$LOGS/tests.txt" | tail -1 | tr -d '=')
if [ "$rc" = 0 ] && grep -q "no GPU:" "$LOGS/tests.txt"; then
    record FAIL "GPU tests" "$((SECONDS - t))" "all skipped: $(grep -m1 -o 'no GPU:.*' "$LOGS/tests.txt")"
elif [ "$rc" = 0 ]; then
    record PASS "GPU tests" "$((SECONDS - t))" "$counts"
elif [ "$rc" = 124 ]; then
    record FAIL "GPU tests" "$((SECONDS - t))" "timed out after 240 s; see $LOGS/tests.txt"
else
    record FAIL "GPU tests" "$((SECONDS - t))" "rc=$rc $counts"
fi
grep -E "^SKIPPED" "$LOGS/tests.txt" | sed 's/^/      /' | sort -u | head -20 >"$LOGS/skips.txt"

# --- 5. short GPU benchmark ----------------------------------------------------------
note "GPU benchmark: NCCL native vs ring, MPI staged/CUDA-aware vs host"
t=$SECONDS
: >"$LOGS/bench.txt"
BENCH_NP=2
[ "${#LAUNCH[@]}" -eq 0 ] && BENCH_NP=1
if run_ranks 100 "$BENCH_NP" "$PY" -m mpiring gpu-bench --sizes 1M,64M --iters 10 \
        --json "$LOGS/bench.json" 2>&1 | tee -a "$LOGS/bench.txt"; then
    status=PASS
else
    status=FAIL
fi
if [ "$BENCH_NP" = 2 ] && grep -q "^nccl     skipped" "$LOGS/bench.txt"; then
    # NCCL could not put two ranks on this GPU: measure NCCL with one rank.
    timeout 60 "$PY" -m mpiring gpu-bench --backends nccl --sizes 1M,64M --iters 10 \
        2>&1 | grep -E "^nccl" | sed 's/$/   (1 rank)/' | tee -a "$LOGS/bench.txt"
fi
record "$status" "GPU benchmark" "$((SECONDS - t))" "$LOGS/bench.json"

# --- 5b. tensor parallelism on the GPU: where the GEMMs are short enough for the
# communication layer to show (issue: mpiring's TP at most 0.8x torch's TP over gloo).
note "bench-tp on the GPU: MLP width 2048, TP=$BENCH_NP against 1 rank and torch's TP over gloo"
t=$SECONDS
if run_ranks 90 "$BENCH_NP" "$PY" -m mpiring bench-tp --device cuda --widths 2048 --blocks mlp \
        -n 10 --json "$LOGS/bench-tp.json" 2>&1 | tail -4 | tee -a "$LOGS/bench.txt"; then
    record PASS "bench-tp on the GPU" "$((SECONDS - t))" "$LOGS/bench-tp.json"
else
    record FAIL "bench-tp on the GPU" "$((SECONDS - t))" "see above"
fi

# --- 6. CPU speed with a core per rank -----------------------------------------------
# The host's many cores measure what a 2-core machine cannot: the rings against
# MPI with a core per rank, DDP's overlap with a core to spare (docs/benchmarks.md).
if [ "${CORE_CHECK:-1}" != 0 ] && [ "${#LAUNCH[@]}" -gt 0 ]; then
    note "CPU speed with a core per rank: scripts/core_per_rank.sh"
    t=$SECONDS
    if PYTHON="$PY" CORES_DIR="$LOGS/core-per-rank" BUDGET_S="${CORE_BUDGET_S:-150}" \
            scripts/core_per_rank.sh 2>&1 | tee "$LOGS/core-per-rank.txt"; then
        if grep -q "^core_per_rank: SKIP" "$LOGS/core-per-rank.txt"; then
            record SKIP "CPU speed, a core per rank" "$((SECONDS - t))" \
                "$(grep -m1 -o 'SKIP: .*' "$LOGS/core-per-rank.txt" | cut -c7-80)"
        else
            record PASS "CPU speed, a core per rank" "$((SECONDS - t))" "$LOGS/core-per-rank/"
        fi
    else
        record FAIL "CPU speed, a core per rank" "$((SECONDS - t))" "see $LOGS/core-per-rank.txt"
    fi
else
    record SKIP "CPU speed, a core per rank" 0 "CORE_CHECK=0 or no mpiexec"
fi
if [ -s "$LOGS/skips.txt" ]; then
    SUMMARY+=("      skipped tests and why:")
    while IFS= read -r line; do SUMMARY+=("$line"); done <"$LOGS/skips.txt"
fi
finish
