"""cell2location's answer at W=2 against W=1's, beside two W=1 seeds against each other.

Three fresh ``model.train()`` runs, one at a time, on one synthetic data set
(``bench_cell2location.py``'s, the same generator as the large runs): W=1
with seeds 0 and 1, and W=2 with owned spots read by rows at W=1's global
batch, seed 0. Each exports the median cell abundance of every spot
(``export_posterior(use_quantiles=True)``, inside ``owned_posterior`` at
W=2). The driver reports each run's relative root-mean-square difference
from W=1 seed 0 and its correlation with it: W=1 seed 1 is the noise between
two equally good answers. Run::

    python benchmarks/agreement_cell2location.py --spots 100000 --genes 300 --epochs 40

and it writes ``benchmarks/cell2location_agreement.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from bench_cell2location import data_path, relative, run, write_data

HERE = Path(__file__).resolve().parent
RUNS = {  # name: (configuration, seed)
    "W=1 seed 0": ("W=1", 0),
    "W=1 seed 1": ("W=1", 1),
    "W=2 owned, by rows, global batch": ("W=2 owned, by rows, global batch", 0),
}


def drive(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    data = data_path(args, args.spots)
    if not data.exists():
        write_data(data, args, args.spots)
    abundances = {}
    for name, (config, seed) in RUNS.items():
        out = workdir / name.replace(" ", "_").replace(",", "").replace("=", "")
        run(args, data, out, config, seed=seed)
        abundances[name] = np.load(f"{out}.abundance.npy")
    reference = abundances["W=1 seed 0"]
    result: dict[str, Any] = {"spots": args.spots, "genes": args.genes, "types": args.types}
    result.update(epochs=args.epochs, batch_size=args.batch_size)
    for name, values in abundances.items():
        if name != "W=1 seed 0":
            result[name] = {
                "relative_rms_vs_w1_seed0": relative(values, reference),
                "correlation_with_w1_seed0": float(
                    np.corrcoef(values.ravel(), reference.ravel())[0, 1]
                ),
            }
    print(json.dumps(result, indent=1))
    target = Path(args.results) if args.results else HERE / "cell2location_agreement.json"
    target.write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spots", type=int, default=100_000)
    parser.add_argument("--genes", type=int, default=300)
    parser.add_argument("--types", type=int, default=50)
    parser.add_argument("--umis-per-bin", type=float, default=523.0)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=10_000, help="spots a step, all workers")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workdir", default="/tmp/bench_cell2location")
    parser.add_argument("--results", help="where the driver writes its JSON")
    defaults = argparse.Namespace(
        abundance=True, memory_cap=None, steps=None, local_updates="dense", address_space_mb=None
    )
    drive(parser.parse_args(namespace=defaults))


if __name__ == "__main__":
    main()
