"""Peak memory of each worker while it loads a checkpoint, against the file's size.

Run under torchrun, once to save and once to load, in fresh processes::

    torchrun --nproc-per-node 2 benchmarks/checkpoint_memory.py --phase save --mb 128 --dir /tmp/ck
    torchrun --nproc-per-node 2 benchmarks/checkpoint_memory.py --phase load --mb 128 --dir /tmp/ck

The run holds one parameter of ``--mb`` MiB, stepped once by SGD (which keeps
no state), so the checkpoint is that size. Loading happens after the
parameter exists, as a resumed script does; each worker prints, as JSON, its
resident memory before the load and its peak during it (``ru_maxrss``), and
the peak's excess over what it held before, in multiples of the file's size.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
from pathlib import Path

import pyro
import torch

import pyro_distributed as pd


def resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--phase", choices=("save", "load"), required=True)
    parser.add_argument("--mb", type=int, default=128)
    parser.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args()
    pd.init()
    optim = pd.DistributedOptimizer(pyro.optim.SGD({"lr": 0.1}))
    param = pyro.param("big", torch.zeros(args.mb * 2**20 // 4)).unconstrained()
    path = args.dir / "run.pt"
    if args.phase == "save":
        param.sum().backward()
        optim([param])
        pd.save_checkpoint(path, optim)
    else:
        before = resident_mib()
        pd.load_checkpoint(path, optim)
        file_mib = path.stat().st_size / 2**20
        peak = peak_mib()
        report = {
            "rank": pd.rank(),
            "world_size": pd.world_size(),
            "file_mib": round(file_mib, 1),
            "resident_before_mib": round(before, 1),
            "peak_mib": round(peak, 1),
            "excess_in_files": round((peak - before) / file_mib, 2),
        }
        print(json.dumps(report), flush=True)
    pd.shutdown()


if __name__ == "__main__":
    main()
