"""Run a training script, but SIGKILL worker 1 at step $CRASH_AT_STEP on the first attempt.

Usage: torchrun ... tests/scripts/crash_once.py SCRIPT [ARGS...]

torchrun counts restarts in TORCHELASTIC_RESTART_COUNT; after a restart the
script runs normally, so a restartable script must resume and finish.
"""

import os
import runpy
import signal
import sys

import pyro_distributed as pd

crash_at = int(os.environ["CRASH_AT_STEP"])
if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and os.environ.get("RANK") == "1":
    original_call = pd.DistributedOptimizer.__call__

    def crash_at_step(self, *args, **kwargs):
        if self.num_steps + 1 == crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return original_call(self, *args, **kwargs)

    pd.DistributedOptimizer.__call__ = crash_at_step

script, *arguments = sys.argv[1:]
sys.argv = [script, *arguments]
runpy.run_path(script, run_name="__main__")
