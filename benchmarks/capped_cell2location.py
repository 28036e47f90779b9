"""The user's story: spots that do not fit one worker's memory train on two.

Each worker runs under a memory cap (a memory cgroup of its own,
``benchmarks/memory_cap.py``; root only), as on nodes with that much memory.
The driver:

1. trains W=1 without a cap, twice (seeds 0 and 1): the reference abundances,
   the noise between two equally good answers, and W=1's peak memory as the
   kernel charges it (``memory_cap.peak_megabytes``: the resident set less
   shared libraries already cached, which the cap does not count);
2. trains W=2 with owned spots read by rows (``read_h5ad_by_rows``) for a few
   epochs without a cap: its charged peak per worker;
3. sets the cap halfway between the two peaks, and trains W=1 under it (the
   kernel kills it: it does not fit) and W=2 under it, as long as step 1;
4. compares W=2's abundances with W=1's, against the seed noise, and draws
   ``docs/cell2location_capped.png``.

Run (full batch, as cell2location trains by default)::

    python benchmarks/capped_cell2location.py --spots 10000 --genes 300 --epochs 200

and it prints the numbers and writes ``benchmarks/cell2location_capped.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from bench_cell2location import load_example, relative, run, write_data

HERE = Path(__file__).resolve().parent


def story(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    data = workdir / f"data{args.spots}x{args.genes}.h5ad"
    if not data.exists():
        write_data(data, args, args.spots)

    def train(config: str, tag: str, *, epochs: int, cap: int | None, seed: int = 0) -> Any:
        options = argparse.Namespace(
            epochs=epochs,
            threads=args.threads,
            batch_size=None,
            memory_cap=cap,
            abundance=epochs == args.epochs,
            steps=None,
            local_updates="dense",
            address_space_mb=None,
        )
        reports = run(options, data, workdir / tag, config, seed=seed)
        if reports is None:
            return None, None
        peak = max(report["charged_peak_mb"] for report in reports)
        abundance = np.load(workdir / f"{tag}.abundance.npy") if options.abundance else None
        return peak, abundance

    # Uncapped runs: a cgroup whose limit never binds, to read what the kernel charges.
    unbound = 64 * 1024
    w1_peak, w1 = train("W=1", "w1-seed0", epochs=args.epochs, cap=unbound)
    _, w1_other = train("W=1", "w1-seed1", epochs=args.epochs, cap=unbound, seed=1)
    w2_peak, _ = train("W=2 owned, by rows", "w2-uncapped", epochs=3, cap=unbound)
    cap = int((w1_peak + w2_peak) / 2)
    print(f"peaks: W=1 {w1_peak:.0f} MB, W=2 {w2_peak:.0f} MB per worker; cap {cap} MB", flush=True)
    w1_capped_peak, _ = train("W=1", "w1-capped", epochs=args.epochs, cap=cap)
    w2_capped_peak, w2 = train("W=2 owned, by rows", "w2-capped", epochs=args.epochs, cap=cap)
    result: dict[str, Any] = {
        "spots": args.spots,
        "genes": args.genes,
        "epochs": args.epochs,
        "peak_w1_mb": w1_peak,
        "peak_w2_per_worker_mb": w2_peak,
        "cap_mb": cap,
        "w1_under_the_cap": _outcome(w1_capped_peak),
        "w2_under_the_cap": _outcome(w2_capped_peak),
    }
    if w2 is not None:
        result["w2_vs_w1"] = relative(w2, w1)
        result["seed_noise_w1"] = relative(w1_other, w1)
        result["correlation_w2_w1"] = float(np.corrcoef(w2.ravel(), w1.ravel())[0, 1])
        _figure(w1, w1_other, w2, result)
    print(json.dumps(result, indent=1))
    (HERE / "cell2location_capped.json").write_text(json.dumps(result, indent=1))
    return result


def _outcome(peak: float | None) -> str:
    return "killed by the cap" if peak is None else f"trained, peak {peak:.0f} MB"


def _figure(w1: np.ndarray, w1_other: np.ndarray, w2: np.ndarray, result: dict[str, Any]) -> None:
    load_example().draw_against_w1(
        w1,
        [
            (w1_other, "W=1, another seed (the noise)"),
            (w2, f"W=2 by rows, each under {result['cap_mb']} MB"),
        ],
        xlabel="cell abundance, W=1 without a cap (median)",
        title=f"cell2location, {result['spots']:,} spots x {result['genes']} genes: "
        f"W=1 is killed at the cap, W=2 trains",
        target=HERE.parent / "docs" / "cell2location_capped.png",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spots", type=int, default=10_000)
    parser.add_argument("--genes", type=int, default=300)
    parser.add_argument("--types", type=int, default=30)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workdir", default="/tmp/capped_cell2location")
    story(parser.parse_args(namespace=argparse.Namespace(umis_per_bin=None)))


if __name__ == "__main__":
    main()
