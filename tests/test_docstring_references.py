"""Every Sphinx cross-reference in the package's docstrings names something that exists.

The docs site renders the public modules (and builds with ``sphinx-build -n -W``, tests/docs); this covers the
docstrings of every other module, where a ``:mod:`` or ``:func:`` to a module renamed or a function moved away would
otherwise go unnoticed. A reference resolves as Sphinx would find it: absolute (``lightning_llm.x.y``), relative to the
module and its packages (``.x``, ``~.x.y``), or a name of the module, its class, or the builtins. References to other
libraries (``torch.nn.Module``) are not checked here.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import re
from pathlib import Path

import lightning_llm

PACKAGE = Path(lightning_llm.__file__).parent
ROLE = re.compile(r":(mod|func|class|meth|attr|data|exc|obj):`([^`]+)`")


def _docstrings(path: Path):
    """(module name, enclosing class name or None, docstring) of a module and every class and function in it."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    tree = ast.parse(path.read_text())
    yield module, None, ast.get_docstring(tree) or ""

    def walk(node, cls):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = child.name if isinstance(child, ast.ClassDef) else cls
                yield module, inner, ast.get_docstring(child) or ""
                yield from walk(child, inner)

    yield from walk(tree, None)


def _resolve(dotted: str) -> bool:
    """Whether ``a.b.c`` is a module, or an attribute chain of one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def _exists(target: str, role: str, module: str, cls: str | None) -> bool:
    target = target.split("<")[-1].rstrip(">").strip().lstrip("~!").removesuffix("()")
    relative = target.startswith(".")
    name = target.lstrip(".")
    if name.startswith("lightning_llm.") or name == "lightning_llm":
        return _resolve(name)
    packages = module.split(".")
    scopes = [".".join(packages[:cut]) for cut in range(len(packages), 0, -1)]
    candidates = [f"{scope}.{name}" for scope in scopes]
    if cls is not None:
        candidates.insert(0, f"{module}.{cls}.{name}")
    if any(_resolve(c) for c in candidates):
        return True
    if role == "attr" and "." in name:  # an instance attribute (set in __init__, a dataclass field): its owner exists
        return _exists(target.rsplit(".", 1)[0], "class", module, cls)
    if role == "attr" and cls is not None:  # an instance attribute of the enclosing class
        source = (PACKAGE.parent / module.replace(".", "/")).with_suffix(".py")
        return source.is_file() and f"self.{name}" in source.read_text()
    if relative:
        return False
    head = name.split(".")[0]
    return hasattr(builtins, head) or (not _resolve(f"{module}.{head}") and "." in name)  # another library's name


def _missing() -> list[str]:
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for module, cls, doc in _docstrings(path):
            for role, target in ROLE.findall(doc):
                if not _exists(target, role, module, cls):
                    missing.append(f"{module}{'.' + cls if cls else ''}: :{role}:`{target}`")
    return missing


def test_every_cross_reference_in_a_docstring_exists():
    missing = _missing()
    assert not missing, "\n".join(missing)


def test_the_check_finds_a_missing_module_and_function():
    assert not _exists("lightning_llm.parallel.tp_plan", "mod", "lightning_llm.parallel.tp", None)  # renamed away
    assert not _exists(".tp_styles", "mod", "lightning_llm.parallel.tp.apply", None)
    assert not _exists("no_such_function", "func", "lightning_llm.parallel.tp.apply", None)
    assert _exists("~.tp.apply.apply_tensor_parallel", "func", "lightning_llm.parallel.parallelize", None)
    assert _exists("ParallelizeReport", "class", "lightning_llm.parallel.parallelize", None)
    assert _exists("torch.nn.Module", "class", "lightning_llm.parallel.parallelize", None)
