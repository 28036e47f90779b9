"""How long one all-reduce of the VAE's gradient takes on this machine, by wire type.

    python benchmarks/collective_latency.py [--rounds 8] [--calls 300] [--pin] [--awake]
                                            [--output-dir benchmarks/collective_latency]

Two processes on loopback, plain ``torch.distributed`` with gloo (no
pyro_distributed in the loop): each round all-reduces one buffer of the VAE
gradient's size (``examples/vae_digits.py``: 72,992 bytes in float32) ``--calls``
times, back to back, in float32, float16 or bfloat16 (the same number of
elements, refilled before each call), timing every call. Rounds visit the
types in a shuffled order.

``--pin`` puts each worker on a CPU of its own; ``--awake`` runs one spinner
per CPU at the idle scheduling class (``SCHED_IDLE``: it runs only when
nothing else would), so that a waiting worker's CPU never goes idle. On a
virtual machine whose idle CPUs halt, a worker woken from a halted CPU can
wait up to a timer tick; ``--awake`` takes that wait away and leaves the
collective's own cost.

Writes ``collective_latency.json`` (a summary per setting and type) and
``COLLECTIVE_LATENCY.md``, adding this setting's to those already there.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: Elements of the VAE's gradient (72,992 bytes in float32).
ELEMENTS = 72_992 // 4
TYPES = ("float32", "float16", "bfloat16")
#: A call slower than this waited for a wake-up (a timer tick is 4 ms here).
SLOW_S = 2e-3
TITLE = "# One all-reduce of the VAE's gradient (72,992 bytes in float32), two workers on loopback"


def worker(rank: int, port: int, rounds: int, calls: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    generator = torch.Generator().manual_seed(rank)
    source = 1e-2 * torch.randn(ELEMENTS, generator=generator)
    buffers = {name: source.to(getattr(torch, name)) for name in TYPES}
    wire = {name: buffer.clone() for name, buffer in buffers.items()}
    order = random.Random(0)  # the same shuffles on both workers
    calls_s: dict[str, list[float]] = {name: [] for name in TYPES}
    for _ in range(rounds):
        names = list(TYPES)
        order.shuffle(names)
        for name in names:
            dist.barrier()
            for _ in range(calls):
                wire[name].copy_(buffers[name])
                start = time.perf_counter()
                dist.all_reduce(wire[name])
                calls_s[name].append(time.perf_counter() - start)
    if rank == 0:
        print(json.dumps(calls_s), flush=True)
    dist.destroy_process_group()


def spinners() -> list[subprocess.Popen[bytes]]:
    """One idle-class busy loop per CPU."""
    loop = [sys.executable, "-c", "while True: pass"]
    return [
        subprocess.Popen(["taskset", "-c", str(cpu), "chrt", "-i", "0", *loop])
        for cpu in sorted(os.sched_getaffinity(0))
    ]


def run(rounds: int, calls: int, pin: bool, awake: bool) -> dict[str, list[float]]:
    from bench_svi import free_port

    port = free_port()
    busy = spinners() if awake else []
    try:
        workers = []
        for rank in range(2):
            command = [sys.executable, __file__, "--worker", str(rank), str(port)]
            command += ["--rounds", str(rounds), "--calls", str(calls)]
            if pin:
                command = ["taskset", "-c", str(rank), *command]
            workers.append(
                subprocess.Popen(
                    command,
                    stdout=subprocess.PIPE,
                    text=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                )
            )
        outputs = [process.communicate(timeout=600)[0] for process in workers]
    finally:
        for process in busy:
            process.kill()
            process.wait()
    if any(process.returncode for process in workers):
        raise SystemExit(f"a worker failed: {[p.returncode for p in workers]}")
    line = [text for text in outputs[0].splitlines() if text.startswith("{")][-1]
    calls_s: dict[str, list[float]] = json.loads(line)
    return calls_s


def summary(calls_s: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per wire type: the median, 90th percentile and mean call (seconds), and
    the share of calls slower than :data:`SLOW_S`."""
    stats = {}
    for name, values in calls_s.items():
        ordered = sorted(values)
        stats[name] = {
            "calls": len(ordered),
            "median_s": statistics.median(ordered),
            "p90_s": ordered[int(0.9 * len(ordered))],
            "mean_s": statistics.fmean(ordered),
            "slow_share": sum(value > SLOW_S for value in ordered) / len(ordered),
        }
    return stats


def report(settings: dict[str, object], stats: dict[str, dict[str, float]]) -> str:
    """One setting's section: the command that ran and its table."""
    rows = [
        f"`python benchmarks/collective_latency.py {settings['arguments']}`: "
        f"{settings['rounds']} rounds of {settings['calls']} back-to-back calls per type, "
        "types in a shuffled order each round. Written by `benchmarks/collective_latency.py`.",
        "",
        "| wire type | bytes | median call (us) | 90th percentile (us) | mean (us) "
        f"| calls over {SLOW_S * 1e3:g} ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in TYPES:
        row = stats[name]
        width = 4 if name == "float32" else 2
        rows.append(
            f"| {name} | {ELEMENTS * width:,} | {row['median_s'] * 1e6:.0f} "
            f"| {row['p90_s'] * 1e6:.0f} | {row['mean_s'] * 1e6:.0f} "
            f"| {100 * row['slow_share']:.1f} % |"
        )
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--pin", action="store_true", help="each worker on a CPU of its own")
    parser.add_argument("--awake", action="store_true", help="keep every CPU busy at idle class")
    parser.add_argument("--output-dir", type=Path, default=HERE / "collective_latency")
    parser.add_argument("--worker", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.rounds, args.calls)
        return
    stats = summary(run(args.rounds, args.calls, args.pin, args.awake))
    arguments = " ".join(sys.argv[1:])
    settings = {"rounds": args.rounds, "calls": args.calls, "pin": args.pin,
                "awake": args.awake, "arguments": arguments}  # fmt: skip
    tag = ("pinned" if args.pin else "unpinned") + ("-awake" if args.awake else "")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    results = args.output_dir / "collective_latency.json"
    previous = json.loads(results.read_text()) if results.exists() else {}
    previous[tag] = {"settings": settings, "summary": stats}
    results.write_text(json.dumps(previous, indent=1) + "\n")
    sections = [
        f"## {name}\n\n" + report(entry["settings"], entry["summary"])
        for name, entry in sorted(previous.items())
    ]
    (args.output_dir / "COLLECTIVE_LATENCY.md").write_text("\n".join([TITLE, "", *sections]))
    print(f"{TITLE}\n\n{report(settings, stats)}")


if __name__ == "__main__":
    main()
