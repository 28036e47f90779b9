"""Start an engine as a launched script would and print what it joined, or the error.

python tests/scripts/join_and_report.py ENGINE [TIMEOUT_SECONDS]

Prints ``joined ENGINE RANK WORLD_SIZE``, or ``refused CLASS: MESSAGE`` (for a
PyroDistributedError or a ValueError) and exits 3. TIMEOUT_SECONDS defaults to 30.
"""

import sys

import pyro_distributed as pd

try:
    engine = pd.init(sys.argv[1], timeout=float(sys.argv[2]) if len(sys.argv) > 2 else 30)
except (pd.PyroDistributedError, ValueError) as error:
    print(f"refused {type(error).__name__}: {error}", flush=True)
    sys.exit(3)
total = pd.all_mean(1.0) * engine.world_size
print(f"joined {engine.name} {engine.rank} {engine.world_size} {total:g}", flush=True)
