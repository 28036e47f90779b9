"""scripts/gpu_check.sh's dry run: the GPU check's plumbing, proven on a machine without one.

The dry run checks the wheels the check installs (or, where ``.whl/`` is
absent, as on CI, says how to download them), collects the tests marked
``cuda``, sees the check refuse to run without a CUDA device, and prints the
plan and the table. The check itself runs only on a GPU machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_dry_run_proves_the_plumbing_without_a_gpu(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "GPU_CHECK_OUT": str(tmp_path),
        "PYTHONPATH": str(ROOT),
        # The refusal is checked with the GPUs hidden, so this runs on a GPU machine too.
    }
    env.pop("OUT", None)
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    wheels = ROOT / ".whl"
    if wheels.is_dir():
        assert "ok wheels: Would install" in output and "pyro-ppl-1.9.2" in output, output
    else:
        assert "skipped wheels" in output and "--download" in output, output
    collected = re.search(r"ok tests marked cuda: (\d+) collected", output)
    assert collected and int(collected.group(1)) > 0, output
    assert "tests/test_cuda.py::test_two_workers_on_one_gpu_match_one_process[mpi]" in output
    assert "the check stops with: gpu_check: no CUDA device" in output, output
    assert "plan: quickstart W=2, mpiexec (mpi engine)" in output, output
    assert "plan: Horovod: build with NCCL GPU operations" in output, output
    assert "install_horovod.sh --gpu" in output, output
    summary = (tmp_path / "summary.md").read_text()
    assert summary.count("| planned |") == 21, summary
    assert "dry run passed" in output


def test_an_unknown_option_is_refused_by_name() -> None:
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--fast"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "unknown option --fast" in result.stderr
