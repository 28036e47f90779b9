#!/usr/bin/env bash
# The project's whole check, as CI runs it: set up the venv (with the mpi extra,
# mpi4py and the MPICH wheel, the lightning, docs and release extras), build
# Horovod (cached after the first run), lint, type-check, check the import
# layers, build the documentation site with warnings as errors, build and check
# the sdist and wheel and import the wheel from a fresh venv, and run every
# test, the MPI ones under the real mpiexec and Lightning's under its launcher
# (tests/test_docs.py checks the built site and runs the docs' code blocks);
# then, in the integrations venv (scripts/setup_integrations.sh), scvi-tools and
# cell2location trained through the strategy, on the lowest supported Lightning.
#
#   bash scripts/test.sh [extra pytest arguments]
#
# The inner loop, about 4 minutes on 2 idle cores once the venv exists:
#
#   bash scripts/test.sh --quick [extra pytest arguments]
#
# lint, types, import layers, and pytest --quick: the package's in-process
# tests and its two-worker tests on the torch engine (tests/conftest.py says
# which are left out: every other launcher, W=3, the examples and docs).
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=
if [[ "${1:-}" == "--quick" ]]; then
    QUICK=1
    shift
fi
PYRO_DISTRIBUTED_EXTRAS=${PYRO_DISTRIBUTED_EXTRAS:-dev,examples,mpi,lightning,docs,release}
. scripts/setup_env.sh

[[ -n "$QUICK" ]] || bash scripts/install_horovod.sh

echo "[test] ruff"
ruff check pyro_distributed tests examples benchmarks scripts docs/conf.py docs/_ext
ruff format --check pyro_distributed tests examples benchmarks scripts docs/conf.py docs/_ext
echo "[test] mypy"
mypy
echo "[test] import layers"
lint-imports
if [[ -n "$QUICK" ]]; then
    echo "[test] pytest --quick"
    # Two pytest workers: many tests wait on sockets and process start-up.
    exec python -m pytest --quick -n 2 --durations=10 "$@"
fi
echo "[test] docs"
# -E: a fresh build every time, so every page and docstring is read again.
python -m sphinx -E -W --keep-going -q docs docs/_build/html
export PYRO_DISTRIBUTED_DOCS_HTML="$PWD/docs/_build/html"  # tests/test_docs.py reads it
echo "[test] package"
bash scripts/check_package.sh
echo "[test] pytest"
# --durations: the slowest tests in every run's log, to keep the command's time in view.
python -m pytest --durations=25 "$@"

# scvi-tools and cell2location (and jax, ~2 GB) in a venv of their own, with
# the lowest Lightning the strategy supports: the integration tests (each trains
# real scvi-tools and cell2location models under Lightning's own launcher), and
# the Lightning tests that reach into Lightning's version-dependent API again on
# that Lightning (the main venv has the highest; the rest of tests/lightning
# runs there only, to keep the whole command within its time budget).
echo "[test] integrations"
bash scripts/setup_integrations.sh
INTEGRATIONS_PYTHON=${PYRO_DISTRIBUTED_INTEGRATIONS_VENV:-.venv-integrations}/bin/python
"$INTEGRATIONS_PYTHON" -m pytest --durations=10 tests/integrations tests/lightning/test_internals.py \
    tests/lightning/test_resume_mid_epoch.py -m "integrations or not (horovod or mpi)" "$@"
