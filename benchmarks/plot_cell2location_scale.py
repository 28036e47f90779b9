"""Step time and memory per worker against the number of spots, at a fixed batch.

Reads the results ``bench_cell2location.py --steps`` wrote for one
configuration at several sizes, dense and sparse local updates, and draws
``benchmarks/cell2location_scale.png``: the median step and each worker's
peak resident memory, training's own and in all, against the spots. Run::

    python benchmarks/plot_cell2location_scale.py RESULTS.json [RESULTS.json ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def series(results: dict[str, Any], config: str) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    """``config``'s rows by local updates, each ``(spots, row)`` in order of spots."""
    from bench_cell2location import _key_parts

    lines: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for key, row in results.items():
        size, _, updates, name = _key_parts(key)
        if name == config and "step_s" in row:
            lines.setdefault(updates, []).append((int(size.split("x")[0]), row))
    return {
        updates: sorted(points, key=lambda point: point[0]) for updates, points in lines.items()
    }


def draw(results: dict[str, Any], config: str, target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (steps, memory) = plt.subplots(1, 2, figsize=(10, 4.2))
    for updates, points in series(results, config).items():
        spots = [n for n, _ in points]
        steps.plot(
            spots, [row["step_s"] for _, row in points], "o-", label=f"{updates} local updates"
        )
        peak = [max(row["peak_rss_mb"]) / 1024 for _, row in points]
        own = [
            max(p - b for p, b in zip(row["peak_rss_mb"], row["rss_before_train_mb"], strict=True))
            / 1024
            for _, row in points
        ]
        memory.plot(spots, peak, "o-", label=f"peak, {updates}")
        memory.plot(spots, own, "s--", label=f"training's own, {updates}")
    steps.set_ylim(bottom=0)
    memory.set_ylim(bottom=0)
    steps.set_xlabel("spots")
    memory.set_xlabel("spots")
    steps.set_ylabel("median step (s), slowest worker")
    memory.set_ylabel("largest worker (GiB)")
    steps.legend()
    memory.legend(fontsize=8)
    figure.suptitle(f"cell2location, 8,588 genes, a fixed batch: {config}")
    figure.tight_layout()
    figure.savefig(target, dpi=110)
    print(f"wrote {target}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--config", default="W=2 owned, by rows, global batch")
    parser.add_argument("--out", default=str(HERE / "cell2location_scale.png"))
    args = parser.parse_args()
    results: dict[str, Any] = {}
    for path in args.results:
        results.update(json.loads(Path(path).read_text()))
    draw(results, args.config, Path(args.out))


if __name__ == "__main__":
    main()
