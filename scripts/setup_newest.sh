#!/usr/bin/env bash
# Creates (or reuses) the venv of the newest lane: what a new user's
# `pip install` gives today, on the newest Python the package supports. That is
# Python 3.13, torch 2.15.0 as the package registry serves it (a CUDA 13.2
# build, about 3 GB of wheels; it runs on the CPU where there is no GPU),
# pyro-ppl 1.9.2 and Lightning 2.6.6, with the dev, examples, mpi, lightning and
# docs extras.
#
#   bash scripts/setup_newest.sh
#
# A machine's pip configuration may cap torch at older builds kept on local
# disk (a constraint file, as on the development machines): this lane alone
# reads no pip configuration file (PIP_CONFIG_FILE=/dev/null), so that it gets
# what the registry serves. The main venv keeps the pinned CPU build.
#
# Environment variables, all optional:
#   PYRO_DISTRIBUTED_NEWEST_VENV    where (default .venv-newest in the repo)
#   PYRO_DISTRIBUTED_NEWEST_PYTHON  the Python 3.13 interpreter (default:
#                                   python3.13 on the PATH, then pyenv's newest 3.13)
#   PYRO_DISTRIBUTED_NEWEST_TORCH   torch's version (default 2.15.0)
#   PYRO_DISTRIBUTED_NEWEST_PYRO    pyro-ppl's version (default 1.9.2)
#   PYRO_DISTRIBUTED_NEWEST_LIGHTNING  Lightning's version (default 2.6.6)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)

is_3_13() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 13))' 2>/dev/null; }

# The first of these that runs as Python 3.13 (pyenv's shim for python3.13 is
# on the PATH even where pyenv's selected version is another, and fails there).
find_python() {
    local candidate
    local -a candidates=()
    [ -n "${PYRO_DISTRIBUTED_NEWEST_PYTHON:-}" ] && candidates+=("$PYRO_DISTRIBUTED_NEWEST_PYTHON")
    candidate=$(command -v python3.13 2>/dev/null) && candidates+=("$candidate")
    if command -v pyenv >/dev/null 2>&1; then
        while IFS= read -r candidate; do
            candidates+=("$candidate")
        done < <(ls -d "$(pyenv root)"/versions/3.13*/bin/python3.13 2>/dev/null | sort -rV)
    fi
    for candidate in "${candidates[@]}"; do
        if is_3_13 "$candidate"; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

if ! PYRO_DISTRIBUTED_PYTHON=$(find_python); then
    echo "[setup] the newest lane needs Python 3.13, and none runs here (tried" \
        "PYRO_DISTRIBUTED_NEWEST_PYTHON, python3.13 on the PATH and pyenv's 3.13 versions)." \
        "Install one (pyenv install 3.13) or name it in PYRO_DISTRIBUTED_NEWEST_PYTHON." >&2
    exit 1
fi
export PYRO_DISTRIBUTED_PYTHON
export PIP_CONFIG_FILE=/dev/null
export PYRO_DISTRIBUTED_VENV=${PYRO_DISTRIBUTED_NEWEST_VENV:-$ROOT/.venv-newest}
export PYRO_DISTRIBUTED_EXTRAS=dev,examples,mpi,lightning,docs
export PYRO_DISTRIBUTED_TORCH=${PYRO_DISTRIBUTED_NEWEST_TORCH:-2.15.0}
export PYRO_DISTRIBUTED_PYRO=${PYRO_DISTRIBUTED_NEWEST_PYRO:-1.9.2}
export PYRO_DISTRIBUTED_LIGHTNING=${PYRO_DISTRIBUTED_NEWEST_LIGHTNING:-2.6.6}
unset PYRO_DISTRIBUTED_TORCH_INDEX PYRO_DISTRIBUTED_TORCH_WHEEL
start=$(date +%s)
# shellcheck disable=SC1091
. "$ROOT/scripts/setup_env.sh"
# A venv made earlier by another Python is refused, not reused.
python -c "import sys; sys.exit(None if sys.version_info[:2] == (3, 13) else \
f'[setup] {sys.prefix} is a venv of Python {sys.version.split()[0]}, not 3.13: remove it')"
python -c "import sys, torch, pyro, lightning; print('[setup] Python', sys.version.split()[0], \
'torch', torch.__version__, 'pyro', pyro.__version__, 'lightning', lightning.__version__)"
echo "[setup] newest venv $PYRO_DISTRIBUTED_VENV ready in $(( $(date +%s) - start ))s"
