"""`trtc bench`: replay a request set against the Python API or a running server and report the
numbers of inference: TTFT, TPOT, inter-token latency, end-to-end latency (p50/p90/p99),
requests/s, output tokens/s and peak memory; in-flight batching and static batching (fixed
batches that wait for their longest member, as transformers' `generate` does) on the same set.

request_sets    the request sets (also what `trtc tune` replays)
summary         a run's request timings summarized into its result
in_process      the engine driven in-process, in-flight and static
load_generator  one load generator's streamed completions against a server
load_processes  the load generator spread over processes
http_load       a running server driven through HTTP
baselines       transformers' static batching and continuous batching
run             one call per case: an artifact in-process, or a server at a URL
report          the table, the comparisons and the JSON document `trtc bench` prints and writes
"""

from trtc.runtime.bench.baselines import run_hf_continuous, run_hf_static
from trtc.runtime.bench.http_load import run_server
from trtc.runtime.bench.in_process import MODES, run_engine
from trtc.runtime.bench.load_processes import default_load_processes
from trtc.runtime.bench.request_sets import BenchRequest, make_requests, request_set, text_requests
from trtc.runtime.bench.run import bench_artifact, bench_url

__all__ = [
    "MODES",
    "BenchRequest",
    "bench_artifact",
    "bench_url",
    "default_load_processes",
    "make_requests",
    "request_set",
    "run_engine",
    "run_hf_continuous",
    "run_hf_static",
    "run_server",
    "text_requests",
]
