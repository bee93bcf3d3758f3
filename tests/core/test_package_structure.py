"""The package's shape: imports point one way (no module imports one that imports it
back, also from inside a function), and every change globaltensor makes to torch
happens in ``interop/torch_patches.py``, nowhere else."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "globaltensor"

# Imports allowed to point up (none: the modules above tensor.py give GlobalTensor
# their methods with tensor.install_methods).
UPWARD_CALLS: set = set()


def _module_names() -> dict:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imported(module: str, node, modules: dict) -> list:
    """The package's modules that ``node`` (an import statement in ``module``) runs."""
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".")
            if modules[module].name != "__init__.py":
                base.pop()
            base = base[:len(base) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        targets = [target] + [f"{target}.{a.name}" for a in node.names]
    out = []
    for t in targets:
        parts = t.split(".")
        # a package's __init__ runs before its modules; not the importer's own packages
        out += [q for i in range(2, len(parts) + 1) for q in [".".join(parts[:i])]
                if q in modules and not (module == q or module.startswith(q + "."))]
    return out


def _import_graph() -> dict:
    modules = _module_names()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        graph[name] = {t for node in ast.walk(tree)
                       if isinstance(node, (ast.Import, ast.ImportFrom))
                       for t in _imported(name, node, modules)
                       if (name, t) not in UPWARD_CALLS}
    return graph


def _cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_one_that_imports_it_back():
    graph = _import_graph()
    assert "globaltensor.tensor" in graph and graph["globaltensor.tensor"]
    assert _cycles(graph) == []


# The op path's rooms, lowest first: each imports only rooms before it (and the core
# modules), so per-op choice is usable without the planner, and the planner without
# the entry that hands it calls.
LAYERS = ["comm", "boxing", "rules", "propagation", "planner", "dispatch"]


def test_the_op_path_imports_downward_only():
    def room(module: str) -> str:
        return module.split(".")[1] if module.count(".") else ""
    upward = [f"{m} -> {t}" for m, targets in _import_graph().items() if room(m) in LAYERS
              for t in targets if room(t) in LAYERS and LAYERS.index(room(t)) > LAYERS.index(room(m))]
    assert not upward, f"imports up the op path ({' < '.join(LAYERS)}): {upward}"


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# In a fresh process: torch's namespaces before globaltensor is imported, with
# torch_patches.apply turned into a no-op as its module loads; nothing of torch may
# change until the real apply runs, which then makes every change listed.
SCRIPT = textwrap.dedent('''
    import importlib.abc, sys
    import torch, torch.nn.functional as F, torch.nn.utils.clip_grad, torch.serialization
    import torch.distributed as dist, torch.distributed.distributed_c10d as c10d
    import torch.distributed.tensor.parallel as tp
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    class Hold(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "globaltensor.interop.torch_patches":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module
            def exec_module(module):
                run(module)
                module.real_apply, module.apply = module.apply, lambda: None
            spec.loader.exec_module = exec_module
            return spec

    import importlib.util
    spaces = [torch, F, torch.nn.utils, torch.nn.utils.clip_grad, torch.serialization,
              torch.random, tp, dist, c10d]
    before = [dict(vars(ns)) for ns in spaces]
    lists = [optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types]
    lists_before = [list(l) for l in lists]
    finders = list(sys.meta_path)
    sys.meta_path.insert(0, Hold())
    import globaltensor
    from globaltensor.interop import torch_patches

    def changed():
        out = [f"{ns.__name__}.{k}" for ns, old in zip(spaces, before)
               for k, v in old.items() if vars(ns).get(k) is not v]
        out += [f"foreach list {i}" for i, (l, old) in enumerate(zip(lists, lists_before))
                if l != old]
        out += [f"meta_path {f!r}" for f in sys.meta_path if f not in finders]
        return out

    assert hasattr(torch_patches, "real_apply"), "torch_patches was not imported"
    assert changed() == [], changed()
    torch_patches.real_apply()
    print(sorted(changed()))
''')


def test_every_change_to_torch_is_made_by_torch_patches():
    # with the launcher's --local_addr set, gloo's class is bound to it (comm/groups.py)
    env = {**os.environ, "GLOBALTENSOR_LOCAL_ADDR": "127.0.0.1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=240, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    changed = out.stdout.strip().splitlines()[-1]
    for name in ("torch.nn.functional.one_hot", "torch.nn.functional.dropout2d",
                 "torch.nn.functional.scaled_dot_product_attention",
                 "torch.nn.utils.clip_grad._get_total_norm", "torch.nn.utils.get_total_norm",
                 "torch.save", "torch.serialization.save", "torch.get_rng_state",
                 "torch.random.set_rng_state", "parallel.parallelize_module",
                 "foreach list 0", "foreach list 1", "meta_path",
                 "torch.distributed.ProcessGroupGloo", "torch.distributed.distributed_c10d.ProcessGroupGloo"):
        assert name in changed, (name, changed)
