"""A launching script for tests/spawn/test_worker_signals.py: it launches two
workers that sleep, sends SIGINT to one of them once both have started, and
prints what the launch raised.

    python tests/spawn/scripts/interrupts_a_worker.py WHERE START_METHOD
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pyro_distributed as pd
from tests.spawn.scripts.accidents import sleeps


def _interrupt_one_worker(where: Path) -> None:
    while len(list(where.iterdir())) < 2:
        time.sleep(0.05)
    time.sleep(0.3)
    os.kill(max(int(path.name) for path in where.iterdir()), signal.SIGINT)


if __name__ == "__main__":
    where, method = Path(sys.argv[1]), sys.argv[2]
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    print("SIGINT here:", "ignored" if ignored else "handled")
    threading.Thread(target=_interrupt_one_worker, args=(where,), daemon=True).start()
    try:
        # The time limit ends a launch whose workers slept through the signal.
        pd.launch(sleeps, str(where), 600, workers=2, start_method=method, time_limit=90)
    except pd.PyroDistributedError as exc:
        print("launch raised:", exc)
    else:
        print("launch returned")
