"""Start an engine as a launched script would and print what it joined, or the error.

python tests/scripts/join_and_report.py ENGINE

Prints ``joined ENGINE RANK WORLD_SIZE``, or ``refused MESSAGE`` and exits 3.
"""

import sys

import pyro_distributed as pd

try:
    engine = pd.init(sys.argv[1], timeout=30)
except pd.PyroDistributedError as error:
    print(f"refused {error}", flush=True)
    sys.exit(3)
total = pd.all_mean(1.0) * engine.world_size
print(f"joined {engine.name} {engine.rank} {engine.world_size} {total:g}", flush=True)
