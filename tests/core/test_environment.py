"""Every GLOBALTENSOR_* variable is read in globaltensor/env.py and listed once, with its
default and meaning, in env.VARIABLES and in docs/environment.md's table."""
import ast
import re
from pathlib import Path

import pytest

from globaltensor import env

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "globaltensor"

# Modules that read a GLOBALTENSOR_* variable themselves, and why:
READERS_BESIDES_ENV = {
    # the worker bootstrap imports only the standard library (launch/boot.py)
    "launch/boot.py": {"GLOBALTENSOR_LAUNCHER_PID", "GLOBALTENSOR_PS_WORKER_NUM"},
}


def documented() -> dict:
    rows = {}
    for line in (ROOT / "docs" / "environment.md").read_text().splitlines():
        m = re.match(r"\| `(GLOBALTENSOR_\w+)` \| ([^|]*) \|", line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} is listed twice"
            rows[m.group(1)] = m.group(2).strip()
    return rows


def sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), path.read_text()


def test_the_docs_table_is_env_variables():
    assert documented() == {name: default for name, (default, _) in env.VARIABLES.items()}


def test_every_variable_the_package_names_is_in_the_table():
    named = {m for _, text in sources() for m in re.findall(r"GLOBALTENSOR_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_])", text)}
    assert named - set(env.VARIABLES) == set()


def _environment_reads(tree) -> set:
    """GLOBALTENSOR_* names read from the environment: os.environ.get(...),
    os.environ[...] (loaded), os.getenv(...), ... in os.environ."""
    def is_environ(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    def name(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.startswith("GLOBALTENSOR_"):
            return node.value
        return None

    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            f = node.func
            if (f.attr == "get" and is_environ(f.value)) or f.attr == "getenv":
                found.add(name(node.args[0]))
        elif isinstance(node, ast.Subscript) and is_environ(node.value) \
                and isinstance(node.ctx, ast.Load):
            found.add(name(node.slice))
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            found.add(name(node.left))
    return found - {None}


def test_only_env_reads_the_variables():
    reads = {}
    for rel, text in sources():
        names = _environment_reads(ast.parse(text))
        if names and rel != "env.py":
            reads[rel] = names
    assert reads == READERS_BESIDES_ENV


def test_the_scan_sees_reads():
    code = ('import os\nos.environ.get("GLOBALTENSOR_A")\nos.environ["GLOBALTENSOR_B"]\n'
            'os.getenv("GLOBALTENSOR_C")\n"GLOBALTENSOR_D" in os.environ\n'
            'os.environ["GLOBALTENSOR_E"] = "1"\nos.environ.pop("GLOBALTENSOR_F", None)\n')
    assert _environment_reads(ast.parse(code)) == {f"GLOBALTENSOR_{c}" for c in "ABCD"}


@pytest.mark.parametrize("value, expected", [(None, True), ("", True), ("1", True),
                                             ("0", False)])
def test_torch_advice_switch(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("GLOBALTENSOR_TORCH_ADVICE", raising=False)
    else:
        monkeypatch.setenv("GLOBALTENSOR_TORCH_ADVICE", value)
    assert env.torch_advice_enabled() is expected


def test_the_docs_are_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    assert "docs/environment.md" in readme and "docs/torch_changes.md" in readme


@pytest.mark.parametrize("name, read", [("GLOBALTENSOR_TIMEOUT", env.timeout_seconds),
                                        ("GLOBALTENSOR_READ_TIMEOUT", env.read_timeout_seconds)])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "NaN", "0", "-5", "abc", "1e400"])
def test_a_timeout_that_is_not_finite_and_positive_names_the_variable(monkeypatch, name, read,
                                                                      value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"{name}={value!r} is not allowed: it must be a "
                                         r"finite number of seconds > 0"):
        read()


@pytest.mark.parametrize("value, seconds", [(None, 300.0), ("", 300.0), ("2.5", 2.5),
                                            (" 60 ", 60.0)])
def test_a_timeout_reads_seconds(monkeypatch, value, seconds):
    if value is None:
        monkeypatch.delenv("GLOBALTENSOR_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("GLOBALTENSOR_TIMEOUT", value)
    assert env.timeout_seconds() == seconds
