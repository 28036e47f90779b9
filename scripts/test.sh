#!/usr/bin/env bash
# The project's whole check, as CI runs it: set up the venv (with the mpi extra,
# mpi4py and the MPICH wheel, and the lightning extra), build Horovod (cached
# after the first run), lint, type-check, check the import layers and run every
# test, the MPI ones under the real mpiexec and Lightning's under its launcher;
# then, in the integrations venv (scripts/setup_integrations.sh), scvi-tools and
# cell2location trained through the strategy, on the lowest supported Lightning.
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

# scvi-tools and cell2location (and jax, ~2 GB) in a venv of their own, with
# the lowest Lightning the strategy supports: the integration tests, and the
# Lightning tests again on that Lightning (the main venv has the highest).
echo "[test] integrations"
bash scripts/setup_integrations.sh
INTEGRATIONS_PYTHON=${PYRO_DISTRIBUTED_INTEGRATIONS_VENV:-.venv-integrations}/bin/python
"$INTEGRATIONS_PYTHON" -m pytest tests/integrations tests/lightning \
    -m "integrations or not (horovod or mpi)" "$@"
