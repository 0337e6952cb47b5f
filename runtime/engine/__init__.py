"""The engine layer: `LLMEngine` (one step at a time), `LLM` (offline API), `AsyncEngine` (what
the server awaits), `EngineProcess` (the engine in a process of its own), output processing,
and the typed outputs they hand out. The offline API's names (`LLM`, `SamplingParams`) are
importable from here.

Names are imported when first used: a server's front end reads outputs and configs from here
without importing torch (which only the engine's process needs)."""

from importlib import import_module

_HOMES = {
    "LLM": "trtc.runtime.engine.llm",
    "EngineConfig": "trtc.runtime.engine.config",
    "LLMEngine": "trtc.runtime.engine.llm_engine",
    "EngineStats": "trtc.runtime.engine.outputs",
    "RequestError": "trtc.runtime.engine.outputs",
    "RequestOutput": "trtc.runtime.engine.outputs",
    "StepSummary": "trtc.runtime.engine.outputs",
    "SamplingParams": "trtc.runtime.core.sampling_params",
}

__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_HOMES[name]), name)
    globals()[name] = value
    return value
