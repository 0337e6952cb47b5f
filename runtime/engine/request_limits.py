"""What a request must fit: the vocabulary, the context length and the KV pool. One object
the engine checks requests with and a server's front end (which may run in another process
than the engine) checks them with before it answers 200."""

from __future__ import annotations

from dataclasses import dataclass

from trtc.runtime.core.sampling_params import SamplingParams
from trtc.runtime.engine.outputs import RequestError


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_seq_len: int
    kv_blocks: int  # blocks in the engine's pool
    block_size: int  # tokens a block

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise `RequestError` saying what is wrong with the request and how to fix it."""
        try:
            params.validate()
        except ValueError as e:
            raise RequestError(str(e)) from None
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise RequestError(f"prompt token ids must be in [0, {self.vocab_size})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_seq_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_seq_len} tokens, but "
                f"{total} were requested ({len(prompt_ids)} in the prompt, {params.max_tokens} "
                f"for the completion); shorten the prompt or lower max_tokens"
            )

    def check_fits_pool(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Refuse a request that could never run, even alone in the KV pool."""
        need = -(-(len(prompt_ids) + params.max_tokens) // self.block_size)
        if need > self.kv_blocks:
            raise RequestError(
                f"prompt + max_tokens need {need} KV blocks but the server's pool "
                f"has {self.kv_blocks}; lower max_tokens or shorten the prompt"
            )
