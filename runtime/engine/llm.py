"""The offline API users know from vLLM: ``LLM(artifact).generate(prompts, params)``."""

from __future__ import annotations

from pathlib import Path

from trtc.artifact import Artifact
from trtc.runtime.core.sampling_params import SamplingParams
from trtc.runtime.engine.llm_engine import EngineConfig, LLMEngine
from trtc.runtime.engine.outputs import RequestOutput


class LLM:
    """Offline API: ``LLM(artifact).generate(prompts, SamplingParams(...))``."""

    def __init__(self, artifact: str | Path | Artifact, **engine_kwargs):
        self.engine = LLMEngine(artifact, EngineConfig(**engine_kwargs))

    def generate(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        params_list = (
            params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        )
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        return self.generate([self.engine.apply_chat_template(messages)], params)[0]
