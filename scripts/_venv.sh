# Sourced by the other scripts: make sure .venv exists with mpiring installed, then use it.
# First use creates the virtual environment and installs mpiring with MPICH, CPU
# PyTorch and the test tools; later uses only check that it is still there.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${MPIRING_VENV:-$ROOT/.venv}"
STAMP="$VENV/.mpiring-installed"
if [ ! -f "$STAMP" ] || [ setup.cfg -nt "$STAMP" ]; then
    echo "setting up $VENV (first use: creates the environment and installs mpiring[mpich,torch,test])" >&2
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >&2
    "$VENV/bin/python" -m pip install -q -e ".[mpich,torch,test]" >&2
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export PYTHONUNBUFFERED=1
# One thread per rank: several ranks share the cores, and oversubscribed BLAS
# threads only fight each other.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
