"""Prometheus metrics of a serving engine (one registry per server, so tests can run several);
an `EngineObserver` of the async engine."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from trtc.runtime.engine.async_engine import EngineObserver
from trtc.runtime.engine.outputs import EngineStats, RequestOutput, StepSummary

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class EngineMetrics(EngineObserver):
    """The server's Prometheus metrics, fed by the async engine as an `EngineObserver`: gauges
    and counters copied from `EngineStats` after each step, per-request latencies and token
    counts from each `RequestOutput`."""

    def __init__(self, engine_pid: int | None = None):
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes and friends
        if engine_pid is not None:  # the engine's own process: engine_process_cpu_seconds_total...
            ProcessCollector(namespace="engine", pid=lambda: engine_pid, registry=r)
        self.queue_length = Gauge(
            "trtc_queue_length", "Requests waiting to be scheduled", registry=r
        )
        self.running = Gauge("trtc_running_sequences", "Sequences in the running batch", registry=r)
        self.kv_blocks_used = Gauge("trtc_kv_blocks_used", "KV-cache blocks in use", registry=r)
        self.kv_blocks_total = Gauge(
            "trtc_kv_blocks_total", "KV-cache blocks in the pool", registry=r
        )
        self.prefix_cache_queries = Counter(
            "trtc_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_cache_hits = Counter(
            "trtc_prefix_cache_hits", "Prompt tokens served by the prefix cache", registry=r
        )
        self.prompt_tokens = Counter("trtc_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("trtc_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("trtc_requests", "Finished requests", ["finish_reason"], registry=r)
        self.rejected = Counter(
            "trtc_rejected_requests", "Requests refused (queue full)", registry=r
        )
        self.preemptions = Counter(
            "trtc_preemptions", "Sequences preempted for lack of KV blocks", registry=r
        )
        self.steps = Counter("trtc_steps", "Engine steps", ["kind"], registry=r)
        self.spec_proposed = Counter(
            "trtc_spec_proposed_tokens", "Draft tokens verified (speculative decoding)", registry=r
        )
        self.spec_accepted = Counter(
            "trtc_spec_accepted_tokens", "Draft tokens the target accepted", registry=r
        )
        self.spec_verifications = Counter(
            "trtc_spec_verifications", "Sequence steps that verified drafts", registry=r
        )
        self.spec_mean_accepted = Gauge(
            "trtc_spec_mean_accepted_length",
            "Tokens a verifying sequence gains per step: accepted drafts + 1, on average",
            registry=r,
        )
        self.startup = Gauge(
            "trtc_startup_seconds",
            "Seconds each start-up phase took (interpreter and imports, CUDA context, weights, "
            'kernels, graphs, ...); phase="ready": process start to serving',
            ["phase"],
            registry=r,
        )
        self.ttft = Histogram(
            "trtc_time_to_first_token_seconds",
            "Time to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "trtc_time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "trtc_e2e_request_latency_seconds",
            "Request latency",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # The engine's totals at the last copy: Prometheus counters only take increments.
        self._seen = {
            "queries": 0,
            "hits": 0,
            "preemptions": 0,
            "proposed": 0,
            "accepted": 0,
            "verifications": 0,
        }

    def observe_startup(self, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            self.startup.labels(phase).set(seconds)

    def observe_stats(self, stats: EngineStats) -> None:
        """Copy the engine's gauges and counters after a step (called from the engine thread)."""
        self.queue_length.set(stats.num_waiting)
        self.running.set(stats.num_running)
        self.kv_blocks_used.set(stats.kv_blocks_used)
        self.kv_blocks_total.set(stats.kv_blocks_total)
        c = stats.counters
        for name, value, counter in (
            ("queries", stats.prefix_cache_queries, self.prefix_cache_queries),
            ("hits", stats.prefix_cache_hits, self.prefix_cache_hits),
            ("preemptions", stats.num_preemptions, self.preemptions),
            ("proposed", c.spec_proposed_tokens, self.spec_proposed),
            ("accepted", c.spec_accepted_tokens, self.spec_accepted),
            ("verifications", c.spec_verifications, self.spec_verifications),
        ):
            if value > self._seen[name]:
                counter.inc(value - self._seen[name])
                self._seen[name] = value
        if c.mean_accepted_length is not None:
            self.spec_mean_accepted.set(c.mean_accepted_length)

    def observe_step(self, step: StepSummary) -> None:
        self.steps.labels(step.kind).inc()

    def observe_rejected(self) -> None:
        self.rejected.inc()

    def observe_output(self, out: RequestOutput) -> None:
        """Tokens of one output; its first token's latency (with the prompt's size) on the
        output that brings it; the request's latencies and finish reason on its last."""
        if (
            out.first_token_time is not None
            and len(out.token_ids) == len(out.new_token_ids)
            and out.new_token_ids
        ):
            self.ttft.observe(out.first_token_time - out.arrival_time)
            self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.new_token_ids))
        if out.finished:
            self.requests.labels(out.finish_reason or "unknown").inc()
            if out.finish_time is not None:
                self.e2e.observe(out.finish_time - out.arrival_time)
                if out.first_token_time is not None and len(out.token_ids) > 1:
                    self.tpot.observe(
                        (out.finish_time - out.first_token_time) / (len(out.token_ids) - 1)
                    )

    def render(self) -> bytes:
        """The registry in Prometheus' text format, for /metrics."""
        return generate_latest(self.registry)
