"""The dependency rule of docs/architecture.md, checked on the source: the core imports none of
compiler, plugins or runtime; compiler and runtime never import each other; nothing installed
imports benchmarks or the tests."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> the trtc subpackages its modules must not import
FORBIDDEN = {
    "trtc": ("trtc.compiler", "trtc.runtime", "trtc.plugins"),
    "compiler": ("trtc.runtime",),
    "runtime": ("trtc.compiler",),
    "plugins": ("trtc.compiler", "trtc.runtime"),
}
CLI = ROOT / "trtc" / "cli.py"  # the CLI composes compiler and runtime


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_dependency_rule(folder):
    broken = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        if path == CLI:
            continue
        for name in imported_modules(path):
            top = name.split(".")[0]
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[folder]) or top in (
                "benchmarks",
                "harness",
                "conftest",
            ):
                broken.append(f"{path.relative_to(ROOT)} imports {name}")
    assert broken == []


def test_every_package_is_installed():
    """A non-editable install ships exactly the packages pyproject.toml lists: a package folder
    missing from the list installs as nothing, and the editable install used here hides it."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for name, folder in setup["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *parts)))
    assert found == set(setup["packages"])
