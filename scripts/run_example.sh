#!/usr/bin/env bash
# Set up the venv and train the main example on 2 workers with torchrun (gloo).
#
#   bash scripts/run_example.sh [example arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
PYRO_DISTRIBUTED_EXTRAS=examples . scripts/setup_env.sh

torchrun --standalone --nproc-per-node 2 examples/bayesian_regression.py "$@"
