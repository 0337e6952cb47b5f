"""The engine behind the server: outputs reach asyncio consumers from the engine thread, and a
consumer that falls behind gets the outputs waiting for it as one, losing nothing."""

from __future__ import annotations

import asyncio

from trtc.runtime.core.sequence import SamplingParams
from trtc.runtime.engine import LLM, EngineConfig, LLMEngine
from trtc.runtime.engine.async_engine import AsyncEngine
from trtc.runtime.engine.outputs import RequestOutput

PROMPT = [5, 6, 7, 8, 9, 10]
PARAMS = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def test_an_output_then_a_later_one_is_the_later_with_both_deltas():
    a = RequestOutput("r", [1], [4, 5], "ab", [5], "b")
    b = RequestOutput("r", [1], [4, 5, 6], "abc", [6], "c", True, "length")
    merged = a.then(b)
    assert merged.token_ids == [4, 5, 6] and merged.text == "abc" and merged.finished
    assert merged.new_token_ids == [5, 6] and merged.delta_text == "bc"
    assert merged.finish_reason == "length"


async def consume(async_engine: AsyncEngine, pause_after_first: float) -> list[RequestOutput]:
    outs = []
    async for out in async_engine.generate(PROMPT, PARAMS):
        outs.append(out)
        if len(outs) == 1:
            await asyncio.sleep(pause_after_first)  # the engine thread steps on meanwhile
    return outs


def test_a_consumer_that_falls_behind_gets_the_waiting_tokens_as_one_output(tiny_artifacts):
    art = tiny_artifacts["tiny-llama"]
    want = LLM(art, executor="torch", num_blocks=64).generate([PROMPT], PARAMS)[0]
    async_engine = AsyncEngine(LLMEngine(art, EngineConfig(executor="torch", num_blocks=64)), 8)
    async_engine.start()
    try:
        # Until the request ends (40 steps of a tiny model), the consumer reads nothing more.
        outs = asyncio.run(consume(async_engine, pause_after_first=1.0))
    finally:
        async_engine.stop()
    assert outs[-1].finished and outs[-1].token_ids == want.token_ids
    assert [t for o in outs for t in o.new_token_ids] == want.token_ids  # nothing lost
    assert "".join(o.delta_text for o in outs) == outs[-1].text == want.text
    assert len(outs) < len(want.token_ids)  # several tokens arrived as one output
