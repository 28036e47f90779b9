#!/usr/bin/env bash
# Build and install Horovod 0.28.1 (PyTorch + Gloo, no MPI/TF/MXNet) into the
# currently active Python environment, against the torch that is already
# installed there: CPU operations over Gloo, and NCCL GPU operations as well
# where a GPU and a usable CUDA toolkit are there.
#
# Usage:
#   . .venv/bin/activate                 # or any env that already has torch
#   scripts/install_horovod.sh [--cpu|--gpu] [--no-check] [--verbose] [-h|--help]
#
# Options:
#   --cpu        CPU operations only (Gloo), even where a GPU is visible
#   --gpu        NCCL GPU operations too; fails, naming what is missing, without
#                a CUDA build of torch and a usable CUDA toolkit
#                (default: --gpu where torch sees a GPU and a usable toolkit is
#                found, --cpu otherwise, saying why)
#   --no-check   skip the final smoke check (hvd.init() + a 2-process
#                `horovodrun --gloo` allreduce)
#   --verbose    stream the full compiler output to the terminal (it is always
#                written to a log file under the cache directory as well)
#   -h, --help   show this help
#
# Environment:
#   PYTHON                  interpreter to install into (default: `python` on PATH)
#   PYRO_DISTRIBUTED_CACHE  cache root (default: $HOME/.cache/pyro-distributed);
#                           built wheels go to $PYRO_DISTRIBUTED_CACHE/wheels/
#   CUDA_HOME               a CUDA toolkit to build GPU operations with (tried
#                           first; then torch's own guess, nvcc's folder and
#                           /usr/local/cuda)
#   HOROVOD_BUILD_CUDA_CC_LIST  compute capabilities for the GPU kernels
#                           (default: those of the visible GPUs)
#   HOROVOD_SDIST           horovod-0.28.1.tar.gz on disk, for a machine that
#                           reaches no package registry (default: downloaded)
#   MAKEFLAGS               passed through if set; otherwise -j$(nproc)
#
# Why a source build: horovod 0.28.1 is the last release and ships no wheels.
# It compiles as C++14, but torch's headers need a newer standard, which they
# name in an #error line (C++17 in torch 2.13, C++20 in torch 2.15): the sdist
# is patched to the standard the installed torch's headers ask for.
# Tested here against torch 2.13 (C++17) and 2.15 (C++20) with GCC 12.
#
# A usable CUDA toolkit has bin/nvcc, include/cuda_runtime.h and libcudart.
# An `nvcc` on the PATH alone is not one: torch then guesses the folder above
# it as CUDA_HOME, and Horovod's CMake, asked for CUDA, stops without the
# headers. Without a usable toolkit (or a GPU), the build leaves CUDA out
# altogether, even against a CUDA build of torch; Horovod's operations then run
# on CPU tensors over Gloo.
#
# The first run compiles for ~2-8 minutes on 2 cores (2 idle, 8 busy ones). The wheel is ABI-tied to
# the torch it was built against, so it is cached per (torch version, python
# tag, arch, C++ standard, operations); later runs with the same torch just
# `pip install` the cached wheel.
#
# If `import horovod.torch` already works with horovod 0.28.1, the script exits
# 0 immediately without doing anything.

set -euo pipefail

HOROVOD_VERSION=0.28.1
SUGGESTED_TORCH_VERSION=2.13.0

RUN_CHECK=1
VERBOSE=0
OPERATIONS=auto

log() { printf '[install_horovod] %s\n' "$*" >&2; }
die() { printf '[install_horovod] ERROR: %s\n' "$*" >&2; exit 1; }
usage() { sed -n '2,/^$/{s/^# \{0,1\}//;p}' "$0"; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --cpu) OPERATIONS=cpu ;;
        --gpu) OPERATIONS=gpu ;;
        --no-check) RUN_CHECK=0 ;;
        --verbose) VERBOSE=1 ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown argument: $1" ;;
    esac
    shift
done

# --------------------------------------------------------------------------
# Python environment and torch
# --------------------------------------------------------------------------
PYTHON="$(command -v "${PYTHON:-python}" || true)"
[[ -n "$PYTHON" ]] || die "no 'python' on PATH; activate the target environment first"
# An absolute path: py() below runs it from another directory.
[[ "$PYTHON" == /* ]] || PYTHON="$PWD/$PYTHON"
PIP=("$PYTHON" -m pip)

WORKDIR="$(mktemp -d "${TMPDIR:-/tmp}/install-horovod.XXXXXX")"
trap 'rm -rf "$WORKDIR"' EXIT

# Run python from a neutral directory, so a horovod/ source tree in the
# caller's cwd can never shadow the installed package.
py() { (cd "$WORKDIR" && "$PYTHON" "$@"); }

# One interpreter start (importing torch costs ~2s) to learn the torch
# version, the python tag, whether a working horovod is already there, torch's
# CUDA version and visible GPUs (their compute capabilities), torch's guess of
# CUDA_HOME, the C++ standard torch's headers ask for, and whether the horovod
# there has NCCL GPU operations.
# Prints: "PROBE <torch version|-> <python tag> <yes|no> <cuda|-> <ccs|-> <cuda home|-> <std> <yes|no>".
probe() {
    py - "$HOROVOD_VERSION" 2>/dev/null <<'EOF_PY' | grep '^PROBE ' | tail -n1
import os, re, sys
tag = f"{sys.implementation.name[:2]}{sys.version_info[0]}{sys.version_info[1]}"
try:
    import torch
except Exception:
    print("PROBE", "-", tag, "no", "-", "-", "-", "-", "no")
    sys.exit(0)
ok = "no"
nccl = "no"
try:
    import horovod
    import horovod.torch  # fails if built against another torch
    ok = "yes" if horovod.__version__ == sys.argv[1] else "no"
    nccl = "yes" if horovod.torch.nccl_built() else "no"
except Exception:
    pass
cuda = torch.version.cuda or "-"
ccs = "-"
if cuda != "-" and torch.cuda.is_available():
    found = {"%d%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    ccs = ",".join(sorted(found))
home = "-"
if cuda != "-":
    from torch.utils import cpp_extension
    home = cpp_extension.CUDA_HOME or "-"
# torch's umbrella header refuses an older standard by name:
#   #error C++17 or later compatible compiler is required to use PyTorch.
std = "17"
umbrella = os.path.join(os.path.dirname(torch.__file__), "include", "torch", "csrc", "api",
                        "include", "torch", "all.h")
try:
    with open(umbrella) as header:
        named = re.search(r"#\s*error\s+C\+\+(\d+) or later", header.read())
    if named:
        std = named.group(1)
except OSError:
    pass
print("PROBE", torch.__version__, tag, ok, cuda, ccs, home.replace(" ", "?"), std, nccl)
EOF_PY
}

read -r _ TORCH_VERSION PY_TAG HOROVOD_OK TORCH_CUDA GPU_CCS TORCH_CUDA_HOME CXX_STANDARD HOROVOD_NCCL \
    <<<"$(probe)" || true
[[ -n "${PY_TAG:-}" ]] || die "could not run $PYTHON"
if [[ "$TORCH_VERSION" == "-" ]]; then
    die "torch is not installed in $PYTHON's environment. Install it first, e.g.:
    pip install torch==${SUGGESTED_TORCH_VERSION}
then re-run this script (horovod is compiled against the installed torch)."
fi
ARCH="$(uname -m)"
log "python: $PYTHON ($PY_TAG), torch: $TORCH_VERSION (CUDA: $TORCH_CUDA, GPUs: $GPU_CCS)"

# A CUDA toolkit that can build against: nvcc, the runtime's headers and
# libcudart, in one folder, of torch's CUDA major version (a toolkit of another
# major would put a second CUDA runtime beside torch's). Prints the first such
# folder of those tried; says why each other candidate was passed over.
usable_toolkit() {
    local root nvcc_path release seen=" "
    local -a tried=("${CUDA_HOME:-}" "${TORCH_CUDA_HOME//\?/ }")
    if nvcc_path="$(command -v nvcc 2>/dev/null)"; then
        tried+=("$(dirname "$(dirname "$(readlink -f "$nvcc_path")")")")
    fi
    tried+=(/usr/local/cuda)
    for root in "${tried[@]}"; do
        [[ -n "$root" && "$root" != "-" && "$seen" != *" $root "* ]] || continue
        seen+="$root "
        if [[ ! -x "$root/bin/nvcc" || ! -f "$root/include/cuda_runtime.h" ]]; then
            log "not a usable CUDA toolkit: $root (no bin/nvcc or include/cuda_runtime.h)"
            continue
        fi
        if ! compgen -G "$root/lib64/libcudart.so*" >/dev/null && ! compgen -G "$root/lib/libcudart.so*" >/dev/null \
            && ! compgen -G "$root/lib/$(uname -m)-linux-gnu/libcudart.so*" >/dev/null; then
            log "not a usable CUDA toolkit: $root (no libcudart)"
            continue
        fi
        release="$("$root/bin/nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9]*\)\..*/\1/p' | head -n1)"
        if [[ "$release" != "${TORCH_CUDA%%.*}" ]]; then
            log "not a usable CUDA toolkit: $root (CUDA ${release:-of unknown release}, torch's is $TORCH_CUDA)"
            continue
        fi
        echo "$root"
        return 0
    done
    return 1
}

TOOLKIT=
if [[ "$TORCH_CUDA" != "-" && ( "$OPERATIONS" == gpu || ( "$OPERATIONS" == auto && "$GPU_CCS" != "-" ) ) ]]; then
    TOOLKIT="$(usable_toolkit)" || TOOLKIT=
fi
case "$OPERATIONS" in
    gpu)
        [[ "$TORCH_CUDA" != "-" ]] || die "--gpu: torch $TORCH_VERSION is not a CUDA build"
        [[ -n "$TOOLKIT" ]] || die "--gpu: no usable CUDA toolkit (nvcc, include/cuda_runtime.h and libcudart in one folder) in \$CUDA_HOME, torch's guess (${TORCH_CUDA_HOME//\?/ }), nvcc's folder or /usr/local/cuda"
        ;;
    auto)
        if [[ "$GPU_CCS" != "-" && -n "$TOOLKIT" ]]; then
            OPERATIONS=gpu
        else
            OPERATIONS=cpu
            if [[ "$TORCH_CUDA" != "-" ]]; then
                if [[ "$GPU_CCS" == "-" ]]; then
                    log "torch is a CUDA $TORCH_CUDA build but sees no GPU: CPU operations (Gloo) only"
                else
                    log "no usable CUDA toolkit (nvcc, include/cuda_runtime.h and libcudart in one folder): CPU operations (Gloo) only; set CUDA_HOME to a full toolkit for NCCL GPU operations"
                fi
            fi
        fi
        ;;
esac
if [[ "$OPERATIONS" == gpu ]]; then
    # The kernels are built for these compute capabilities only: part of the key.
    HOROVOD_BUILD_CUDA_CC_LIST="${HOROVOD_BUILD_CUDA_CC_LIST:-$GPU_CCS}"
    [[ "$HOROVOD_BUILD_CUDA_CC_LIST" != "-" ]] \
        || die "--gpu without a visible GPU: set HOROVOD_BUILD_CUDA_CC_LIST (e.g. 80,90)"
    export HOROVOD_BUILD_CUDA_CC_LIST
    OPERATIONS_KEY="nccl-cu${TORCH_CUDA//./}-sm${HOROVOD_BUILD_CUDA_CC_LIST//,/-}"
    log "operations: CPU (Gloo) and GPU (NCCL), CUDA toolkit $TOOLKIT"
else
    OPERATIONS_KEY=cpu
    log "operations: CPU (Gloo)"
fi
log "C++ standard: $CXX_STANDARD (what torch $TORCH_VERSION's headers ask for)"

# --------------------------------------------------------------------------
# Already installed?
# --------------------------------------------------------------------------
if [[ "$HOROVOD_OK" == yes && ( "$OPERATIONS" != gpu || "$HOROVOD_NCCL" == yes ) ]]; then
    log "horovod $HOROVOD_VERSION with torch support is already installed; nothing to do."
    exit 0
fi

"${PIP[@]}" --version >/dev/null 2>&1 || die "pip is not available for $PYTHON"

CACHE_ROOT="${PYRO_DISTRIBUTED_CACHE:-$HOME/.cache/pyro-distributed}"
CACHE_KEY="horovod-${HOROVOD_VERSION}_torch-${TORCH_VERSION}_${PY_TAG}_${ARCH}_cxx${CXX_STANDARD}_${OPERATIONS_KEY}"
WHEEL_CACHE="$CACHE_ROOT/wheels/$CACHE_KEY"
LOG_DIR="$CACHE_ROOT/logs"
mkdir -p "$WHEEL_CACHE" "$LOG_DIR"

# Never let pip replace the torch that horovod is (being) compiled against.
CONSTRAINTS="$WORKDIR/constraints.txt"
echo "torch==${TORCH_VERSION}" > "$CONSTRAINTS"

# Runtime deps of horovod; setup.py also lists them in setup_requires, so they
# must be present before a --no-build-isolation build.
RUNTIME_DEPS=(cloudpickle psutil pyyaml packaging 'cffi>=1.4.0')

find_cached_wheel() {
    local w
    for w in "$WHEEL_CACHE"/horovod-"${HOROVOD_VERSION}"-*.whl; do
        [[ -f "$w" ]] && { echo "$w"; return 0; }
    done
    return 1
}

# --------------------------------------------------------------------------
# Build the wheel (only if not cached)
# --------------------------------------------------------------------------
pick_cmake() {
    # Any cmake >= 3.13 (setup.py's minimum). /usr/bin/cmake is tried first, as
    # a pip-installed cmake 4.x on PATH rejects gloo's old cmake_minimum_required
    # unless CMAKE_POLICY_VERSION_MINIMUM is set (which build_wheel also does).
    local c v
    for c in /usr/bin/cmake "$(command -v cmake || true)"; do
        [[ -n "$c" && -x "$c" ]] || continue
        v="$("$c" --version 2>/dev/null | sed -n 's/^cmake version \([0-9][0-9.]*\).*/\1/p')"
        [[ -n "$v" ]] || continue
        if py -c 'import sys; v=tuple(map(int, sys.argv[1].split(".")[:2])); sys.exit(0 if v >= (3, 13) else 1)' "$v"; then
            echo "$c"; return 0
        fi
    done
    return 1
}

# The variables a GPU build reads: the toolkit for torch, CMake and Horovod's
# nvcc, NCCL (the toolkit's own, or the nvidia-nccl wheel that torch's CUDA
# build installed), and the compute capabilities of the visible GPUs.
use_toolkit() {
    export CUDA_HOME="$TOOLKIT" CUDAToolkit_ROOT="$TOOLKIT" HOROVOD_CUDA_HOME="$TOOLKIT"
    export PATH="$TOOLKIT/bin:$PATH"
    export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED
    if [[ -z "${HOROVOD_NCCL_HOME:-}${HOROVOD_NCCL_INCLUDE:-}" && ! -f "$TOOLKIT/include/nccl.h" ]]; then
        local wheel
        wheel="$(py -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])' 2>/dev/null)" \
            || die "no NCCL: neither $TOOLKIT/include/nccl.h nor torch's nvidia-nccl wheel; set HOROVOD_NCCL_HOME"
        # The wheel has libnccl.so.2 only; CMake's find_library wants libnccl.so.
        mkdir -p "$WORKDIR/nccl-lib"
        ln -sf "$wheel/lib/libnccl.so.2" "$WORKDIR/nccl-lib/libnccl.so"
        export HOROVOD_NCCL_INCLUDE="$wheel/include" HOROVOD_NCCL_LIB="$WORKDIR/nccl-lib"
        log "NCCL from torch's nvidia-nccl wheel: $wheel"
    fi
    log "GPU operations: NCCL, CUDA toolkit $TOOLKIT, compute capabilities $HOROVOD_BUILD_CUDA_CC_LIST"
}

build_wheel() {
    command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 \
        || die "no C++ compiler found (e.g. 'apt-get install -y build-essential')"
    command -v make >/dev/null 2>&1 || die "'make' not found (e.g. 'apt-get install -y build-essential')"

    # A cmake shim dir in front of PATH: horovod's setup.py calls plain `cmake`.
    # (We do not put /usr/bin itself first, that could shadow the env's python.)
    local cmake_bin
    mkdir -p "$WORKDIR/bin"
    if cmake_bin="$(pick_cmake)"; then
        ln -s "$cmake_bin" "$WORKDIR/bin/cmake"
    else
        log "no usable cmake >= 3.13 found; installing 'cmake>=3.13,<4' into a temp dir"
        "${PIP[@]}" install --quiet --target "$WORKDIR/cmake-py" 'cmake>=3.13,<4'
        printf '#!/bin/sh\nPYTHONPATH=%q exec %q "$@"\n' "$WORKDIR/cmake-py" "$WORKDIR/cmake-py/bin/cmake" \
            > "$WORKDIR/bin/cmake"
        chmod +x "$WORKDIR/bin/cmake"
    fi
    export PATH="$WORKDIR/bin:$PATH"
    # Lets cmake >= 4 accept gloo's old cmake_minimum_required; ignored by 3.x.
    export CMAKE_POLICY_VERSION_MINIMUM=3.5
    log "using $(cmake --version | head -n1) ($(readlink -f "$WORKDIR/bin/cmake" 2>/dev/null || echo "$WORKDIR/bin/cmake"))"

    log "ensuring build prerequisites (setuptools, wheel support, ${RUNTIME_DEPS[*]})"
    py -c 'import setuptools' 2>/dev/null || "${PIP[@]}" install --quiet -c "$CONSTRAINTS" setuptools
    py -c 'import setuptools.command.bdist_wheel' 2>/dev/null || py -c 'import wheel' 2>/dev/null \
        || "${PIP[@]}" install --quiet -c "$CONSTRAINTS" wheel
    "${PIP[@]}" install --quiet -c "$CONSTRAINTS" "${RUNTIME_DEPS[@]}"

    local sdist
    if [[ -n "${HOROVOD_SDIST:-}" ]]; then
        [[ -f "$HOROVOD_SDIST" ]] || die "HOROVOD_SDIST: no file $HOROVOD_SDIST"
        sdist="$HOROVOD_SDIST"
        log "using the source distribution $sdist"
    else
        log "downloading horovod==$HOROVOD_VERSION source distribution from PyPI"
        "${PIP[@]}" download --quiet --no-binary :all: --no-deps -d "$WORKDIR/sdist" "horovod==$HOROVOD_VERSION"
        sdist="$(ls "$WORKDIR"/sdist/horovod-"$HOROVOD_VERSION".tar.gz 2>/dev/null)" \
            || die "pip download did not produce horovod-$HOROVOD_VERSION.tar.gz"
    fi
    mkdir -p "$WORKDIR/src"
    tar -xzf "$sdist" -C "$WORKDIR/src"
    local src="$WORKDIR/src/horovod-$HOROVOD_VERSION"
    [[ -f "$src/setup.py" ]] || die "unexpected sdist layout: $src/setup.py missing"

    log "patching CMake files: CMAKE_CXX_STANDARD 14 -> $CXX_STANDARD (torch $TORCH_VERSION's headers need it)"
    local f
    for f in CMakeLists.txt horovod/torch/CMakeLists.txt; do
        grep -Eq 'set\(CMAKE_CXX_STANDARD 14\)' "$src/$f" \
            || die "C++$CXX_STANDARD patch: 'set(CMAKE_CXX_STANDARD 14)' not found in $f; sdist changed?"
        sed -i -E "s/set\(CMAKE_CXX_STANDARD 14\)/set(CMAKE_CXX_STANDARD $CXX_STANDARD)/g" "$src/$f"
        if grep -Eq 'CMAKE_CXX_STANDARD 14' "$src/$f" || ! grep -Eq "set\(CMAKE_CXX_STANDARD $CXX_STANDARD\)" "$src/$f"; then
            die "C++$CXX_STANDARD patch did not apply cleanly to $f"
        fi
    done

    if [[ "$OPERATIONS" == cpu ]]; then
        # Horovod enables CUDA wherever an nvcc answers on the PATH or a toolkit
        # is half found (and stops when it cannot use it), and asks for CUDA
        # again whenever torch is a CUDA build and torch.utils.cpp_extension
        # guesses a CUDA_HOME, usable or not. A CPU build says no to both.
        log "patching CMakeLists.txt and FindPytorch.cmake: CPU operations, CUDA left out"
        py - "$src" <<'EOF_PY' || die "CPU patch: Horovod's CUDA detection was not found; sdist changed?"
import pathlib, sys
src = pathlib.Path(sys.argv[1])
top = src / "CMakeLists.txt"
text = top.read_text()
start = text.index("include(CheckLanguage)\ncheck_language(CUDA)\n")
end = text.index("    enable_language(CUDA)\nendif()\n", start) + len("    enable_language(CUDA)\nendif()\n")
top.write_text(text[:start] + "# CPU operations only: CUDA detection left out.\n" + text[end:])
find = src / "cmake" / "Modules" / "FindPytorch.cmake"
text = find.read_text()
probe = 'string(TOUPPER "${Pytorch_CUDA}" Pytorch_CUDA)\n'
assert text.count(probe) == 1
find.write_text(text.replace(probe, probe + "set(Pytorch_CUDA FALSE)\n"))
EOF_PY
    fi

    export HOROVOD_WITH_PYTORCH=1
    export HOROVOD_WITHOUT_MPI=1
    export HOROVOD_WITHOUT_TENSORFLOW=1
    export HOROVOD_WITHOUT_MXNET=1
    export HOROVOD_WITH_GLOO=1
    export HOROVOD_CPU_OPERATIONS=GLOO
    if [[ "$OPERATIONS" == gpu ]]; then
        use_toolkit "$src"
    else
        unset HOROVOD_GPU_OPERATIONS HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_ALLGATHER \
            HOROVOD_GPU_BROADCAST HOROVOD_GPU_ALLTOALL HOROVOD_GPU_REDUCESCATTER HOROVOD_GPU
    fi
    # setup.py hard-codes -j8 unless MAKEFLAGS is set; use one job per core.
    export MAKEFLAGS="${MAKEFLAGS:--j$(nproc)}"

    local build_log
    build_log="$LOG_DIR/build-$CACHE_KEY-$(date +%Y%m%d-%H%M%S).log"
    log "building horovod $HOROVOD_VERSION wheel against torch $TORCH_VERSION (MAKEFLAGS=$MAKEFLAGS);"
    log "this takes ~2-8 minutes on 2 cores. Full log: $build_log"
    local start=$SECONDS rc=0
    if [[ $VERBOSE == 1 ]]; then
        (cd "$src" && "${PIP[@]}" wheel -v --no-cache-dir --no-build-isolation --no-deps -w "$WORKDIR/dist" .) 2>&1 \
            | tee "$build_log" || rc=$?
    else
        (cd "$src" && "${PIP[@]}" wheel -v --no-cache-dir --no-build-isolation --no-deps -w "$WORKDIR/dist" .) \
            >"$build_log" 2>&1 || rc=$?
    fi
    if [[ $rc != 0 ]]; then
        tail -n 60 "$build_log" >&2 || true
        die "horovod build failed (exit $rc); see $build_log"
    fi
    log "build finished in $((SECONDS - start))s"

    local built
    built="$(ls "$WORKDIR"/dist/horovod-"$HOROVOD_VERSION"-*.whl 2>/dev/null | head -n1)" \
        || die "build succeeded but no wheel found in $WORKDIR/dist"
    [[ -n "$built" ]] || die "build succeeded but no wheel found in $WORKDIR/dist"
    # Copy then rename, so an interrupted copy never leaves a truncated cached wheel.
    cp "$built" "$WHEEL_CACHE/.$(basename "$built").partial"
    mv "$WHEEL_CACHE/.$(basename "$built").partial" "$WHEEL_CACHE/$(basename "$built")"
    log "cached wheel: $WHEEL_CACHE/$(basename "$built")"
}

if WHEEL="$(find_cached_wheel)"; then
    log "using cached wheel $WHEEL"
else
    build_wheel
    WHEEL="$(find_cached_wheel)" || die "wheel missing from cache after build"
fi

# --------------------------------------------------------------------------
# Install
# --------------------------------------------------------------------------
log "installing $(basename "$WHEEL") (torch pinned to $TORCH_VERSION)"
# Replace any broken/stale horovod (e.g. one built against another torch)...
"${PIP[@]}" install --quiet --no-deps --force-reinstall "$WHEEL"
# ...then let pip resolve horovod's runtime deps, with torch held in place.
"${PIP[@]}" install --quiet -c "$CONSTRAINTS" "$WHEEL"

read -r _ NEW_TORCH _ HOROVOD_OK _ _ _ _ HOROVOD_NCCL <<<"$(probe)" || true
[[ "$NEW_TORCH" == "$TORCH_VERSION" ]] || die "torch changed from $TORCH_VERSION to $NEW_TORCH during install"
if [[ "$HOROVOD_OK" != yes ]]; then
    py -c 'import horovod.torch' || true
    die "installed horovod $HOROVOD_VERSION, but 'import horovod.torch' fails"
fi
if [[ "$OPERATIONS" == gpu && "$HOROVOD_NCCL" != yes ]]; then
    die "installed horovod $HOROVOD_VERSION, but horovod.torch.nccl_built() is false"
fi
log "horovod $HOROVOD_VERSION installed."

# --------------------------------------------------------------------------
# Smoke check
# --------------------------------------------------------------------------
if [[ $RUN_CHECK == 0 ]]; then
    log "skipping smoke check (--no-check)"
    exit 0
fi

log "smoke check 1/2: single-process hvd.init()"
size="$(py -c 'import horovod.torch as hvd; hvd.init(); print(hvd.size())')"
[[ "$size" == 1 ]] || die "expected hvd.size() == 1, got '$size'"

HOROVODRUN="$(py -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/horovodrun"
[[ -x "$HOROVODRUN" ]] || HOROVODRUN="$(command -v horovodrun || true)"
[[ -n "$HOROVODRUN" ]] || die "horovodrun not found after install"

log "smoke check 2/2: horovodrun --gloo -np 2 allreduce"
out="$(cd "$WORKDIR" && timeout 300 "$HOROVODRUN" --gloo -np 2 -H localhost:2 "$PYTHON" -c \
    "import horovod.torch as hvd, torch; hvd.init(); t=hvd.allreduce(torch.ones(1)*hvd.rank(), op=hvd.Sum); print(hvd.rank(), t.item())" 2>&1)" \
    || { printf '%s\n' "$out" >&2; die "horovodrun smoke check failed"; }
printf '%s\n' "$out" >&2
# Each rank prints "<rank> 1.0" (0 + 1); horovodrun prefixes lines with [rank]<stdout>:
n_ok="$(printf '%s\n' "$out" | grep -Ec '[01] 1\.0$' || true)"
[[ "$n_ok" == 2 ]] || die "unexpected horovodrun output (expected both ranks to print 1.0)"
log "smoke check passed."
