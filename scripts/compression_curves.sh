#!/usr/bin/env bash
# Validation loss vs step for every DDP comm hook next to no compression, with the
# bytes each sends and its step time: writes docs/compression_curves.{png,json}.
#   scripts/compression_curves.sh                     # 4 ranks, 'small' GPT, 150 steps per hook
#   NP=2 STEPS=60 scripts/compression_curves.sh --preset tiny
# Extra arguments go to `python -m mpiring hook-curves` (see --help).
source "$(dirname "$0")/_venv.sh"
NP="${NP:-4}"
STEPS="${STEPS:-150}"
mkdir -p docs
mpiexec -n "$NP" python -m mpiring hook-curves --steps "$STEPS" --eval-every 15 \
    --out docs/compression_curves "$@"
