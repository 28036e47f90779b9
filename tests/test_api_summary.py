"""docs/api/summary.md: the signatures its table shows are the code's.

The table's first column names the public names (``pyro_distributed.__all__``,
the ``__all__`` of ``pyro_distributed.integrations.lightning`` and ``.scvi``, and the
``scaling`` namespace), most
with a signature, ``name(parameters)``. Each shown signature must have the
parameters that ``inspect.signature`` finds in the code: the same names, in
the same order, of the same kinds (``*``, ``*args``, ``**kwargs``) and with the
same defaults. A trailing ``...`` stands for the parameters after the shown
ones. A class shows its ``__init__``; a method is shown on an instance:
``optim.`` is a ``DistributedOptimizer``, ``optimizer.`` a
``DistributedTorchOptimizer``.
"""

from __future__ import annotations

import ast
import inspect
import re
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import pyro_distributed
import pyro_distributed.integrations.lightning
import pyro_distributed.integrations.scvi

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = ROOT / "docs" / "api" / "summary.md"
PUBLIC = (
    pyro_distributed,
    pyro_distributed.integrations.lightning,
    pyro_distributed.integrations.scvi,
)
INSTANCES: dict[str, type] = {
    "optim": pyro_distributed.DistributedOptimizer,
    "optimizer": pyro_distributed.DistributedTorchOptimizer,
}
# What a shown default may name besides literals.
DEFAULT_NAMES = {"timedelta": timedelta}
EMPTY = inspect.Parameter.empty

Parameter = tuple[str, inspect._ParameterKind, Any]


def first_column() -> list[str]:
    """The first cell of every row of the page's table, header left out."""
    rows = [line for line in SUMMARY.read_text().splitlines() if line.startswith("| ")]
    return [row[2:].split(" | ")[0] for row in rows[1:]]


def shown() -> list[str]:
    """Every code span of the first column: a name or a signature."""
    return [span for cell in first_column() for span in re.findall(r"`([^`]+)`", cell)]


def shown_signatures() -> list[tuple[str, str]]:
    """``(name, parameters)`` of every signature the table shows."""
    found = []
    for span in shown():
        call = re.fullmatch(r"([\w.]+)\((.*)\)", span)
        if call:
            found.append((call.group(1), call.group(2)))
    return found


def resolve(dotted: str) -> tuple[Any, bool]:
    """The object a shown name stands for, and whether it is a method."""
    head, *rest = dotted.split(".")
    if head in INSTANCES:
        assert len(rest) == 1, f"{dotted}: one method of {INSTANCES[head].__name__}"
        return getattr(INSTANCES[head], rest[0]), True
    obj: Any = pyro_distributed
    if head in ("lightning", "scvi"):
        obj, (head, *rest) = getattr(pyro_distributed.integrations, head), rest
    for part in (head, *rest):
        if isinstance(obj, ModuleType):
            assert part in obj.__all__, f"{dotted}: {part} is not in {obj.__name__}.__all__"
        obj = getattr(obj, part)
    return obj, False


def code_parameters(dotted: str) -> list[Parameter]:
    obj, method = resolve(dotted)
    if inspect.isclass(obj):
        # __init__, not the class: DistributedOptimizer's __new__ takes *args and
        # **kwargs only to return a DistributedTorchOptimizer for the old spelling.
        obj, method = obj.__init__, True
    parameters = list(inspect.signature(obj).parameters.values())
    if method:
        parameters = parameters[1:]  # self
    return [(p.name, p.kind, p.default) for p in parameters]


def default(node: ast.expr | None) -> Any:
    if node is None:
        return EMPTY
    expression = ast.Expression(node)
    return eval(compile(expression, "summary.md", "eval"), {"__builtins__": {}, **DEFAULT_NAMES})


def shown_parameters(text: str) -> tuple[list[Parameter], bool]:
    """The parameters a shown signature lists, and whether it ends in ``...``."""
    more = text.rstrip().endswith("...")
    text = re.sub(r",?\s*\.\.\.\s*$", "", text)
    arguments = ast.parse(f"def f({text}): pass").body[0].args  # type: ignore[attr-defined]
    kind = inspect.Parameter
    positional = kind.POSITIONAL_OR_KEYWORD
    listed = [*arguments.posonlyargs, *arguments.args]
    defaults: list[ast.expr | None] = [None] * (len(listed) - len(arguments.defaults))
    defaults += arguments.defaults
    found: list[Parameter] = [
        (arg.arg, kind.POSITIONAL_ONLY if index < len(arguments.posonlyargs) else positional, value)
        for index, (arg, value) in enumerate(zip(listed, map(default, defaults), strict=True))
    ]
    if arguments.vararg:
        found.append((arguments.vararg.arg, kind.VAR_POSITIONAL, EMPTY))
    found += [
        (arg.arg, kind.KEYWORD_ONLY, default(value))
        for arg, value in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)
    ]
    if arguments.kwarg:
        found.append((arguments.kwarg.arg, kind.VAR_KEYWORD, EMPTY))
    return found, more


def spelled(parameters: list[Parameter]) -> str:
    """A signature's parameters written as Python writes them (for the message)."""
    text = []
    for index, (name, kind, value) in enumerate(parameters):
        previous = parameters[index - 1][1] if index else None
        if kind is inspect.Parameter.KEYWORD_ONLY and previous not in (
            inspect.Parameter.KEYWORD_ONLY,
            inspect.Parameter.VAR_POSITIONAL,
        ):
            text.append("*")
        prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
        text.append(prefix.get(kind, "") + name + ("" if value is EMPTY else f"={value!r}"))
    return ", ".join(text)


def test_the_table_shows_signatures() -> None:
    assert len(shown_signatures()) > 20, f"is the table's first column read right? {shown()}"


@pytest.mark.parametrize(("name", "text"), shown_signatures(), ids=lambda value: value)
def test_a_shown_signature_is_the_codes(name: str, text: str) -> None:
    code = code_parameters(name)
    listed, more = shown_parameters(text)
    wanted = code[: len(listed)] if more else code
    assert listed == wanted, (
        f"docs/api/summary.md shows {name}({text}); the code has {name}({spelled(code)})"
    )
    assert not more or len(code) > len(listed), f"{name}({text}): nothing stands for the '...'"


def test_every_shown_name_is_public() -> None:
    for span in shown():
        resolve(re.sub(r"\(.*\)$", "", span))


def test_every_public_name_is_on_the_page() -> None:
    text = SUMMARY.read_text()
    missing = [
        name
        for module in PUBLIC
        for name in module.__all__
        if not re.search(r"`((lightning|scvi)\.)?" + re.escape(name) + r"\b", text)
    ]
    assert not missing, f"public names that docs/api/summary.md leaves out: {missing}"
