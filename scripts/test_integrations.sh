#!/usr/bin/env bash
# The integrations lane of scripts/test.sh, runnable alone: make (or reuse) the
# integrations venv (scripts/setup_integrations.sh), then run in it the tests
# that train real scvi-tools and cell2location models under Lightning's own
# launcher, and the Lightning tests that reach into Lightning's
# version-dependent API again on the lowest Lightning the strategy supports
# (the main venv has the highest; the rest of tests/lightning runs there only).
#
#   bash scripts/test_integrations.sh [extra pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_integrations.sh
echo "[test] integrations"
INTEGRATIONS_PYTHON=${PYRO_DISTRIBUTED_INTEGRATIONS_VENV:-.venv-integrations}/bin/python
# A base temporary directory of its own: the main tests may be running beside it.
BASETEMP=$(mktemp -d "${TMPDIR:-/tmp}/pyro-distributed-integrations-tests.XXXXXX")
trap 'rm -rf "$BASETEMP"' EXIT
"$INTEGRATIONS_PYTHON" -m pytest --basetemp "$BASETEMP" --durations=10 tests/integrations \
    tests/lightning/test_internals.py tests/lightning/test_resume_mid_epoch.py \
    -m "integrations or not (horovod or mpi)" "$@"
