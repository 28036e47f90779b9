#!/usr/bin/env bash
# The project's whole check, as CI runs it: set up the venv (with the mpi extra,
# mpi4py and the MPICH wheel, the lightning, docs and release extras), build
# Horovod (cached after the first run), lint, type-check, check the import
# layers, build the documentation site with warnings as errors, build and check
# the sdist and wheel and import the wheel from a fresh venv, and run every
# test, the MPI ones under the real mpiexec and Lightning's under its launcher
# (tests/test_docs.py checks the built site and runs the docs' code blocks);
# and, in the integrations venv (scripts/setup_integrations.sh), scvi-tools and
# cell2location trained through the strategy, on the lowest supported Lightning.
#
# Two lanes share the machine's two cores, because most of a test's time is
# spent waiting (on a launcher's start-up, a rendezvous, a time-out it checks):
# the integrations venv is made and its tests run in the background while the
# main lane builds Horovod, checks and runs the main tests on two pytest
# workers (-n 2; the Slurm tests stay on one, tests/conftest.py). The
# integrations lane's output is printed when both lanes are done.
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
#
# The Slurm tests start a one-node Slurm (scripts/start_slurm.sh: munged,
# slurmctld, slurmd) unless it is running already; the daemons this command
# started are stopped when its last pytest process ends, and daemons that were
# running before are left running. To keep them for the next run (whose start
# then takes well under a second):
#
#   PYRO_DISTRIBUTED_KEEP_SLURM=1 bash scripts/test.sh
#
# and `bash scripts/start_slurm.sh stop` stops them.
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=
if [[ "${1:-}" == "--quick" ]]; then
    QUICK=1
    shift
fi
PYRO_DISTRIBUTED_EXTRAS=${PYRO_DISTRIBUTED_EXTRAS:-dev,examples,mpi,lightning,docs,release}
. scripts/setup_env.sh

INTEGRATIONS_LOG=
if [[ -z "$QUICK" ]]; then
    # scripts/test_integrations.sh: scvi-tools and cell2location (and jax,
    # ~2 GB) in a venv of their own, on the lowest Lightning the strategy
    # supports. In a process group of its own (set -m), so that stopping it
    # stops every process it started.
    INTEGRATIONS_LOG=$(mktemp "${TMPDIR:-/tmp}/pyro-distributed-integrations.XXXXXX")
    set -m
    bash scripts/test_integrations.sh "$@" >"$INTEGRATIONS_LOG" 2>&1 &
    INTEGRATIONS_LANE=$!
    set +m
    # A main lane that fails stops the other lane too, and nothing is left running.
    trap 'kill -- -"$INTEGRATIONS_LANE" 2>/dev/null || true; rm -f "$INTEGRATIONS_LOG"' EXIT
    bash scripts/install_horovod.sh
fi

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
# --dist loadgroup: tests marked xdist_group (the Slurm ones) share one worker.
status=0
python -m pytest -n 2 --dist loadgroup --durations=25 "$@" || status=$?

echo "[test] waiting for the integrations lane"
lane=0
wait "$INTEGRATIONS_LANE" || lane=$?
trap - EXIT
cat "$INTEGRATIONS_LOG"
rm -f "$INTEGRATIONS_LOG"
echo "[test] main tests: exit $status; integrations lane: exit $lane"
(( status == 0 && lane == 0 ))
