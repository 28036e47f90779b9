"""A launching process for tests/spawn/test_orphans.py: it launches workers that
record their pids and sleep, so that the test can end this process by a signal.

    python tests/spawn/scripts/parent.py WHERE START_METHOD [dist | gil]

With ``dist``, this process first joins a torch.distributed group of its own
(as after a Lightning fit in a kernel), and the launch's answer is printed.
With ``gil``, the workers sit in a C call that holds the interpreter, where
no thread of theirs can run.
"""

from __future__ import annotations

import signal
import sys
import time

import torch

import pyro_distributed as pd
from tests.spawn.scripts.accidents import holds_the_gil, record, returns_rank_and_threads


def sleep_forever(where: str) -> None:
    record(where)
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    where, method = sys.argv[1], sys.argv[2]
    # A hang-up ends this process, as it ends one started from a terminal; a
    # test run started under nohup would otherwise hand it SIGHUP ignored.
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    torch.ones(2**22).mul_(2)  # a parallel op, as a kernel has run
    if sys.argv[3:] == ["dist"]:
        import torch.distributed as dist

        # A file store: no port that another test's process could take first.
        store = f"file://{where}/process-group-store"
        dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
        dist.barrier()
        try:
            launched = pd.launch(returns_rank_and_threads, where, workers=2, start_method=method)
            print("launched", launched.value, flush=True)
        except pd.PyroDistributedError as error:
            print("refused", error, flush=True)
        dist.destroy_process_group()
    elif sys.argv[3:] == ["gil"]:
        pd.launch(holds_the_gil, where, workers=2, start_method=method)
    else:
        pd.launch(sleep_forever, where, workers=2, start_method=method)
