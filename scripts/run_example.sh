#!/usr/bin/env bash
# Set up the venv and train the main example, a VAE on scikit-learn's digits,
# on 2 workers with torchrun (gloo). Writes vae_digits.png and vae_digits.pt.
#
#   bash scripts/run_example.sh [example arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
PYRO_DISTRIBUTED_EXTRAS=examples . scripts/setup_env.sh

torchrun --standalone --nproc-per-node 2 examples/vae_digits.py "$@"
