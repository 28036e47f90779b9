"""Notebooks run as a user runs them: cells made from source, executed in a
fresh Jupyter kernel started in the repository, and what each cell printed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook

ROOT = Path(__file__).resolve().parents[2]


def execute(notebook: Any, timeout: int = 300) -> Any:
    """Run every cell in a fresh kernel started in the repository, as a user would."""
    client = NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name="python3",
        allow_errors=True,
        interrupt_on_timeout=True,
        resources={"metadata": {"path": str(ROOT)}},
    )
    client.execute()
    return notebook


def output_of(cell: Any, streams: tuple[str, ...] = ("stdout", "stderr")) -> str:
    """What a cell printed on ``streams`` and, if it failed, its error."""
    parts = []
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream" and output["name"] in streams:
            parts.append(output["text"])
        elif output.get("output_type") == "error":
            error = f"{output['ename']}: {output['evalue']}\n"
            parts.append(error + "\n".join(output["traceback"]))
    return "".join(parts)


def notebook_of(*sources: str) -> Any:
    return new_notebook(
        cells=[new_code_cell(source) for source in sources],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}},
    )
