"""The ``lightning_llm._compat`` layer: every upstream private API the project uses is there, registered in the
ledger, resolvable on the installed versions, and documented in docs/internals.md."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

from lightning_llm._compat import LEDGER
from lightning_llm._compat.ledger import BEGIN, END, markdown

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_llm"
UPSTREAM = ("torch", "lightning", "deepspeed", "transformers", "pytorch_lightning")
# Names an upstream module is commonly bound to in this code base.
UPSTREAM_ALIASES = {*UPSTREAM, "L", "pl", "nn", "F", "dist", "dcp", "funcol"}
# Private attributes of upstream objects (strategies, modules, meshes, DTensors, trainers, ...) that code reaches
# on an object whose type the AST cannot see.
KNOWN_PRIVATE_ATTRIBUTES = {
    "_aligned_size",
    "_apply",
    "_buffers",
    "_c10d_functional",
    "_config_initialized",
    "_convert_to_deepspeed_param",
    "_data_parallel_size",
    "_data_source",
    "_device_mesh",
    "_flatten",
    "_foreach_copy_",
    "_foreach_norm",
    "_init_config_if_needed",
    "_init_deepspeed_distributed",
    "_initialize_deepspeed_inference",
    "_is_hf_initialized",
    "_local_tensor",
    "_modules",
    "_optimizer",
    "_parameters",
    "_partition_world_size",
    "_precision_plugin",
    "_save_distributed_checkpoint",
    "_setup_distributed",
    "_setup_model_and_optimizer",
    "_tensor_parallel_size",
    "_tp_plan",
}
# Still direct, and why: lightning_llm/callbacks/ belongs to another change in flight (only its imports may move).
ALLOWED_OUTSIDE: set[tuple[str, str]] = set()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_accesses(source: str) -> list[tuple[int, str]]:
    """(line, private name) of every upstream private access in ``source``, by a heuristic over its AST."""
    found = []
    tree = ast.parse(source)
    # ``self._x`` inside a class with no base class is the project's own attribute, not an upstream one.
    own = {
        id(attr)
        for cls in ast.walk(tree)
        if isinstance(cls, ast.ClassDef) and not cls.bases
        for attr in ast.walk(cls)
        if isinstance(attr, ast.Attribute) and isinstance(attr.value, ast.Name) and attr.value.id == "self"
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in UPSTREAM:
            parts = node.module.split(".")
            found += [(node.lineno, p) for p in parts if _private(p)]
            found += [(node.lineno, a.name) for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in UPSTREAM:
                    found += [(node.lineno, p) for p in parts if _private(p)]
        elif isinstance(node, ast.Attribute) and _private(node.attr) and id(node) not in own:
            if node.attr in KNOWN_PRIVATE_ATTRIBUTES or _root_name(node) in UPSTREAM_ALIASES:
                found.append((node.lineno, node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in KNOWN_PRIVATE_ATTRIBUTES
        ):
            found.append((node.lineno, node.args[1].value))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            parts = node.value.split(".")
            if len(parts) > 1 and parts[0] in UPSTREAM and all(p.isidentifier() for p in parts):
                found += [(node.lineno, p) for p in parts if _private(p)]
    return found


def test_no_upstream_private_access_outside_compat():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("_compat/"):
            continue
        for line, name in private_accesses(path.read_text()):
            if (rel, name) not in ALLOWED_OUTSIDE:
                offenders.append(f"lightning_llm/{rel}:{line}: {name}")
    assert not offenders, "upstream private APIs used outside lightning_llm/_compat:\n" + "\n".join(offenders)


def test_finder_catches_planted_private_accesses():
    planted = textwrap.dedent(
        """
        import torch._dynamo
        from torch.distributed._composable import checkpoint
        from lightning.fabric.utilities.load import _METADATA_FILENAME
        import torch
        torch._foreach_add_(a, b)
        mesh._flatten("dp")
        strategy._tensor_parallel_size
        getattr(module, "_tp_plan", None)
        class Blocks(nn.ModuleList):
            def f(self):
                return self._modules
        logging.getLogger("torch._subclasses.fake_tensor")
        """
    )
    names = {name for _, name in private_accesses(planted)}
    assert names == {
        "_dynamo",
        "_composable",
        "_METADATA_FILENAME",
        "_foreach_add_",
        "_flatten",
        "_tensor_parallel_size",
        "_tp_plan",
        "_subclasses",
        "_modules",
    }
    # The project's own private names and public upstream names are not flagged.
    clean = (
        "from lightning_llm.parallel.tp.fused import _exchange\nself._lent = {}\ntorch.nn.utils.get_total_norm(x)\n"
        "class Saver:\n    def __init__(self):\n        self._buffers = []\n"
    )
    assert private_accesses(clean) == []


def test_every_ledger_entry_resolves_on_installed_versions():
    """One test for every entry: an upstream upgrade that renames or removes one fails here, naming it."""
    broken = []
    for entry in LEDGER:
        try:
            entry.check()
        except Exception as err:
            broken.append(f"{entry.upstream}: {entry.name} (lightning_llm._compat.{entry.accessor}): {err!r}")
    assert not broken, "private upstream APIs no longer resolve:\n" + "\n".join(broken)


def test_ledger_entries_are_complete():
    assert len({e.name for e in LEDGER}) == len(LEDGER)
    for entry in LEDGER:
        assert entry.upstream in UPSTREAM, entry
        assert entry.why and entry.caught_by and entry.checked and entry.check is not None, entry
        for used in entry.used_by:
            assert (PACKAGE / used.split(" ")[0]).is_file(), f"{entry.name}: {used} does not exist"


def test_internals_doc_holds_the_generated_ledger():
    doc = (ROOT / "docs" / "internals.md").read_text()
    assert BEGIN in doc and END in doc, "docs/internals.md lacks the ledger markers"
    table = doc.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"
    assert table == markdown(), (
        "docs/internals.md's private-API table differs from the ledger; regenerate it with "
        "`python -m lightning_llm._compat.ledger`"
    )


def test_ledger_script_prints_the_table():
    out = subprocess.run(
        [sys.executable, "-m", "lightning_llm._compat.ledger"], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert out == markdown()
