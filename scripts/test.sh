#!/usr/bin/env bash
# The project's whole check, as CI runs it: set up the venv (with the mpi extra,
# mpi4py and the MPICH wheel, and the lightning extra), build Horovod (cached
# after the first run), lint, type-check, check the import layers and run every
# test, the MPI ones under the real mpiexec and Lightning's under its launcher.
#
#   bash scripts/test.sh [extra pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
PYRO_DISTRIBUTED_EXTRAS=${PYRO_DISTRIBUTED_EXTRAS:-dev,examples,mpi,lightning}
. scripts/setup_env.sh

bash scripts/install_horovod.sh

echo "[test] ruff"
ruff check pyro_distributed tests examples benchmarks scripts
ruff format --check pyro_distributed tests examples benchmarks scripts
echo "[test] mypy"
mypy
echo "[test] import layers"
lint-imports
echo "[test] pytest"
python -m pytest "$@"
