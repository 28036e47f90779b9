# Source this file: it creates (or reuses) the project's virtualenv, installs the
# pinned build of torch first, then this package with the extras named in
# $PYRO_DISTRIBUTED_EXTRAS (default "dev,examples"), and activates the venv.
#
# torch is pinned here, not in pyproject.toml: the package accepts any torch>=2.5
# so that GPU users keep their CUDA build, but an unpinned install on a fresh
# machine would pull a CUDA build of several GB.
#
# Where torch comes from (environment variables, all optional):
#   PYRO_DISTRIBUTED_TORCH        the version (default 2.13.0)
#   PYRO_DISTRIBUTED_TORCH_INDEX  a package index to take torch from, instead of
#                                 pip's own. On a machine with internet access,
#                                 https://download.pytorch.org/whl/cpu gives the
#                                 small CPU-only build (about 200 MB instead of
#                                 several GB of CUDA libraries from PyPI).
#   PYRO_DISTRIBUTED_TORCH_WHEEL  a torch wheel file (path or URL) to install as
#                                 it is; it must be of the version above.
# With neither, pip resolves torch==$PYRO_DISTRIBUTED_TORCH as configured: on the
# development and CI machines it finds the CPU wheel on local disk.
#
# With the "mpi" extra (scripts/test.sh asks for it), mpi4py and the MPICH wheel
# are pinned too, to the versions CI tests:
#   PYRO_DISTRIBUTED_MPI4PY       mpi4py's version (default 4.1.2)
#   PYRO_DISTRIBUTED_MPICH        the mpich wheel's version (default 5.0.2)
# With the "lightning" or "integrations" extra, Lightning is pinned to one release
# of the extra's range:
#   PYRO_DISTRIBUTED_LIGHTNING    its version (default 2.6.6, the highest tested;
#                                 scripts/setup_integrations.sh asks for the lowest)
# And, for a lane of its own (scripts/setup_newest.sh sets them):
#   PYRO_DISTRIBUTED_PYTHON       the interpreter that makes a new venv (default python3)
#   PYRO_DISTRIBUTED_PYRO         pyro-ppl's version, pinned (default: the newest
#                                 release the package's range and the extras allow)

PYRO_DISTRIBUTED_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYRO_DISTRIBUTED_VENV=${PYRO_DISTRIBUTED_VENV:-$PYRO_DISTRIBUTED_ROOT/.venv}
PYRO_DISTRIBUTED_TORCH=${PYRO_DISTRIBUTED_TORCH:-2.13.0}
PYRO_DISTRIBUTED_EXTRAS=${PYRO_DISTRIBUTED_EXTRAS:-dev,examples}

if [ ! -x "$PYRO_DISTRIBUTED_VENV/bin/python" ]; then
    echo "[setup] creating $PYRO_DISTRIBUTED_VENV"
    "${PYRO_DISTRIBUTED_PYTHON:-python3}" -m venv "$PYRO_DISTRIBUTED_VENV"
fi
# shellcheck disable=SC1091
. "$PYRO_DISTRIBUTED_VENV/bin/activate"

if ! python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$PYRO_DISTRIBUTED_TORCH')" 2>/dev/null; then
    if [ -n "${PYRO_DISTRIBUTED_TORCH_WHEEL:-}" ]; then
        echo "[setup] installing torch from $PYRO_DISTRIBUTED_TORCH_WHEEL"
        python -m pip install -q "$PYRO_DISTRIBUTED_TORCH_WHEEL"
    elif [ -n "${PYRO_DISTRIBUTED_TORCH_INDEX:-}" ]; then
        echo "[setup] installing torch==$PYRO_DISTRIBUTED_TORCH from $PYRO_DISTRIBUTED_TORCH_INDEX"
        python -m pip install -q --index-url "$PYRO_DISTRIBUTED_TORCH_INDEX" \
            "torch==$PYRO_DISTRIBUTED_TORCH"
    else
        echo "[setup] installing torch==$PYRO_DISTRIBUTED_TORCH"
        python -m pip install -q "torch==$PYRO_DISTRIBUTED_TORCH"
    fi
fi
PYRO_DISTRIBUTED_PINS=("torch==$PYRO_DISTRIBUTED_TORCH")
if [ -n "${PYRO_DISTRIBUTED_PYRO:-}" ]; then
    PYRO_DISTRIBUTED_PINS+=("pyro-ppl==$PYRO_DISTRIBUTED_PYRO")
fi
case ",$PYRO_DISTRIBUTED_EXTRAS," in
    *,mpi,*) PYRO_DISTRIBUTED_PINS+=("mpi4py==${PYRO_DISTRIBUTED_MPI4PY:-4.1.2}"
                                     "mpich==${PYRO_DISTRIBUTED_MPICH:-5.0.2}") ;;
esac
case ",$PYRO_DISTRIBUTED_EXTRAS," in
    *,lightning,* | *,integrations,*)
        PYRO_DISTRIBUTED_PINS+=("lightning==${PYRO_DISTRIBUTED_LIGHTNING:-2.6.6}") ;;
esac
echo "[setup] installing pyro-distributed[$PYRO_DISTRIBUTED_EXTRAS]"
# torch==VERSION again, so that the package's torch>=2.5 cannot swap the build
# installed above for another (a local label such as +cpu satisfies it).
python -m pip install -q -e "$PYRO_DISTRIBUTED_ROOT[$PYRO_DISTRIBUTED_EXTRAS]" \
    "${PYRO_DISTRIBUTED_PINS[@]}"
