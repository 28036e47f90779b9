#!/usr/bin/env bash
# Build the sdist and the wheel (the wheel from the sdist, as pip would), check
# their metadata with twine, install the wheel into a fresh virtualenv and
# import it there, so that a file missing from either fails. Run it in the
# project's venv (the release extra has build and twine):
#
#   bash scripts/check_package.sh
#
# The build runs without isolation (the venv's setuptools), so it needs no
# network. torch, Pyro and Lightning are not installed a second time: the fresh
# venv sees them through PYTHONPATH, which carries the test venv's
# site-packages but not its .pth files, so the editable install of this
# package stays invisible and the import can only find the wheel's copy.
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONPATH
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

python -m build --no-isolation --outdir "$work/dist" . >"$work/build.log" 2>&1 \
    || { cat "$work/build.log"; exit 1; }
python -m twine check --strict "$work"/dist/*
wheel=$(ls "$work"/dist/*.whl)
sdist=$(ls "$work"/dist/*.tar.gz)
tar -tzf "$sdist" >"$work/sdist.txt"
for file in LICENSE README.md CHANGELOG.md pyproject.toml pyro_distributed/py.typed; do
    grep -q "/$file\$" "$work/sdist.txt" || { echo "the sdist lacks $file"; exit 1; }
done

# A bare venv (no pip of its own: ensurepip is slow); this venv's pip installs into it.
python -m venv --without-pip "$work/venv"
env -u PYTHONPATH python -m pip --python "$work/venv/bin/python" install -q --no-deps --no-index \
    "$wheel" 2>&1 | grep -v "^WARNING: Location" || true
test -d "$work/venv/lib/"python3*/site-packages/pyro_distributed \
    || { echo "the wheel did not install into the fresh venv"; exit 1; }
site=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
version=$(python -c "import pyro_distributed; print(pyro_distributed.__version__)")
(cd "$work" && env -u PYTHONPATH PYTHONPATH="$site" "$work/venv/bin/python" - "$work/venv" "$version" <<'PY'
import importlib.metadata
import pathlib
import sys

import pyro_distributed as pd
import pyro_distributed.integrations.lightning
import pyro_distributed.integrations.scvi

venv, version = pathlib.Path(sys.argv[1]), sys.argv[2]
where = pathlib.Path(pd.__file__).resolve()
assert venv.resolve() in where.parents, f"imported {where}, not the wheel's copy"
# The wheel's metadata, not the test venv's editable install (also on PYTHONPATH).
(dist,) = importlib.metadata.distributions(name="pyro-distributed", path=[str(where.parent.parent)])
assert pd.__version__ == version == dist.version, (pd.__version__, version, dist.version)
assert (where.parent / "py.typed").is_file(), "the wheel lacks py.typed"
missing = [name for name in pd.__all__ if not hasattr(pd, name)]
assert not missing, missing
licenses = [f for f in dist.files or () if f.name == "LICENSE"]
assert licenses, "the wheel lacks LICENSE"
print(f"[package] pyro-distributed {version}: sdist and wheel pass twine check; "
      f"the wheel imports from a fresh venv ({len(pd.__all__)} public names)")
PY
)
