"""The engine layer: `LLMEngine` (one step at a time), `LLM` (offline API), `AsyncEngine` (the
server's background loop), output processing, and the typed outputs they hand out. The offline
API's names (`LLM`, `SamplingParams`) are importable from here."""

from trtc.runtime.core.sequence import SamplingParams
from trtc.runtime.engine.llm import LLM
from trtc.runtime.engine.llm_engine import EngineConfig, LLMEngine
from trtc.runtime.engine.outputs import EngineStats, RequestError, RequestOutput, StepSummary

__all__ = [
    "LLM",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "StepSummary",
]
