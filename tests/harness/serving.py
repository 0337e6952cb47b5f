"""A real `trtc serve` process on loopback, for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

# Plain-text prompts the server checks send (completions; greedy answers compared).
PLAIN_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "import numpy as np\n",
    "Paris is the capital of",
    "The recipe for pancakes calls for",
    "In 1969, the first humans",
]

# Chat prompts (chat completions) of the same checks.
CHAT = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 7?",
    "Write a haiku about the sea.",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "What is the boiling point of water in Celsius?",
]
MAX_TOKENS = 32


def run_request(
    client, model, kind: str, text: str, stream: bool, max_tokens=MAX_TOKENS, **kw
) -> tuple[str, str]:
    """One greedy request through the official client: ``kind`` "chat" or "plain"
    (completions), streamed or not. Returns the text and the finish reason."""
    if kind == "chat":
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": text}],
            max_tokens=max_tokens,
            temperature=0,
            stream=stream,
            **kw,
        )
        if not stream:
            return r.choices[0].message.content, r.choices[0].finish_reason
        parts, reason = [], None
        for c in r:
            parts.append(c.choices[0].delta.content or "")
            reason = c.choices[0].finish_reason or reason
        return "".join(parts), reason
    r = client.completions.create(
        model=model, prompt=text, max_tokens=max_tokens, temperature=0, stream=stream, **kw
    )
    if not stream:
        return r.choices[0].text, r.choices[0].finish_reason
    parts, reason = [], None
    for c in r:
        parts.append(c.choices[0].text)
        reason = c.choices[0].finish_reason or reason
    return "".join(parts), reason


class GreedyReference:
    """transformers' greedy ``generate`` of one prompt alone (stopping at the chat's end-of-turn
    tokens), and the check of a served text against it: equal, or diverging only where
    transformers' own top-2 logits are within ``near_tie`` (two implementations may break a
    near tie either way). Calling it checks and returns a note for the test's report."""

    def __init__(self, hf, tok, near_tie: float, device: str = "cpu"):
        self.hf, self.tok, self.near_tie, self.device = hf, tok, near_tie, device
        self.eos = sorted(
            {
                tok.eos_token_id,
                *(tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")),
            }
        )

    def chat_ids(self, text: str) -> list[int]:
        ids = self.tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def plain_ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def generate(self, prompt_ids: list[int], max_new: int):
        """The greedy tokens (a final end-of-turn token dropped) and each step's scores."""
        import torch

        with torch.no_grad():
            out = self.hf.generate(
                torch.tensor([prompt_ids], device=self.device),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=self.eos,
                pad_token_id=self.eos[0],
                output_scores=True,
                return_dict_in_generate=True,
            )
        tokens = out.sequences[0, len(prompt_ids) :].tolist()
        if tokens and tokens[-1] in self.eos:
            tokens = tokens[:-1]
        return tokens, [s[0] for s in out.scores]

    def __call__(self, text: str, prompt_ids: list[int], max_new: int = MAX_TOKENS) -> str:
        import torch

        tokens, scores = self.generate(prompt_ids, max_new)
        want = self.tok.decode(tokens, skip_special_tokens=True)
        if text == want:
            return "identical"
        for k in range(len(tokens)):
            if not text.startswith(self.tok.decode(tokens[: k + 1], skip_special_tokens=True)):
                top2 = torch.topk(scores[k].float(), 2).values
                gap = float(top2[0] - top2[1])
                assert gap < self.near_tie, (
                    f"diverged at token {k} where transformers' top-2 logits differ "
                    f"by {gap:.3g}:\n ours: {text!r}\n hf:   {want!r}"
                )
                return f"near tie at token {k} (gap {gap:.1e})"
        raise AssertionError(f"ours {text!r} vs transformers {want!r}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(
        self,
        artifact: Path,
        log_path: Path,
        *args: str,
        startup_timeout: float = 180,
        trtc: list[str] | None = None,
        cwd: Path | None = None,
    ):
        """``trtc``: the command that runs trtc (default: this interpreter's ``-m trtc``);
        ``cwd``: the server's working directory."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        trtc = trtc or [sys.executable, "-m", "trtc"]
        self.proc = subprocess.Popen(
            [*trtc, "serve", str(artifact), "--port", str(self.port), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            cwd=cwd,
        )
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not come up:\n{self.log()}")

    def children(self) -> list[int]:
        """The server's child processes (its engine process), from /proc."""
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            return [int(pid) for pid in f.read().split()]

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def metrics(self) -> dict[str, float]:
        values = {}
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def wait_idle(self, timeout: float = 30) -> dict[str, float]:
        """Metrics once no request runs or waits (and so every block should be free)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (
                m.get("trtc_running_sequences") == 0
                and m.get("trtc_queue_length") == 0
                and m.get("trtc_kv_blocks_used") == 0
            ) or time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
