"""The launcher package's shape (files, functions, no torch at import), --version, and
the packaging: metadata single-sourced in pyproject.toml, the test extra covering
every import of the suite, and the stated lower bounds of Python and torch (every
source file parses with the oldest stated Python's grammar).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from launch_helpers import REPO, run_in_process


def launcher_shape_problems(root: Path) -> list[str]:
    """Where the launcher's modules break the package's promise: a file over 450 lines, a
    function over 60, torch or the rest of globaltensor imported at module import."""
    import ast

    problems = []
    for path in sorted(root.glob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > 450:
            problems.append(f"{path.name}: {len(text.splitlines())} lines")
        tree = ast.parse(text)
        problems += [f"{path.name}:{node.name}: {node.end_lineno - node.lineno + 1} lines" for node in ast.walk(tree)
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and node.end_lineno - node.lineno + 1 > 60]
        for node in tree.body:  # module level: what importing the launcher costs
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
                problems.append(f"{path.name}: imports torch at module level")
            if isinstance(node, ast.ImportFrom) and (node.level >= 2 or (node.module or "").startswith("torch")):
                problems.append(f"{path.name}: imports {'.' * node.level}{node.module or ''} at module level")
    return problems


def test_the_launcher_package_keeps_its_shape() -> None:
    assert launcher_shape_problems(REPO / "globaltensor" / "launch") == []


# --- version and packaging (#10 item 10) ---------------------------------------------------

@pytest.mark.timeout(60)
def test_version(capfd) -> None:
    import torch

    import globaltensor as gt

    code, out, _ = run_in_process(["--version"], capfd)
    assert code == 0
    assert out.strip() == f"globaltensor {gt.__version__} (torch {torch.__version__})"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", gt.__version__)


def test_packaging_metadata_is_complete_and_single_sourced() -> None:
    """pyproject reads the version from globaltensor.__version__; py.typed and LICENSE ship."""
    from setuptools.config.pyprojecttoml import read_configuration

    import globaltensor as gt

    project = read_configuration(REPO / "pyproject.toml")
    meta = project["project"]
    assert meta["version"] == gt.__version__  # resolved from the attr, statically
    assert any(c.startswith("License :: OSI Approved :: Apache") for c in meta["classifiers"])
    assert "Typing :: Typed" in meta["classifiers"]
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["globaltensor"]
    assert (REPO / "globaltensor" / "py.typed").is_file()
    license_text = (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text and "END OF TERMS AND CONDITIONS" in license_text


# Import name -> distribution name, where the two differ.
_DISTRIBUTION_OF = {"sklearn": "scikit-learn", "functorch": "torch"}


def _third_party_imports(*roots: Path) -> dict[str, set[str]]:
    """{distribution: files importing it} for every non-stdlib, non-local import under
    ``roots``, except imports a file declares optional with ``pytest.importorskip``
    (a test of an optional integration, which also has coverage without it)."""
    import ast

    files = [p for root in roots for p in root.rglob("*.py")]
    # modules and folders of the roots (tests/boxing/boxing_cases.py is imported as
    # ``boxing_cases`` beside it and as ``boxing.boxing_cases`` from other folders)
    local = {p.stem for p in files} | {p.parent.name for p in files} | {"globaltensor"}
    found: dict[str, set[str]] = {}
    for path in files:
        text = path.read_text()
        optional = set(re.findall(r"importorskip\(\s*[\"']([\w.]+)[\"']", text))
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local | optional:
                    found.setdefault(_DISTRIBUTION_OF.get(top, top), set()).add(str(path.relative_to(REPO)))
    return found


def test_the_test_extra_covers_every_import_of_the_suite() -> None:
    """`pip install -e ".[test]"` on a fresh machine installs all that the tests, the
    examples they run and the package code they reach import (.ci/run checks it for real)."""
    from setuptools.config.pyprojecttoml import read_configuration

    meta = read_configuration(REPO / "pyproject.toml")["project"]
    requirements = [*meta["dependencies"], *meta["optional-dependencies"]["test"]]
    installed = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}
    imports = _third_party_imports(REPO / "tests", REPO / "examples", REPO / "globaltensor")
    missing = {dist: sorted(files) for dist, files in imports.items() if dist.lower() not in installed}
    assert not missing, f"imported by the suite but not in the test extra: {missing}"
    ci = (REPO / ".ci" / "run").read_text()
    readme_install = 'pip install torch==2.13.0 && pip install -e ".[test]"'
    assert readme_install in (REPO / "README.md").read_text() and readme_install in ci
    assert re.search(r"^python3? -m venv ", ci, re.M) and "--system-site-packages" not in ci


def _lower_bounds() -> tuple[tuple[int, ...], tuple[int, ...]]:
    from setuptools.config.pyprojecttoml import read_configuration

    meta = read_configuration(REPO / "pyproject.toml")["project"]
    python = tuple(int(x) for x in re.fullmatch(r">=(\d+)\.(\d+)", meta["requires-python"]).groups())
    (torch_req,) = [d for d in meta["dependencies"] if d.startswith("torch")]
    torch_min = tuple(int(x) for x in re.fullmatch(r"torch>=(\d+)\.(\d+)", torch_req).groups())
    return python, torch_min


def test_the_stated_lower_bounds_hold() -> None:
    """Feature checks for what the package uses from torch (each present since the stated
    lower bound), and every source file parses with the oldest stated Python's grammar."""
    import ast
    import inspect

    import torch
    import torch.distributed as dist

    python_min, torch_min = _lower_bounds()
    assert torch_min >= (2, 5) and python_min >= (3, 9)
    assert tuple(int(x) for x in torch.__version__.split(".")[:2]) >= torch_min
    assert hasattr(torch.ops.aten, "_safe_softmax")  # torch 2.5: rules/softmax.py
    assert "device_id" in inspect.signature(dist.init_process_group).parameters  # 2.3: comm/
    from torch.distributed.elastic.multiprocessing import LogsSpecs  # noqa: F401  (2.3: launch/logs.py)
    assert "master_listen_fd" in (torch.distributed.TCPStore.__init__.__doc__ or "")  # launch/rendezvous.py
    for path in sorted((REPO / "globaltensor").rglob("*.py")):
        ast.parse(path.read_text(), filename=str(path), feature_version=python_min)
