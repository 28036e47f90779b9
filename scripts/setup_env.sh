# Source this file: it creates (or reuses) the project's virtualenv, installs the
# pinned CPU build of torch first, then this package with the extras named in
# $PYRO_DISTRIBUTED_EXTRAS (default "dev,examples"), and activates the venv.
#
# torch is pinned here, not in pyproject.toml: the package accepts any torch>=2.1
# so that GPU users keep their CUDA build, but an unpinned install on a fresh
# machine would pull a CUDA build of several GB.

PYRO_DISTRIBUTED_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYRO_DISTRIBUTED_VENV=${PYRO_DISTRIBUTED_VENV:-$PYRO_DISTRIBUTED_ROOT/.venv}
PYRO_DISTRIBUTED_TORCH=${PYRO_DISTRIBUTED_TORCH:-2.13.0}

if [ ! -x "$PYRO_DISTRIBUTED_VENV/bin/python" ]; then
    echo "[setup] creating $PYRO_DISTRIBUTED_VENV"
    python3 -m venv "$PYRO_DISTRIBUTED_VENV"
fi
# shellcheck disable=SC1091
. "$PYRO_DISTRIBUTED_VENV/bin/activate"

if ! python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$PYRO_DISTRIBUTED_TORCH')" 2>/dev/null; then
    echo "[setup] installing torch==$PYRO_DISTRIBUTED_TORCH"
    python -m pip install -q "torch==$PYRO_DISTRIBUTED_TORCH"
fi
echo "[setup] installing pyro-distributed[${PYRO_DISTRIBUTED_EXTRAS:-dev,examples}]"
python -m pip install -q -e "$PYRO_DISTRIBUTED_ROOT[${PYRO_DISTRIBUTED_EXTRAS:-dev,examples}]" \
    "torch==$PYRO_DISTRIBUTED_TORCH"
