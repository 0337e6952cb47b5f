"""How an engine runs: executor, KV pool, batch limits, speculation. Its own module, free of
torch, so that a server's front end can hold one before the engine process imports the rest."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    executor: str = "auto"  # auto | torch | cuda | tensorrt (see runtime/executors)
    device: str = "cpu"
    num_blocks: int | None = None  # KV blocks in the pool (default: from kv_cache_memory)
    kv_cache_memory: int = 1 << 30  # bytes for the KV pool when num_blocks is not given
    max_num_seqs: int | None = None  # default: the artifact's limits
    max_num_batched_tokens: int | None = None
    long_prefill_threshold: int = 0
    enable_prefix_caching: bool = True
    # Queue step n+1 on the device before reading step n's tokens (see `LLMEngine.step`).
    # None: on for the CUDA executor unless TRTC_ASYNC_SCHEDULING=0.
    async_scheduling: bool | None = None
    # Speculative decoding (runtime/speculative): "ngram" or "draft:DIR"; None = off.
    speculative: str | None = None
    speculative_tokens: int = 4  # drafts verified per sequence and step, at most
    # Speculation stops while more sequences than this run: the step is then bound by compute
    # more than by weight reads, and verifying drafts costs more than the tokens it saves.
    speculative_max_batch: int = 8
    # Capture the CUDA graphs (but two: see `CudaExecutor`) after the engine is ready,
    # one at a time between steps or while it waits (`LLMEngine.finish_start_up`, called by the
    # serving loop), not before: a replica is ready sooner, and a step that comes before its
    # graph runs in a larger one or eagerly. `trtc serve` sets it.
    defer_graphs: bool = False
    # Load the artifact's tuning for this GPU (its kernels and choices; `runtime/tune.py`).
    # `trtc tune` turns it off: a tune compiles from nothing (loaded, an earlier tuning would
    # point Triton at its shipped kernels, and nothing would be compiled into the new archive).
    use_tuning: bool = True
    # Prompts come as ids (a server's engine process: the server encodes them): load only what
    # decoding needs (`load_detokenizer`), not transformers. The engine process sets it.
    decode_only_tokenizer: bool = False
