"""Worker entry point for tests under a real launcher (``mpiexec``, ``horovodrun``).

``python -m tests.support.launched_runner ENGINE SCENARIOS OUT_DIR`` runs, on every
worker that the launcher starts, each scenario in the pickled list
``SCENARIOS`` (a list of ``(name, "module:function", args)``), in order, on
the engine called ``ENGINE``, and writes this worker's results to
``OUT_DIR/rank<N>.pkl`` after each one, so that whatever finished survives a
later crash. A scenario's result is ``("ok", value)`` or ``("error",
traceback)``.

Set by :func:`tests.support.harness.run_under_launcher` in the environment:
``TEST_ENGINE_TIMEOUT`` (seconds) and ``TEST_CRASH_ON_ERROR``: when set, a
worker whose scenario raised leaves at once, without a goodbye, as a crashing
script would, so that its peers show how they notice a lost worker.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import traceback
from pathlib import Path
from typing import Any


def main(engine: str, scenarios_path: str, out_dir: str) -> None:
    import pyro
    import torch

    import pyro_distributed

    torch.set_num_threads(1)
    with open(scenarios_path, "rb") as file:
        scenarios = pickle.load(file)
    crash_on_error = bool(os.environ.get("TEST_CRASH_ON_ERROR"))
    pyro_distributed.init(engine, timeout=float(os.environ.get("TEST_ENGINE_TIMEOUT", "30")))
    out = Path(out_dir) / f"rank{pyro_distributed.rank()}.pkl"
    results: dict[str, tuple[str, Any]] = {}
    for name, target, args in scenarios:
        module_name, function_name = target.split(":")
        pyro.clear_param_store()
        try:
            function = getattr(importlib.import_module(module_name), function_name)
            results[name] = ("ok", function(*args))
        except BaseException:  # report everything, including KeyboardInterrupt
            results[name] = ("error", traceback.format_exc())
        out.write_bytes(pickle.dumps(results))
        if crash_on_error and results[name][0] == "error":
            sys.stdout.flush()
            os._exit(1)
    pyro_distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
