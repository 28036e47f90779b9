#!/usr/bin/env bash
# Creates (or reuses) the venv for tests/integrations: the pinned CPU torch first,
# then this package editable with the "integrations" extra (scvi-tools,
# cell2location, pyro-ppl 1.9.1 and, through them, jax: about 2 GB) and the dev
# extra. It is a venv of its own so that the main venv keeps the newest Lightning
# and Pyro while this one tests the lowest Lightning the strategy supports.
#
#   bash scripts/setup_integrations.sh
#
# Environment variables, all optional:
#   PYRO_DISTRIBUTED_INTEGRATIONS_VENV  where (default .venv-integrations in the repo)
#   PYRO_DISTRIBUTED_LIGHTNING          Lightning's version (default 2.4.0, the
#                                       lowest of the lightning extra's range)
#   and torch's, as scripts/setup_env.sh documents.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYRO_DISTRIBUTED_VENV=${PYRO_DISTRIBUTED_INTEGRATIONS_VENV:-$ROOT/.venv-integrations}
export PYRO_DISTRIBUTED_EXTRAS=dev,integrations
export PYRO_DISTRIBUTED_LIGHTNING=${PYRO_DISTRIBUTED_LIGHTNING:-2.4.0}
start=$(date +%s)
# shellcheck disable=SC1091
. "$ROOT/scripts/setup_env.sh"
python -c "import scvi, cell2location, lightning, pyro; print('[setup] scvi-tools', scvi.__version__, \
'cell2location', cell2location.__version__, 'lightning', lightning.__version__, 'pyro', pyro.__version__)"
echo "[setup] integrations venv $PYRO_DISTRIBUTED_VENV ready in $(( $(date +%s) - start ))s"
