"""How long starting W workers takes: pd.launch against torchrun, for one function.

The function joins the engine and meets the others once (``pd.barrier()``).
Three ways to run it, each a whole command to time from outside:

    python benchmarks/launch_startup.py launch W        # a fresh process calls pd.launch
    torchrun --nproc-per-node W benchmarks/launch_startup.py worker
    python benchmarks/launch_startup.py in-process W N  # N launches from one warm process

The last prints each launch's seconds as a warm kernel sees them: the
interpreter and the library already imported, workers forked from it.
"""

from __future__ import annotations

import sys
import time

import pyro_distributed as pd


def meet() -> int:
    pd.barrier()
    return pd.world_size()


def main() -> None:
    mode = sys.argv[1]
    if mode == "worker":  # under torchrun
        pd.init()
        meet()
        pd.shutdown()
    elif mode == "launch":
        assert pd.launch(meet, workers=int(sys.argv[2])).value == int(sys.argv[2])
    elif mode == "in-process":
        workers, times = int(sys.argv[2]), int(sys.argv[3])
        for _ in range(times):
            began = time.perf_counter()
            pd.launch(meet, workers=workers)
            print(f"{time.perf_counter() - began:.3f}", flush=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
