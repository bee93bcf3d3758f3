"""The package's shape, read from its source (AST, no import): only ``comm/`` imports
torch.distributed's collectives, and every file and function of the package stays small
enough to read. (That no module imports one that imports it back, at module level or
in a function, is ``test_package_structure.py``'s.)"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "globaltensor"

# Where torch.distributed may be imported, and which of it. comm/ owns the collectives;
# the launcher runs on torch.distributed.elastic (and its TCPStore rendezvous); interop
# speaks DCP and DTensor.
DISTRIBUTED_ALLOWED = {
    "comm": ("torch.distributed",),
    "launch": ("torch.distributed.elastic", "torch.distributed.launcher",
               "torch.distributed.run", "torch.distributed.TCPStore"),
    "interop": ("torch.distributed.checkpoint", "torch.distributed.tensor",
                "torch.distributed.device_mesh"),
}
# Known exceptions, each with its reason: (file, imported name).
# gt.checkpoint (Autosave) saves through DCP and its state_dict helpers, as interop/ does.
DISTRIBUTED_EXCEPTIONS: set = {("checkpoint.py", "torch.distributed.checkpoint"),
                               ("checkpoint.py", "torch.distributed.checkpoint.state_dict"),
                               # torch's memory tracker, nothing of its collectives
                               ("step_simulation.py", "torch.distributed._tools.mem_tracker")}
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 60


def _distributed_imports(tree) -> list:
    """Every torch.distributed name a file imports, at any level (in functions too)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.startswith("torch.distributed")]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module and (
                node.module == "torch.distributed" or node.module.startswith("torch.distributed.")):
            names += [node.module] if node.module != "torch.distributed" else \
                [f"torch.distributed.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and not node.level \
                and any(a.name == "distributed" for a in node.names):
            names.append("torch.distributed")
    return names


def test_torch_distributed_is_imported_only_where_allowed():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        allowed = DISTRIBUTED_ALLOWED.get(rel.split("/")[0], ()) if "/" in rel else ()
        for imported in _distributed_imports(ast.parse(path.read_text(), rel)):
            if (rel, imported) in DISTRIBUTED_EXCEPTIONS:
                continue
            if not any(imported == a or imported.startswith(a + ".") for a in allowed):
                wrong.append(f"{rel}: {imported}")
    assert not wrong, "torch.distributed imported outside comm/ (or beyond what launch/ " \
                      f"and interop/ may use): {wrong}"


def test_distributed_import_finder_sees_every_spelling():
    tree = ast.parse("import torch.distributed as dist\n"
                     "from torch import distributed\n"
                     "def f():\n    from torch.distributed import all_reduce\n"
                     "from torch.distributed.checkpoint import save\n")
    assert sorted(_distributed_imports(tree)) == [
        "torch.distributed", "torch.distributed", "torch.distributed.all_reduce",
        "torch.distributed.checkpoint"]


def test_files_and_functions_are_small():
    # a file a reader takes in at once, a function that fits on a screen: anywhere in
    # the package
    too_long = []
    paths = sorted(ROOT.rglob("*.py"))
    assert len(paths) >= 100, paths
    for path in paths:
        text = path.read_text()
        rel = path.relative_to(ROOT).as_posix()
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            too_long.append(f"{rel}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{rel}: {node.name} has {n} lines")
    assert not too_long, too_long
