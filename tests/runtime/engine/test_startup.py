"""Start-up reporting: a Python environment without compiled bytecode (every start compiles
the sources of what it imports) is found and named with its fix."""

from __future__ import annotations

import compileall
import importlib
import logging
import sys

from trtc.runtime.engine.startup import modules_without_bytecode, warn_if_uncompiled


def test_a_module_without_cached_bytecode_is_named_until_it_is_compiled(
    tmp_path, monkeypatch, caplog
):
    package = tmp_path / "uncompiled_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # as PYTHONDONTWRITEBYTECODE=1
    monkeypatch.delitem(sys.modules, "uncompiled_pkg", raising=False)
    importlib.import_module("uncompiled_pkg")
    assert modules_without_bytecode(("uncompiled_pkg", "not_imported")) == ["uncompiled_pkg"]
    with caplog.at_level(logging.WARNING, logger="trtc.startup"):
        warn_if_uncompiled(("uncompiled_pkg",))
    assert "python -m compileall -q " + str(tmp_path) in caplog.text
    assert compileall.compile_dir(str(package), quiet=1)
    assert modules_without_bytecode(("uncompiled_pkg",)) == []
