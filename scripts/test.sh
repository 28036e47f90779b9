#!/usr/bin/env bash
# The project's whole check, as CI runs it, in three lanes that run side by
# side on the machine's two cores, because most of a test's time is spent
# waiting (on a launcher's start-up, a rendezvous, a time-out it checks). Each
# test runs in one lane:
#
# - the main lane: set up the venv (Python 3.11, the pinned CPU torch 2.13.0,
#   the newest pyro-ppl, Lightning 2.6.6, with the mpi, lightning, docs and
#   release extras), lint, type-check, check the import layers, build the
#   documentation site with warnings as errors, build and check the sdist and
#   wheel and import the wheel from a fresh venv, and run every test that
#   --quick leaves out (launchers, W=3, the examples and the docs' code, Slurm,
#   Lightning's own launcher) but the Horovod, MPI and several-host ones, on
#   two pytest workers (-n 2; the Slurm tests stay on one, tests/conftest.py);
# - the integrations lane (scripts/test_integrations.sh): scvi-tools and
#   cell2location trained through the strategy, on the lowest supported
#   Lightning, in a venv of their own;
# - the newest lane (scripts/test_newest.sh): a new user's stack (Python 3.13,
#   the registry's torch 2.15.0 CUDA build, pyro-ppl 1.9.2, Lightning 2.6.6),
#   Horovod built against it, mypy against its annotations, the quick suite,
#   and the Horovod, MPI and several-host tests (hosts made of network
#   namespaces: mostly waiting, and a new user's stack across hosts).
#
# The other lanes' output is printed when all are done, with each lane's time.
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

LANES=
started=$SECONDS
if [[ -z "$QUICK" ]]; then
    # The other lanes, side by side, each writing its log and "<exit status>
    # <seconds>". In a process group of their own (set -m), so that stopping it
    # stops every process they started.
    LANES=$(mktemp -d "${TMPDIR:-/tmp}/pyro-distributed-lanes.XXXXXX")
    set -m
    (
        set +m  # the lanes stay in this group, which stop_lanes signals
        for lane in integrations newest; do
            (
                lane_started=$SECONDS
                lane_status=0
                bash "scripts/test_$lane.sh" "$@" >"$LANES/$lane.log" 2>&1 || lane_status=$?
                echo "$lane_status $((SECONDS - lane_started))" >"$LANES/$lane.status"
            ) &
        done
        wait
    ) &
    BACKGROUND=$!
    set +m
    # A main lane that fails stops the other lanes too: an interrupt first, so
    # that pytest tears its fixtures down and stops the launchers they started
    # (in sessions of their own), then, after up to 10 s, a kill.
    stop_lanes() {
        kill -INT -- -"$BACKGROUND" 2>/dev/null || return 0
        for _ in $(seq 20); do
            kill -0 -- -"$BACKGROUND" 2>/dev/null || return 0
            sleep 0.5
        done
        kill -KILL -- -"$BACKGROUND" 2>/dev/null || true
    }
    trap 'stop_lanes; rm -rf "$LANES"' EXIT
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
# The quick suite and the Horovod, MPI and several-host tests run in the newest lane; -m
# replaces the "not integrations" of pyproject.toml's addopts, so it is said again.
status=0
python -m pytest -n 2 --dist loadgroup --durations=25 --outside-quick \
    -m "not (integrations or horovod or mpi or cluster)" "$@" || status=$?
main_seconds=$((SECONDS - started))

echo "[test] waiting for the other lanes"
wait "$BACKGROUND" || true
trap - EXIT
summary="[test] main lane: exit $status in ${main_seconds}s"
failed=$status
for lane in integrations newest; do
    echo "[test] ===== the $lane lane ====="
    cat "$LANES/$lane.log" 2>/dev/null || true
    read -r lane_status lane_seconds 2>/dev/null <"$LANES/$lane.status" || lane_status="did not finish"
    summary+="; $lane lane: exit $lane_status${lane_seconds:+ in ${lane_seconds}s}"
    [[ "$lane_status" == 0 ]] || failed=1
    lane_seconds=
done
rm -rf "$LANES"
echo "$summary; all: $((SECONDS - started))s"
(( failed == 0 ))
