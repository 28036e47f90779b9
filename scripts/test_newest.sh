#!/usr/bin/env bash
# The newest lane of scripts/test.sh, runnable alone: a new user's stack
# (scripts/setup_newest.sh: Python 3.13, the registry's torch 2.15.0 CUDA
# build, pyro-ppl 1.9.2, Lightning 2.6.6), Horovod built against that torch
# (scripts/install_horovod.sh: C++20, and CPU operations where the CUDA
# toolkit is partial or there is no GPU), mypy against that torch's
# annotations, and, in that venv, the quick suite, the Horovod tests, the MPI
# tests and the tests across hosts made of network namespaces.
#
#   bash scripts/test_newest.sh [extra pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_newest.sh
VENV=${PYRO_DISTRIBUTED_NEWEST_VENV:-$PWD/.venv-newest}
NEWEST_PYTHON=$VENV/bin/python
# A base temporary directory of its own: the main tests may be running beside it.
BASETEMP=$(mktemp -d "${TMPDIR:-/tmp}/pyro-distributed-newest-tests.XXXXXX")
trap 'rm -rf "$BASETEMP"' EXIT
echo "[test] newest: Horovod, built where only part of a CUDA toolkit is found"
# Built as on a machine whose nvcc came without the rest of the toolkit (conda's
# or a pip wheel's nvcc alone): an nvcc first on the PATH, with no headers and
# no cudart beside it. torch guesses the folder above it as CUDA_HOME, and
# Horovod's own CMake then asks for a toolkit that is not there.
mkdir -p "$BASETEMP/partial-cuda/bin"
printf '#!/bin/sh\necho "Cuda compilation tools, release 13.2, V13.2.0"\n' \
    >"$BASETEMP/partial-cuda/bin/nvcc"
chmod +x "$BASETEMP/partial-cuda/bin/nvcc"
env -u CUDA_HOME -u CUDA_PATH PATH="$BASETEMP/partial-cuda/bin:$PATH" PIP_CONFIG_FILE=/dev/null \
    PYTHON="$NEWEST_PYTHON" bash scripts/install_horovod.sh
status=0
echo "[test] newest: mypy"
"$NEWEST_PYTHON" -m mypy || status=$?
echo "[test] newest: pytest --quick, then the Horovod, MPI and several-host tests"
# --dist loadgroup: the tests of a module that share one launch stay on one worker.
"$NEWEST_PYTHON" -m pytest --basetemp "$BASETEMP/quick" --quick -n 2 --dist loadgroup \
    --durations=5 "$@" || status=$?
"$NEWEST_PYTHON" -m pytest --basetemp "$BASETEMP/engines" -n 2 --dist loadgroup --durations=5 \
    -m "horovod or mpi or cluster" "$@" || status=$?
exit "$status"
