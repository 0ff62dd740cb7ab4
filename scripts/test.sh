#!/usr/bin/env bash
# Run the whole test suite under `mpiexec -n 4` (sets up .venv on first use).
#   scripts/test.sh                 # everything
#   scripts/test.sh -k broadcast    # extra arguments go to pytest
#   NP=2 scripts/test.sh            # another rank count
source "$(dirname "$0")/_venv.sh"
NP="${NP:-4}"
set +e
mpiexec -n "$NP" python -m pytest -q -p no:cacheprovider "$@" tests
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "scripts/test.sh: pytest collected no tests: that is a failure, not a pass" >&2
fi
exit "$rc"
