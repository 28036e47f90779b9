"""The API reference is generated from ``__all__``, so that a new public name flows in.

``.. public-api:: pyro_distributed`` expands, at build time, into one autodoc
entry per name in the module's ``__all__``, in that order: a class gets
``autoclass`` (with its public members), a function ``autofunction``, a
submodule (a namespace such as ``pyro_distributed.scaling``) a section of its
own ``__all__``, recursively. Nothing is written into the source tree, and
nothing is listed by hand: ``tests/test_docs.py`` checks that every name in
``__all__`` has an entry in the built site's inventory.
"""

from __future__ import annotations

import builtins
import importlib
import inspect
import sys
from types import ModuleType
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.addnodes import pending_xref
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.util.docutils import SphinxDirective

PUBLIC_MODULES = (
    "pyro_distributed",
    "pyro_distributed.integrations.lightning",
    "pyro_distributed.integrations.scvi",
)
MISSING = object()


def entries(module: ModuleType, qualname: str, depth: int = 0) -> list[str]:
    """The reST lines documenting ``module.__all__``."""
    names = getattr(module, "__all__", None)
    if names is None:
        raise ValueError(f"{qualname} has no __all__ to document")
    lines: list[str] = []
    for name in names:
        obj = getattr(module, name)
        target = f"{qualname}.{name}"
        if inspect.ismodule(obj):
            title = f"``{target}``"
            lines += ["", title, "-~^"[min(depth, 2)] * len(title), ""]
            if target != obj.__name__:  # pd.scaling: an entry under the name users type
                lines += [f".. py:module:: {target}", ""]
            lines += [f".. automodule:: {obj.__name__}", "   :no-members:", ""]
            lines += entries(obj, obj.__name__, depth + 1)
        elif inspect.isclass(obj):
            lines += ["", f".. autoclass:: {target}", "   :members:", ""]
        elif callable(obj):
            lines += ["", f".. autofunction:: {target}", ""]
        else:
            lines += ["", f".. autodata:: {target}", ""]
    return lines


class PublicApi(SphinxDirective):
    """``.. public-api:: MODULE``: every name of ``MODULE.__all__``."""

    required_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        qualname = self.arguments[0]
        module = importlib.import_module(qualname)
        self.env.note_dependency(module.__file__ or "")
        content = StringList(entries(module, qualname), source=f"<public-api {qualname}>")
        node = nodes.section()
        node.document = self.state.document
        self.state.nested_parse(content, self.content_offset, node, match_titles=True)
        return node.children


class InternalApi(SphinxDirective):
    """``.. internal-api::`` with one dotted path a line: objects users meet but do not import.

    A class is documented with its members, a module by its docstring alone.
    A path whose object has become public is skipped (``public-api`` has
    documented it under its public name), so that exporting a name later
    never documents it twice.
    """

    has_content = True

    def run(self) -> list[nodes.Node]:
        lines: list[str] = []
        for path in (line.strip() for line in self.content):
            if not path:
                continue
            obj = lookup(path)
            if obj is MISSING:
                raise self.error(f"internal-api: {path} does not exist")
            if public_name(obj) is not None:
                continue
            if inspect.ismodule(obj):
                lines += ["", f".. automodule:: {path}", "   :no-members:", ""]
            else:
                lines += ["", f".. autoclass:: {path}", "   :members:", ""]
        content = StringList(lines, source="<internal-api>")
        node = nodes.section()
        node.document = self.state.document
        self.state.nested_parse(content, self.content_offset, node, match_titles=True)
        return node.children


def lookup(path: str, base: object = None) -> object:
    """The object a dotted ``path`` names (inside ``base``, or imported), or MISSING."""
    parts = path.split(".")
    if base is None:
        for cut in range(len(parts), 0, -1):
            try:
                base = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            parts = parts[cut:]
            break
        else:
            return MISSING
    obj = base
    for part in parts:
        obj = getattr(obj, part, MISSING)
        if obj is MISSING:
            return MISSING
    return obj


def public_name(obj: object) -> str | None:
    """``MODULE.NAME``, the name users import ``obj`` by, if it is public; else None."""
    for qualname in PUBLIC_MODULES:
        module = sys.modules.get(qualname)
        for name in getattr(module, "__all__", ()):
            if getattr(module, name) is obj:
                return f"{qualname}.{name}"
    return None


def resolve(target: str) -> object:
    """What a reference's target names: absolute, in a module of the package, or a builtin."""
    found = lookup(target)
    if found is MISSING:
        found = getattr(builtins, target, MISSING)
    if found is MISSING:
        # A short name in a docstring or a type hint (``Engine``, ``sparse.LocalUpdates``):
        # relative to a module of the package.
        for name, module in list(sys.modules.items()):
            if name.startswith("pyro_distributed") and module is not None:
                found = lookup(target, module)
                if found is not MISSING:
                    break
    return found


def missing_reference(
    app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: nodes.Element
) -> nodes.Element | None:
    """Resolve what the Python domain could not, or leave it broken.

    A public object named by its defining module's path (``pyro_distributed.optim.
    distributed.DistributedOptimizer``, as type hints name it) links to its entry
    under the public name. A target that exists but has no entry here (an internal
    class, a module, torch's or Pyro's names: their sites' inventories are not
    reachable offline) is shown as code, without a link. A target that exists
    nowhere (a module that was removed, a misspelt name) stays a broken reference,
    which ``-W`` turns into a failed build.
    """
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"]
    obj = resolve(target)
    if obj is MISSING:
        return None
    public = public_name(obj)
    if public is not None and public != target:
        domain: Any = env.get_domain("py")
        return domain.resolve_xref(
            env, node["refdoc"], app.builder, node["reftype"], public, node, contnode
        )
    return contnode


def setup(app: Sphinx) -> dict[str, object]:
    app.add_directive("public-api", PublicApi)
    app.add_directive("internal-api", InternalApi)
    app.connect("missing-reference", missing_reference)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
