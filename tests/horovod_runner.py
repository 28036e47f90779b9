"""Worker entry point for tests under the real ``horovodrun``.

``python -m tests.horovod_runner SCENARIOS OUT_DIR`` runs, on every worker
that horovodrun starts, each scenario in the pickled list ``SCENARIOS`` (a
list of ``(name, "module:function", args)``), in order, and writes this
worker's results to ``OUT_DIR/rank<N>.pkl`` after each one, so that whatever
finished survives a later crash. A scenario's result is ``("ok", value)`` or
``("error", traceback)``.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import traceback
from pathlib import Path
from typing import Any


def main(scenarios_path: str, out_dir: str) -> None:
    import pyro
    import torch

    import pyro_distributed

    torch.set_num_threads(1)
    with open(scenarios_path, "rb") as file:
        scenarios = pickle.load(file)
    pyro_distributed.init("horovod", timeout=float(os.environ.get("TEST_ENGINE_TIMEOUT", "30")))
    out = Path(out_dir) / f"rank{pyro_distributed.rank()}.pkl"
    results: dict[str, tuple[str, Any]] = {}
    for name, target, args in scenarios:
        module_name, function_name = target.split(":")
        pyro.clear_param_store()
        try:
            function = getattr(importlib.import_module(module_name), function_name)
            results[name] = ("ok", function(*args))
        except Exception:
            results[name] = ("error", traceback.format_exc())
        out.write_bytes(pickle.dumps(results))
    pyro_distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
