#!/usr/bin/env bash
# The GPU check: the library's CUDA paths, run for real in one command (at most 8 minutes).
#
# Made for a machine with one GPU, Python 3.12, torch with CUDA, Lightning,
# mpi4py, pytest, scikit-learn and matplotlib, no pyro-ppl, and no package
# registry. What it lacks travels with the repository as wheels in .whl/
# (git-ignored), downloaded first on a machine that reaches PyPI:
#
#   bash scripts/gpu_check.sh --download      # runs, in the repository's root:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       --platform manylinux1_x86_64 -d .whl \
#       pyro-ppl==1.9.2 pyro-api==0.1.2 mpi4py==4.1.2 mpich==5.0.2 cffi==2.1.1 pycparser==3.12
#   python3 -m pip download --no-deps --no-binary :all: -d .whl horovod==0.28.1
#
# (about 20 MB: pyro-ppl and pyro-api, which pyro-ppl needs beside numpy,
# opt-einsum, torch and tqdm that the machine has; mpi4py and the MPICH wheel
# that CI tests, for the MPI engine and its mpiexec; Horovod's source and the
# cffi and pycparser it needs beside what the machine has, for the seed's own
# engine built with NCCL GPU operations.) Then, on the GPU machine,
# from a copy of the repository with .whl/ in it:
#
#   bash scripts/gpu_check.sh                 # installs the wheels into a temporary prefix
#
# It writes its logs and results to $OUT (else $GPU_CHECK_OUT, else
# /tmp/gpu_check): gpu_check.log (every command's output), steps.tsv,
# bench.jsonl, env.txt and summary.md, the table it prints last. It exits
# non-zero when a step failed. On CUDA it runs:
#   * the tests marked cuda (tests/test_cuda.py, pytest --cuda) and tests/test_devices.py;
#   * W=1: the quickstart (on the GPU when there is one) and the VAE example with --device cuda;
#   * W=2 on the one GPU: the quickstart under torchrun (the torch engine: CUDA tensors on
#     gloo, since NCCL refuses two workers on one GPU) and under mpiexec (staged);
#   * timings, one run: plain Pyro and ours at W=1 on the VAE and on small400;
#   * owned local parameters, dense and sparse local steps, N = 10^6 and 10^7 rows,
#     W=2 on the GPU (torchrun), against plain Pyro at W=1: step time and GPU memory per worker;
#   * a cell2location-shaped spatial mapping in plain Pyro (benchmarks/spatial_workload.py)
#     at 3x10^5 spots x 2,000 genes, full batch: plain Pyro at W=1 against W=2 owned on the
#     one GPU, each worker making and holding its block of counts only: peak GPU memory
#     per worker and step time;
#   * Horovod, last: built against the machine's torch with NCCL GPU operations
#     (scripts/install_horovod.sh --gpu, from the source in .whl/), then the quickstart
#     under horovodrun on the GPU, W=1 (NCCL refuses two workers on one GPU).
#
# Other modes, for a machine without a GPU:
#   --dry-run   checks the plumbing in seconds: the wheels (present and installable for
#               Python 3.12, or the download command when .whl/ is absent), the tests
#               marked cuda (collected), the message on "no CUDA device", the plan and
#               the table. tests/test_gpu_check.py runs it.
#   --cpu       the whole sequence on the CPU at small sizes (slow on a small machine).
# Environment: PYTHON (default python3), GPU_CHECK_BUDGET (seconds, default 450),
# GPU_CHECK_STEPS (an extended regular expression: run only the steps whose names match,
# for a second run of what failed, e.g. GPU_CHECK_STEPS='mpiexec|local10000000').

set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
WHEEL_DIR=${GPU_CHECK_WHEELS:-$ROOT/.whl}
WHEELS=(pyro-ppl==1.9.2 pyro-api==0.1.2 mpi4py==4.1.2 mpich==5.0.2 cffi==2.1.1 pycparser==3.12)
# The files those are saved as (mpi4py's and cffi's are built for CPython 3.12).
WHEEL_FILES=(pyro_ppl-1.9.2-*.whl pyro_api-0.1.2-*.whl mpi4py-4.1.2-cp312-*.whl mpich-5.0.2-*.whl
             cffi-2.1.1-cp312-*.whl pycparser-3.12-*.whl)
HOROVOD_SOURCE=horovod-0.28.1.tar.gz
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform manylinux1_x86_64)
CUDA_TESTS=(tests/test_cuda.py)

MODE=run
case "${1:-}" in
    "") ;;
    --dry-run) MODE=dry-run ;;
    --cpu) MODE=cpu ;;
    --download) MODE=download ;;
    -h|--help) sed -n '2,53p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 2 ;;
esac

say() { echo "[gpu_check] $*"; }

download() {
    mkdir -p "$WHEEL_DIR"
    "$PY" -m pip download --no-deps "${TARGET[@]}" -d "$WHEEL_DIR" "${WHEELS[@]}" || exit 1
    "$PY" -m pip download --no-deps --no-binary :all: -d "$WHEEL_DIR" horovod==0.28.1 || exit 1
    du -sh "$WHEEL_DIR"
}

# Fails, with the reason, unless torch sees a GPU.
preflight() {
    "$PY" - <<'EOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: no CUDA device (torch {torch.__version__}, "
             f"torch.version.cuda {torch.version.cuda}): this check needs a GPU; "
             f"--dry-run or --cpu run here")
print(f"[gpu_check] {torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}, "
      f"torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF
}

# The wheels, each present once; pip confirms they install on Python 3.12 x86-64.
check_wheels() {
    local pattern found
    for pattern in "${WHEEL_FILES[@]}" "$HOROVOD_SOURCE"; do
        found=$(cd "$WHEEL_DIR" && ls $pattern 2>/dev/null | wc -l)
        if [ "$found" != 1 ]; then
            say "FAIL wheels: $found files match $WHEEL_DIR/$pattern (need one)"
            return 1
        fi
    done
    local plan
    plan=$("$PY" -m pip install --dry-run --no-index --no-deps --ignore-installed \
        --find-links "$WHEEL_DIR" "${TARGET[@]}" --target "$(mktemp -d)" "${WHEELS[@]}" 2>&1)
    if ! grep -q "Would install.*pyro-ppl-1.9.2" <<<"$plan"; then
        say "FAIL wheels: pip would not install them for Python 3.12:"; echo "$plan"
        return 1
    fi
    say "ok wheels: $(grep 'Would install' <<<"$plan") ($(du -sh "$WHEEL_DIR" | cut -f1))"
}

install_wheels() {
    PREFIX=$(mktemp -d /tmp/gpu_check_prefix.XXXX)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --prefix "$PREFIX" "$WHEEL_DIR"/*.whl || return 1
    local site
    site=$("$PY" -c "import sysconfig as s; v={'base': '$PREFIX', 'platbase': '$PREFIX'}; \
print(s.get_path('purelib', vars=v) + ':' + s.get_path('platlib', vars=v))")
    export PYTHONPATH="$ROOT:$site${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$PREFIX/bin:$PATH" LD_LIBRARY_PATH="$PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    "$PY" -c "import pyro, mpi4py.MPI as M; print('[gpu_check] pyro', pyro.__version__, \
'with', M.Get_library_version().splitlines()[0])"
}

# --- the steps ---------------------------------------------------------------------------------

step() {  # step NAME SECONDS COMMAND...: run it, log it, record its result
    local name=$1 limit=$2 status elapsed started rc
    shift 2
    if [ -n "${GPU_CHECK_STEPS:-}" ] && ! grep -qE "$GPU_CHECK_STEPS" <<<"$name"; then
        return 200  # not selected
    fi
    if [ "$MODE" = dry-run ]; then
        printf '%s\tplanned\t%s\n' "$name" "$limit" >>"$STEPS"
        say "plan: $name (<= ${limit} s): $*"
        return 0
    fi
    local left=$((BUDGET - ($(date +%s) - START)))
    if [ "$left" -lt 15 ]; then
        printf '%s\tskipped (time)\t0\n' "$name" >>"$STEPS"
        say "$name: skipped, the budget of $BUDGET s is spent"
        return 201
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name: $*" >>"$LOG"
    started=$(date +%s%N)
    timeout -k 5 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    elapsed=$((($(date +%s%N) - started) / 100000000))
    elapsed="$((elapsed / 10)).$((elapsed % 10))"
    case $rc in
        0) status=ok ;;
        124|137) status="timeout (${limit} s)" ;;
        *) status="FAIL (exit $rc)"; FAILED=1 ;;
    esac
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && FAILED=1
    printf '%s\t%s\t%s\n' "$name" "$status" "$elapsed" >>"$STEPS"
    say "$name: $status (${elapsed%.*} s)"
    return "$rc"
}

bench() {  # bench LABEL WORKLOAD OPTIM LAUNCHER...: one svi_worker run, its line in bench.jsonl
    local label=$1 workload=$2 optim=$3 json
    shift 3
    if [ "$MODE" = dry-run ]; then
        step "time $workload $optim ($label)" 150 "$@" benchmarks/svi_worker.py \
            --workload "$workload" --optim "$optim" --device "$DEVICE"
        return
    fi
    local rc
    json=$(mktemp)
    step "time $workload $optim ($label)" 150 "$@" benchmarks/svi_worker.py \
        --workload "$workload" --optim "$optim" --device "$DEVICE" \
        --steps "$BENCH_STEPS" --warmup "$WARMUP" --json-out "$json"
    rc=$?
    if [ "$rc" = 0 ]; then
        "$PY" -c "import json, sys; r = json.load(open(sys.argv[1])); r['label'] = sys.argv[2]; \
print(json.dumps(r))" "$json" "$label" >>"$BENCH"
    elif [ "$rc" -lt 200 ]; then  # it ran and failed (not left out, not out of time)
        echo "{\"workload\": \"$workload\", \"optim\": \"$optim\", \"label\": \"$label\"," \
            "\"error\": \"see gpu_check.log\"}" >>"$BENCH"
    fi
    rm -f "$json"
}

sequence() {
    local one=("$PY") torchrun=("$PY" -m torch.distributed.run --standalone --nproc-per-node 2)
    local mpi=(mpiexec -n 2 "$PY") scratch n
    scratch=$(mktemp -d)
    local cuda_env=(env PYRO_DISTRIBUTED_TEST_DEVICE="$DEVICE")
    step "tests marked cuda" 240 "${cuda_env[@]}" "$PY" -m pytest -q -p no:cacheprovider \
        --cuda -m cuda "${CUDA_TESTS[@]}"
    step "tests/test_devices.py" 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_devices.py
    step "quickstart W=1" 120 "${one[@]}" examples/quickstart.py
    step "VAE example W=1 --device $DEVICE" 150 "${one[@]}" examples/vae_digits.py \
        --device "$DEVICE" --max-steps "$VAE_STEPS" --figure "$scratch/vae.png" \
        --checkpoint "$scratch/vae.pt"
    step "quickstart W=2, torchrun (torch engine)" 150 "${torchrun[@]}" examples/quickstart.py
    step "quickstart W=2, mpiexec (mpi engine)" 150 "${mpi[@]}" examples/quickstart.py
    for workload in vae small400; do
        bench "W=1" "$workload" plain "${one[@]}"
        bench "W=1" "$workload" ours "${one[@]}"
    done
    for n in $LOCAL_NS; do
        bench "W=1" "local$n" plain "${one[@]}"
        bench "W=2 torchrun" "local$n" ours-owned "${torchrun[@]}"
        bench "W=2 torchrun" "local$n" ours-sparse "${torchrun[@]}"
    done
    bench "W=2 mpiexec" "local${LOCAL_NS%% *}" ours-sparse "${mpi[@]}"
    bench "W=1" "$SPATIAL" plain "${one[@]}"
    bench "W=2 torchrun" "$SPATIAL" ours-owned "${torchrun[@]}"
    if [ "$DEVICE" = cuda ]; then  # a CPU build is the newest lane's (scripts/test_newest.sh)
        # Into the machine's Python (the wheel has to be where horovodrun's workers
        # import it), from .whl/ only: the machine reaches no registry.
        step "Horovod: build with NCCL GPU operations" 300 env \
            HOROVOD_SDIST="$WHEEL_DIR/$HOROVOD_SOURCE" PYTHON="$PY" PIP_NO_INDEX=1 \
            PIP_FIND_LINKS="$WHEEL_DIR" PYRO_DISTRIBUTED_CACHE="$scratch/cache" \
            bash scripts/install_horovod.sh --gpu --no-check \
            && step "quickstart W=1, horovodrun (horovod engine, NCCL)" 120 \
                "$PY" -m horovod.runner.launch --gloo -np 1 -H localhost:1 "$PY" examples/quickstart.py
    fi
    rm -rf "$scratch"
}

# --- the modes ---------------------------------------------------------------------------------

if [ "$MODE" = download ]; then
    download
    exit 0
fi

OUT_DIR=${OUT:-${GPU_CHECK_OUT:-/tmp/gpu_check}}
mkdir -p "$OUT_DIR"
LOG=$OUT_DIR/gpu_check.log STEPS=$OUT_DIR/steps.tsv BENCH=$OUT_DIR/bench.jsonl
: >"$LOG"
: >"$STEPS"
: >"$BENCH"
START=$(date +%s) BUDGET=${GPU_CHECK_BUDGET:-450} FAILED=0
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

if [ "$MODE" = dry-run ]; then
    DEVICE=cuda LOCAL_NS="1000000 10000000" BENCH_STEPS=30 WARMUP=5 VAE_STEPS=300
    SPATIAL=spatial300000x2000
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    if [ -d "$WHEEL_DIR" ]; then
        check_wheels || FAILED=1
    else
        say "skipped wheels: $WHEEL_DIR is not here (CI has none); download them with"
        say "  bash scripts/gpu_check.sh --download    (the command is in this script's header)"
    fi
    listed=$(PYRO_DISTRIBUTED_TEST_DEVICE=cpu "$PY" -m pytest --collect-only -q \
        -p no:cacheprovider --cuda -m cuda "${CUDA_TESTS[@]}" 2>&1)
    count=$(grep -c "::" <<<"$listed")
    if [ "$count" -gt 0 ]; then
        say "ok tests marked cuda: $count collected"
        grep "::" <<<"$listed" | sed 's/^/    /'
    else
        say "FAIL tests marked cuda: none collected"; echo "$listed"; FAILED=1
    fi
    refusal=$(CUDA_VISIBLE_DEVICES="" preflight 2>&1)
    if [ $? -ne 0 ] && grep -q "no CUDA device" <<<"$refusal"; then
        say "ok without a GPU the check stops with: $refusal"
    else
        say "FAIL the no-CUDA preflight did not refuse: $refusal"; FAILED=1
    fi
    sequence
    "$PY" scripts/gpu_check_report.py "$STEPS" "$BENCH" >"$OUT_DIR/summary.md" || FAILED=1
    say "ok table: $(grep -c 'planned' "$OUT_DIR/summary.md") planned steps in $OUT_DIR/summary.md"
    [ "$FAILED" = 0 ] && say "dry run passed" || say "dry run FAILED"
    exit "$FAILED"
fi

if [ "$MODE" = cpu ]; then
    DEVICE=cpu LOCAL_NS="10000" BENCH_STEPS=3 WARMUP=1 VAE_STEPS=10 SPATIAL=spatial4000x200
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    "$PY" -c "import pyro" 2>/dev/null || install_wheels || exit 1
else
    DEVICE=cuda LOCAL_NS="1000000 10000000" BENCH_STEPS=30 WARMUP=5 VAE_STEPS=300
    SPATIAL=spatial300000x2000
    preflight > >(tee -a "$LOG") 2>&1 || exit 3
    # Not in a pipeline: install_wheels exports PATH and PYTHONPATH for what follows.
    install_wheels > >(tee -a "$LOG") 2>&1 || { say "FAIL installing $WHEEL_DIR/*.whl"; exit 1; }
fi
{
    echo "date: $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    "$PY" -c "import torch, pyro, sys; print('python', sys.version.split()[0], 'torch', \
torch.__version__, 'cuda', torch.version.cuda, 'pyro', pyro.__version__)"
    git -C "$ROOT" log -1 --format='commit %H %s' 2>/dev/null || echo "commit: (no git here)"
} >"$OUT_DIR/env.txt" 2>&1
cat "$OUT_DIR/env.txt"
sequence
"$PY" scripts/gpu_check_report.py "$STEPS" "$BENCH" | tee "$OUT_DIR/summary.md"
say "$(($(date +%s) - START)) s in all; logs in $OUT_DIR"
exit "$FAILED"
