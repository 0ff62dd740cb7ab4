#!/usr/bin/env bash
# The main job: 4 ranks run a traced ring AllReduce, every step logged, checked
# against MPI's own MPI_Allreduce (sets up .venv on first use).
#   scripts/demo.sh                      # 4 ranks, 1 KiB, steps on stderr
#   NP=3 SIZE=64M scripts/demo.sh        # other rank count / size
#   HOSTFILE=hostfiles/mpich-localhost scripts/demo.sh
# Ends with a short data-parallel training run (mpiring.DistributedDataParallel).
source "$(dirname "$0")/_hostfile.sh"  # first: a bad HOSTFILE stops before any set-up
source "$(dirname "$0")/_venv.sh"
NP="${NP:-4}"
SIZE="${SIZE:-1K}"
echo "== ring AllReduce of $SIZE on $NP ranks, one line per ring step ==" >&2
mpiexec "${HOSTARGS[@]}" -n "$NP" python -m mpiring allreduce --size "$SIZE" --algo ring --log steps --trace trace/demo
echo "== 64 MiB: ring vs MPI_Allreduce ==" >&2
mpiexec "${HOSTARGS[@]}" -n "$NP" python -m mpiring allreduce --size 64M --algo ring
mpiexec "${HOSTARGS[@]}" -n "$NP" python -m mpiring allreduce --size 64M --algo native
echo "== DDP training: a tiny GPT on the standard library's source, $NP ranks, buckets overlapped with backward ==" >&2
mpiexec "${HOSTARGS[@]}" -n "$NP" python -m mpiring train --mode ddp --preset tiny --steps 30 --batch-size 4 --max-data-mb 1 --trace trace/train
