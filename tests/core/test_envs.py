"""trtc/envs.py: every TRTC_* setting is read when used, not at import, and parsed as documented."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from trtc import envs

ROOT = Path(__file__).resolve().parents[2]


def test_settings_are_read_when_used(monkeypatch):
    monkeypatch.delenv("TRTC_PDL", raising=False)
    assert envs.TRTC_PDL is True
    monkeypatch.setenv("TRTC_PDL", "0")
    assert envs.TRTC_PDL is False
    monkeypatch.setenv("TRTC_GEMV_MAX_TOKENS", "5")
    assert envs.TRTC_GEMV_MAX_TOKENS == 5
    monkeypatch.setenv("TRTC_CACHE_DIR", "/tmp/somewhere")
    assert envs.TRTC_CACHE_DIR == Path("/tmp/somewhere")
    with pytest.raises(AttributeError):
        _ = envs.TRTC_NO_SUCH_SETTING


def test_every_trtc_variable_the_code_names_is_declared():
    """One source of truth: a TRTC_* name anywhere in the installed code is in envs.ENVIRONMENT."""
    named = set()
    for folder in ("trtc", "compiler", "plugins", "runtime"):
        for path in (ROOT / folder).rglob("*.py"):
            named |= set(re.findall(r"\bTRTC_[A-Z0-9_]+\b", path.read_text()))
    assert named - set(envs.ENVIRONMENT) == set()


def test_the_module_lists_them():
    out = subprocess.run(
        [sys.executable, "-m", "trtc.envs"], capture_output=True, text=True, check=True
    ).stdout
    assert all(f"{name}=" in out for name in envs.ENVIRONMENT)
