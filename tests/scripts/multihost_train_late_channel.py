"""``multihost_train.py`` with the last worker late to open the overlap's channel.

python tests/scripts/multihost_train_late_channel.py OUT_DIR STEPS TIMEOUT_S

The exchange opens a process group of its own for overlapped buckets (its
channel) once, early in training, a collective that every worker makes. Here
each worker touches ``OUT_DIR/channel{R}`` as it starts to open it, and the
last worker then waits 15 s first, so that a test can cut that worker's link
while the others are inside the group's set-up.
"""

import sys
import time
from pathlib import Path

import multihost_train  # the script beside this one

from pyro_distributed.engines.torch_distributed import TorchEngine

LATE_S = 15.0

_open_channel = TorchEngine.open_channel


def _late_open_channel(engine: TorchEngine) -> TorchEngine:
    (Path(sys.argv[1]) / f"channel{engine.rank}").write_text("")
    if engine.rank == engine.world_size - 1:
        time.sleep(LATE_S)
    return _open_channel(engine)


if __name__ == "__main__":
    TorchEngine.open_channel = _late_open_channel
    multihost_train.main(Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
