"""The engine without HTTP: the offline API against transformers, the torch executor against
the onnxruntime reference, artifact checks, and the `generate` / `bench` commands."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import TINY_NAMES
from harness.golden import greedy_continuation
from harness.onnx_reference import OnnxReferenceRunner
from trtc.artifact import FORMAT_VERSION, Artifact
from trtc.compiler.tiny import tiny_model
from trtc.contract import SequenceWork, make_step
from trtc.errors import ArtifactError
from trtc.runtime.core.sequence import SamplingParams
from trtc.runtime.engine import LLM, EngineConfig, LLMEngine, RequestError
from trtc.runtime.executors.torch_executor import TorchExecutor


@pytest.mark.parametrize("name", TINY_NAMES)
def test_offline_generate_matches_transformers_greedy(tiny_artifacts, name):
    hf = tiny_model(name, seed=0)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 37, 20, 60)]
    llm = LLM(
        tiny_artifacts[name], num_blocks=64, max_num_batched_tokens=48
    )  # forces chunked prefill
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == greedy_continuation(hf, prompt, 24)
        assert out.finish_reason == "length"
    assert llm.engine.block_manager.num_free_blocks == 64


def test_torch_executor_matches_onnxruntime_reference(tiny_artifacts):
    art = tiny_artifacts["tiny-qwen2"]
    torch_exec = TorchExecutor(Artifact.open(art), num_blocks=16)
    ort_exec = OnnxReferenceRunner(art, num_blocks=16)
    steps = [
        [SequenceWork(list(range(10, 40)), 0, [3, 7])],
        [SequenceWork([5], 30, [3, 7]), SequenceWork(list(range(50, 70)), 0, [1, 2])],
    ]
    for work in steps:
        a = torch_exec.execute(make_step(work, 16)).numpy()
        b = ort_exec.step(work)
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
    kv_torch = torch_exec.kv_pool[0].numpy()
    np.testing.assert_allclose(kv_torch, ort_exec.kv["kv_cache.0"], atol=1e-5)


def test_requests_join_mid_flight(tiny_artifacts):
    engine = LLMEngine(tiny_artifacts["tiny-llama"], EngineConfig(num_blocks=32))
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    long_id = engine.add_request("a long story", params)
    finished = []
    for _ in range(3):
        finished += [o.request_id for o in engine.step() if o.finished]
    short_id = engine.add_request(
        "hi", SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    )
    engine.step()
    assert engine.last_step.prefill_seqs == 1 and engine.last_step.decode_seqs == 1
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == [short_id, long_id]
    assert engine.stats().counters.mixed_steps >= 1


def test_seeded_sampling_is_reproducible_in_any_batch(tiny_artifacts):
    llm = LLM(tiny_artifacts["tiny-llama"], num_blocks=64)
    p = SamplingParams(
        max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True
    )
    alone = llm.generate(["seeded"], p)[0].token_ids
    batched = llm.generate(
        ["other", "seeded", "third"],
        [SamplingParams(max_tokens=16, temperature=1.0), p, SamplingParams(max_tokens=5)],
    )[1].token_ids
    assert alone == batched
    other_seed = llm.generate(["seeded"], SamplingParams(**{**p.__dict__, "seed": 99}))[0].token_ids
    assert other_seed != alone


def test_bad_requests_are_refused_with_reasons(tiny_artifacts):
    engine = LLMEngine(tiny_artifacts["tiny-llama"], EngineConfig(num_blocks=32))
    with pytest.raises(RequestError, match="maximum context length is 512"):
        engine.add_request("x" * 500, SamplingParams(max_tokens=100))
    with pytest.raises(RequestError, match="top_p"):
        engine.add_request("x", SamplingParams(top_p=0))
    with pytest.raises(RequestError, match="token ids must be in"):
        engine.add_request([1, 2, 10**6])


def test_engine_refuses_tampered_or_too_new_artifact(tiny_artifacts, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(tiny_artifacts["tiny-llama"], art)
    data = art / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[50] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match="does not match its recorded sha256"):
        LLMEngine(art)
    shutil.rmtree(art)
    shutil.copytree(tiny_artifacts["tiny-llama"], art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["format_version"] = FORMAT_VERSION + 1  # newer than this code reads
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="newer than this trtc reads"):
        LLMEngine(art)


def test_generate_command_streams(tiny_artifacts):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trtc",
            "generate",
            str(tiny_artifacts["tiny-llama"]),
            "hello",
            "-n",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "12 tokens, finish reason: length" in r.stderr
    llm = LLM(tiny_artifacts["tiny-llama"], num_blocks=16)
    want = llm.generate(["hello"], SamplingParams(max_tokens=12, temperature=0))[0].text
    assert r.stdout == want + "\n"


def test_bench_command_reports_both_modes(tiny_artifacts, tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trtc",
            "bench",
            str(tiny_artifacts["tiny-llama"]),
            "-n",
            "12",
            "--prompt-len",
            "8:40",
            "--output-len",
            "4:24",
            "--concurrency",
            "4",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={"COLUMNS": "120", **__import__("os").environ},
    )
    assert r.returncode == 0, r.stderr
    assert "inflight / static:" in r.stdout and "TTFT ms p50" in r.stdout
    result = json.loads(out.read_text())
    modes = {x["mode"]: x for x in result["results"]}
    assert set(modes) == {"inflight", "static"}
    for m in modes.values():
        assert m["requests"] == 12 and m["output_tokens"] > 0 and m["ttft_s"]["p50"] > 0
    # Same request set: the same number of output tokens either way (EOS is ignored).
    assert modes["inflight"]["output_tokens"] == modes["static"]["output_tokens"]


@pytest.mark.parametrize("method", ["stream", "window"])
def test_incremental_detokenizer_matches_full_decode(method):
    from trtc.compiler.tiny import byte_tokenizer
    from trtc.runtime.engine.output_processor import IncrementalDetokenizer, stream_backend

    tok = byte_tokenizer()
    ids = tok("naïve café — 東京 🙂 done", add_special_tokens=False)["input_ids"]
    assert len(ids) > 20  # multi-byte characters span several tokens
    inc = IncrementalDetokenizer(tok, stream_backend(tok))
    assert inc._stream is not None  # the Rust stream decoder is what serves
    if method == "window":
        inc._stream = None
    # One token a step, then several at once (speculative decoding's accepted drafts).
    steps = [*range(1, 12), 15, 16, 22, *range(23, len(ids) + 1)]
    prompt = [7, 8, 9]  # read in place after the prompt, as the engine feeds a sequence
    pieces = [inc.update(prompt + ids[:n], len(prompt)) for n in steps]
    assert "".join(pieces) == inc.text == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_byte_fallback_tokenizers_stream_through_windows():
    """SentencePiece-style ``<0x..>`` byte tokens: the Rust stream decoder refuses some byte
    sequences a model can sample (a newline, then an unfinished 4-byte character, then a
    word) and can change text it has sent; such tokenizers decode by windows, and a stream
    that fails anyway falls back to them, the text still whole."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.decoders import DecodeStream
    from transformers import PreTrainedTokenizerFast

    from trtc.runtime.engine.output_processor import IncrementalDetokenizer, stream_backend

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["\u2581Hello", "\u2581world"]
    vocab = {p: i for i, p in enumerate(pieces)}
    rust = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    rust.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    tok = PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="<unk>")
    bad = [vocab[p] for p in ("\u2581Hello", "<0x0A>", "<0xF0>", "\u2581world")]
    smile = ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]  # one 4-byte character
    good = [vocab[p] for p in ("\u2581Hello", "<0x0A>", *smile, "\u2581world")]
    with pytest.raises(Exception, match="Invalid prefix"):  # what the stream does with them
        stream = DecodeStream(skip_special_tokens=True)
        [stream.step(rust, t) for t in bad]

    def streamed(forced: bool, ids: list[int]) -> IncrementalDetokenizer:
        inc = IncrementalDetokenizer(tok, rust if forced else stream_backend(tok))
        pieces_out = [inc.update(ids[:n]) for n in range(1, len(ids) + 1)]
        assert inc.text == "".join(pieces_out)  # what was sent is the text
        return inc

    assert stream_backend(tok) is None  # windows for this tokenizer
    assert streamed(False, good).text == tok.decode(good) == "Hello\n\U0001f642 world"
    assert streamed(True, good).text == tok.decode(good)  # the stream, where it copes
    assert streamed(False, bad).text.startswith("Hello\n")  # no error, no text lost
    fell_back = streamed(True, bad)
    assert fell_back._stream is None and fell_back.text.startswith("Hello")
