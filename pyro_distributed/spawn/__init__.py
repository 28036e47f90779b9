"""Workers started from a running Python: :func:`launch` and :func:`progress`.

Launchers (torchrun, horovodrun, mpiexec, srun) start a script's workers;
nothing of theirs reaches a Jupyter kernel. :func:`launch` starts the workers
from the kernel itself (:mod:`.processes`), runs a function on each
(:mod:`.worker`), and brings what they trained back (:mod:`.state`), with
worker 0's output and progress bar in the cell (:mod:`.progress`).
"""

from __future__ import annotations

from .launcher import Launched, launch
from .progress import progress

__all__ = ["Launched", "launch", "progress"]
