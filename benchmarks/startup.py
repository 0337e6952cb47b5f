"""Time to serve: `trtc serve ARTIFACT` from process start to a healthy ``/health``, then the
first request (8 tokens), for a tuned artifact against the same artifact untuned, in one run.

Each case is a fresh server process. ``untuned``: ``TRTC_TUNING=0`` and an empty Triton cache
(what a new replica of an untuned artifact meets: every kernel compiled at start). ``tuned``:
the artifact's `trtc tune` kernels, unpacked into an empty trtc cache (what a new replica
meets: the unpacking is counted). The server's own start-up phases (``trtc_startup_seconds``
on /metrics) are printed beside the wall-clock figures.

    python3 benchmarks/startup.py ARTIFACT [--repeats 2] [--json FILE]

The weights are read from the page cache when the file was read recently (a build or an
earlier case); ``--cold`` evicts the artifact's files from it before each case
(``posix_fadvise(DONTNEED)``: no privileges needed), so the weights come from the disk, and
prints the disk's read rate for the weights file measured the same way."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx

from trtc.runtime.distributed.rank_env import free_port

STARTUP_TIMEOUT_S = 600  # a server that neither comes up nor exits ends the run
FIRST = {"prompt": "hello", "max_tokens": 8, "ignore_eos": True, "temperature": 0}


def evict(artifact: str) -> None:
    """Drop the artifact's files from the page cache (clean pages go; nothing is written)."""
    for root, _, names in os.walk(artifact):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_read_rate(path: str) -> float:
    """GB/s of one sequential reader of ``path`` after evicting it from the page cache."""
    evict(os.path.dirname(path) or ".")
    size, start = os.path.getsize(path), time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    return size / (time.perf_counter() - start) / 1e9


def launch_server(
    artifact: str, port: int, log_path: str, env: dict | None = None, args: tuple[str, ...] = ()
) -> subprocess.Popen:
    """`trtc serve ARTIFACT --port PORT [args]` in a process of its own, its output (both
    streams) in ``log_path``; ``env`` on top of this process's environment."""
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "trtc", "serve", artifact, "--port", str(port), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )


def wait_healthy(
    proc: subprocess.Popen,
    client: httpx.Client,
    start: float,
    log_path: str,
    timeout: float = STARTUP_TIMEOUT_S,
) -> float:
    """Poll ``/health`` every 20 ms until it answers 200: the seconds since ``start``
    (``time.perf_counter``). An error if the server exits first or is not healthy ``timeout``
    seconds after ``start``."""
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        if time.perf_counter() - start > timeout:
            raise RuntimeError(f"not healthy after {timeout} s; see {log_path}")
        try:
            if client.get("/health", timeout=1).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.02)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (running requests finish), then SIGKILL if it has not exited within a minute."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def startup_phases(client: httpx.Client) -> dict[str, float]:
    """The server's start-up phases, seconds each (``trtc_startup_seconds`` on /metrics)."""
    phases = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("trtc_startup_seconds{"):
            name = line.split('phase="', 1)[1].split('"', 1)[0]
            phases[name] = float(line.rsplit(" ", 1)[1])
    return phases


def serve_once(artifact: str, env: dict, log_path: str) -> dict:
    port = free_port()
    # One client, made before the clock starts and kept alive: what a load balancer or a
    # client library holds. A new httpx client a request costs 30-80 ms (its TLS context),
    # which is the client's time, not the server's.
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    start = time.perf_counter()
    proc = launch_server(artifact, port, log_path, env)
    try:
        healthy = wait_healthy(proc, client, start, log_path)
        model = client.get("/v1/models").json()["data"][0]["id"]
        t = time.perf_counter()
        r = client.post("/v1/completions", json={**FIRST, "model": model})
        first = time.perf_counter() - t
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
        t = time.perf_counter()
        r = client.post("/v1/completions", json={**FIRST, "model": model, "prompt": "hello again"})
        second = time.perf_counter() - t
        assert r.status_code == 200, r.text
        return {
            "healthy_s": healthy,
            "first_request_s": first,
            "second_request_s": second,
            "phases": startup_phases(client),
        }
    finally:
        client.close()
        stop_server(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--cold", action="store_true", help="weights from the disk, not the cache")
    ap.add_argument("--json")
    args = ap.parse_args()
    manifest = json.load(open(os.path.join(args.artifact, "manifest.json")))
    if not manifest.get("tuning"):
        ap.error(f"{args.artifact} is not tuned: run `trtc tune {args.artifact}` first")
    rows = []
    if args.cold:
        weights = os.path.join(args.artifact, "model.onnx.data")
        print(f"disk read rate (weights file, one reader): {disk_read_rate(weights):.2f} GB/s")
    for repeat in range(args.repeats):
        for case in ("untuned", "tuned"):
            with tempfile.TemporaryDirectory() as tmp:
                env = {"TRTC_CACHE_DIR": os.path.join(tmp, "trtc")}
                if case == "untuned":
                    env |= {"TRTC_TUNING": "0", "TRITON_CACHE_DIR": os.path.join(tmp, "triton")}
                if args.cold:
                    evict(args.artifact)
                r = serve_once(args.artifact, env, os.path.join(tmp, "server.log"))
            r |= {"case": case, "repeat": repeat, "weights_from": "disk" if args.cold else "cache"}
            rows.append(r)
            phases = ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items())
            print(
                f"{case:8s} healthy after {r['healthy_s']:.2f} s, first request (8 tokens) "
                f"{1000 * r['first_request_s']:.0f} ms, second {1000 * r['second_request_s']:.0f}"
                f" ms; phases (s): {phases}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
