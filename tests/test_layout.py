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


RUNTIME_LAYERS = ("engine", "executors", "serving", "speculative", "distributed", "bench")


def test_runtime_core_imports_no_other_runtime_layer():
    """runtime/core (sequence, block manager, scheduler, sampler) is the bottom layer: the
    engine, executors, proposers and server build on it, never the other way round (imports
    for type checking included: they are the loops that make a layer hard to read alone)."""
    forbidden = tuple(f"trtc.runtime.{layer}" for layer in RUNTIME_LAYERS)
    broken = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "runtime" / "core").rglob("*.py"))
        for name in imported_modules(path)
        if name.startswith(forbidden)
    ]
    assert broken == []


def _probes(path: Path) -> list[str]:
    """``getattr`` / ``hasattr`` calls of ``path`` on an executor: an expression that names
    one, or ``self`` inside an executor's module."""
    is_executor_module = "executor" in path.name
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and node.args
        ):
            continue
        target = ast.unparse(node.args[0])
        if "executor" in target.lower() or (is_executor_module and target == "self"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_module_probes_an_executor():
    """Every member a caller uses is declared by `runtime.executors.base.Executor` (with its
    default): nothing asks an executor whether it has one."""
    found = [
        probe
        for folder in ("trtc", "compiler", "plugins", "runtime", "benchmarks")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for probe in _probes(path)
    ]
    assert found == []


MAX_FUNCTION_LINES, MAX_CLASS_LINES = 79, 299


def _is_kernel_module(tree: ast.Module) -> bool:
    """A module of Triton kernels (and their launchers): its functions are the exception to the
    size rule, their length set by the instructions they schedule."""
    return any(
        isinstance(node, ast.FunctionDef)
        and any(ast.unparse(d).startswith("triton.jit") for d in node.decorator_list)
        for node in ast.walk(tree)
    )


def test_functions_and_classes_stay_small():
    """No function of 80 lines or more and no class of 300 or more outside the kernel
    modules: a reader holds each in their head."""
    too_long = []
    for folder in ("trtc", "compiler", "plugins", "runtime", "benchmarks", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            if _is_kernel_module(tree):
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    lines = node.end_lineno - node.lineno + 1
                    most = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                    if lines > most:
                        too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert too_long == []
