"""The TensorRT executor where no engine can run: its refusals (before any TensorRT import),
executor selection, and the translation of paged steps into slot-engine calls, checked on CPU
against the slot contract's rules and end to end through the lowered graph in onnxruntime."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from trtc.artifact import Artifact, EngineRecord
from trtc.contract import SequenceWork, make_step
from trtc.engines import choose_engine, engine_refusal
from trtc.errors import ArtifactError
from trtc.runtime.executors import create_executor
from trtc.runtime.executors.tensorrt_executor import (
    MAX_PADDING_TOKENS,
    TensorRTExecutor,
    slot_calls,
)

MAX_SEQ_LEN = 64
no_gpu = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusals of a host without a GPU"
)


@pytest.fixture(scope="module")
def rtx_artifact(tmp_path_factory):
    """A real artifact with a TensorRT-RTX sm86 engine (built CPU-only)."""
    pytest.importorskip("tensorrt_rtx")
    from conftest import build_quiet
    from trtc.compiler.config import parse_config

    cfg = parse_config(
        {
            "model": {"source": "tiny", "name": "tiny-llama"},
            "precision": "fp32",
            "limits": {"max_num_tokens": 64, "max_num_seqs": 4, "max_seq_len": MAX_SEQ_LEN},
            "backend": {"name": "tensorrt-rtx", "targets": ["sm86"]},
        }
    )
    return build_quiet(cfg, tmp_path_factory.mktemp("rtx") / "art")


def engines(artifact) -> list[EngineRecord]:
    return Artifact.open(artifact).manifest.engines


# --- refusals and selection ---------------------------------------------------------------------


@no_gpu
def test_executor_refuses_an_engine_without_a_gpu(rtx_artifact):
    with pytest.raises(
        ArtifactError, match=r"cannot run engine sm86 \(engines/sm86.engine\): this host has no GPU"
    ):
        TensorRTExecutor(Artifact.open(rtx_artifact), engine=engines(rtx_artifact)[0])
    with pytest.raises(
        ArtifactError,
        match=r"executor 'tensorrt': no engine of .* can run on this host: "
        r"engine sm86 \(tensorrt-rtx 1\.[0-9.]+, engines/sm86.engine\): this host has no GPU",
    ):
        create_executor("tensorrt", Artifact.open(rtx_artifact), 16)


@no_gpu
def test_auto_falls_back_to_torch_and_says_why(rtx_artifact, caplog):
    with caplog.at_level(logging.INFO, logger="trtc.executor"):
        executor = create_executor("auto", Artifact.open(rtx_artifact), 16)
    assert executor.name == "torch"
    said = [r for r in caplog.records if r.name == "trtc.executor"]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "not using a TensorRT engine" in said[0].message and "engine sm86" in said[0].message
    assert (
        "this host has no GPU" in said[0].message and "using the torch executor" in said[0].message
    )
    logits = executor.execute(make_step([SequenceWork([1, 2, 3], 0, [0])], executor.block_size))
    assert logits.shape == (
        1,
        json.loads((rtx_artifact / "manifest.json").read_text())["model"]["vocab_size"],
    )
    assert torch.isfinite(logits).all()


def test_auto_on_an_artifact_without_engines_says_so(tiny_artifacts, caplog):
    with caplog.at_level(logging.INFO, logger="trtc.executor"):
        executor = create_executor("auto", Artifact.open(tiny_artifacts["tiny-llama"]), 8)
    assert executor.name == ("cuda" if torch.cuda.is_available() else "torch")
    assert any(
        "the artifact has no engines" in r.message and r.levelno == logging.INFO
        for r in caplog.records
    )
    with pytest.raises(ArtifactError, match="executor 'tensorrt'.*the artifact has no engines"):
        create_executor("tensorrt", Artifact.open(tiny_artifacts["tiny-llama"]), 8)
    with pytest.raises(ArtifactError, match="choose from auto, torch, cuda, tensorrt"):
        create_executor("trt", Artifact.open(tiny_artifacts["tiny-llama"]), 8)


@no_gpu
def test_forced_tensorrt_on_the_command_line_fails_with_the_reason(rtx_artifact):
    env = {**os.environ, "COLUMNS": "200"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trtc",
            "generate",
            str(rtx_artifact),
            "hi",
            "--executor",
            "tensorrt",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 1, r.stderr
    assert (
        "executor 'tensorrt'" in r.stderr
        and "engine sm86" in r.stderr
        and "this host has no GPU" in r.stderr
    )
    r = subprocess.run(
        [sys.executable, "-m", "trtc", "generate", str(rtx_artifact), "hi", "--executor", "trt"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 2 and "auto" in r.stderr and "tensorrt" in r.stderr


def test_inspect_and_the_executor_share_one_check(rtx_artifact):
    from trtc.compiler.inspect import host_can_run

    for e in engines(rtx_artifact):
        why = engine_refusal(e)
        assert host_can_run(e) == ("yes" if why is None else f"no: {why}")
    record, reasons = choose_engine(Artifact.open(rtx_artifact).manifest)
    assert (record is None) == bool(reasons)


@pytest.mark.gpu
def test_engine_for_another_compute_capability_is_refused_before_tensorrt_is_imported(
    tiny_artifacts,
):
    """On a GPU (the lead's H200, no TensorRT packages there): an engine record for another
    compute capability is refused from the manifest alone, naming both capabilities."""
    major, minor = torch.cuda.get_device_capability()
    target, cc = ("sm89", "8.9") if (major, minor) == (8, 6) else ("sm86", "8.6")
    record = EngineRecord(
        target=target,
        compute_capability=cc,
        backend="tensorrt-rtx",
        trt_version="1.7.1.116",
        file=f"engines/{target}.engine",
        bytes=1,
        sha256="0" * 64,
        precision="fp32",
        kv_layout="slot",
        build_time_s=1.0,
        profile={},
        io={},
        aliases={},
    )
    plain = Artifact.open(tiny_artifacts["tiny-llama"])
    artifact = Artifact(plain.path, plain.manifest.model_copy(update={"engines": [record]}))
    for attempt in (
        lambda: TensorRTExecutor(artifact),
        lambda: create_executor("tensorrt", artifact, None),
    ):
        with pytest.raises(ArtifactError) as e:
            attempt()
        message = str(e.value)
        assert f"engine {target} is for compute capability {cc}" in message
        assert f"compute capability {major}.{minor}" in message and "not importable" not in message


# --- paged steps as slot-engine calls ---------------------------------------------------------


def paged(work: list[tuple[list[int], int, int]]) -> dict:
    """A paged step as the engine makes it for a slot engine: block size = max_seq_len, so a
    sequence's one block id is its slot. ``work``: (new tokens, cached, slot) per sequence."""
    return make_step([SequenceWork(t, c, [slot]) for t, c, slot in work], MAX_SEQ_LEN)


def check_rules(calls, step, num_slots=8):
    """Every call keeps the slot contract's rules, and together they cover the step once."""
    seen = []
    for call in calls:
        ids, pos, li = (call.inputs[k] for k in ("input_ids", "cache_positions", "logits_indices"))
        rows, width = ids.shape
        assert 0 <= call.first_slot and call.first_slot + rows <= num_slots
        assert (pos + width <= MAX_SEQ_LEN).all()
        for b, s in enumerate(call.seqs):
            begin, end = int(step.query_start_loc[s]), int(step.query_start_loc[s + 1])
            assert int(step.block_tables[s, 0]) == call.first_slot + b  # row = the sequence's slot
            assert ids[b, : end - begin].tolist() == step.input_ids[begin:end].tolist()
            assert pos[b] == int(step.context_lens[s]) - (end - begin)
            assert (
                li[b] == b * width + int(step.logits_indices[s]) - begin
            )  # the same token's logits
            seen.append(s)
    assert sorted(seen) == list(range(len(step.context_lens)))


def test_decode_steps_of_consecutive_slots_are_one_call():
    step = paged([([5], 10, 0), ([6], 3, 1), ([7], 20, 2)])
    calls = slot_calls(step, 8, MAX_SEQ_LEN)
    check_rules(calls, step)
    assert [(c.first_slot, c.seqs, c.inputs["input_ids"].shape) for c in calls] == [
        (0, [0, 1, 2], (3, 1))
    ]


def test_idle_slots_are_never_bound():
    # Slot 1 holds a sequence not in this step: binding it would let padding overwrite its cache.
    step = paged([([5], 10, 2), ([6], 3, 0), ([8], 4, 3)])
    calls = slot_calls(step, 8, MAX_SEQ_LEN)
    check_rules(calls, step)
    assert [(c.first_slot, c.seqs) for c in calls] == [(0, [1]), (2, [0, 2])]


def test_a_long_prefill_is_not_padded_into_decode_rows():
    # Padding stays under MAX_PADDING_TOKENS per call: the 40-token chunk takes one decode row
    # along (39 padded tokens), not two (78).
    assert MAX_PADDING_TOKENS == 64
    step = paged([([1], 5, 0), ([2], 6, 1), (list(range(40)), 0, 2), ([3], 7, 3), ([4], 2, 4)])
    calls = slot_calls(step, 8, MAX_SEQ_LEN)
    check_rules(calls, step)
    assert [(c.first_slot, c.inputs["input_ids"].shape) for c in calls] == [
        (0, (2, 1)),
        (2, (2, 40)),
        (4, (1, 1)),
    ]
    similar = paged(
        [(list(range(30)), 0, 0), (list(range(34)), 0, 1)]
    )  # padding 4 tokens: one call
    assert [c.inputs["input_ids"].shape for c in slot_calls(similar, 8, MAX_SEQ_LEN)] == [(2, 34)]


def test_a_nearly_full_slot_does_not_share_a_wide_call():
    step = paged(
        [([1], MAX_SEQ_LEN - 2, 0), ([4, 5, 6], 0, 1)]
    )  # padding to 3 would write past row 63
    calls = slot_calls(step, 8, MAX_SEQ_LEN)
    check_rules(calls, step)
    assert [c.first_slot for c in calls] == [0, 1]


def test_logits_of_any_token_of_a_sequence():
    step = paged([([1, 2, 3, 4], 0, 0), ([9], 2, 1)])
    step.logits_indices = torch.tensor([1, 4])  # the second token of sequence 0
    calls = slot_calls(step, 8, MAX_SEQ_LEN)
    check_rules(calls, step)
    assert calls[0].inputs["logits_indices"].tolist() == [1, 4]


@pytest.mark.parametrize(
    "change,message",
    [
        ("per_position", "one token per sequence; this step asks for 4 rows for 2 sequences"),
        ("shared_slot", "sequences 0 and 1 share slot 3"),
        ("slot_range", "slot 9 is outside the engine's 8 slots"),
        ("too_long", "exceed the engine's max_seq_len 64"),
        ("foreign_logits", "logits index 3 is not one of its tokens"),
    ],
)
def test_steps_a_slot_engine_cannot_run_are_clear_errors(change, message):
    work = {
        "shared_slot": [([1], 0, 3), ([2], 0, 3)],
        "slot_range": [([1], 0, 0), ([2], 0, 9)],
    }.get(change, [([1, 2, 3], 0, 0), ([4], 1, 1)])
    step = paged(work)
    if change == "too_long":
        step.context_lens[1] = MAX_SEQ_LEN + 1
    if change == "per_position":
        step.logits_indices = torch.arange(4)  # trtc eval asks for every position
    if change == "foreign_logits":
        step.logits_indices = torch.tensor([3, 3])
    with pytest.raises(ValueError, match=message):
        slot_calls(step, 8, MAX_SEQ_LEN)


def test_slot_calls_compute_what_the_paged_graph_computes(tiny_artifacts):
    """The translation end to end on CPU: the lowered (slot) graph in onnxruntime, driven through
    `slot_calls` as the executor drives an engine, against the paged graph, on steps that mix
    prefill chunks and decodes over non-contiguous slots."""
    import onnx

    from harness.onnx_reference import OnnxReferenceRunner
    from harness.rtx_check import SlotOnnxRunner
    from trtc.compiler.backends.rtx_lowering import lower_for_rtx

    artifact = tiny_artifacts["tiny-llama"]
    manifest = Artifact.open(artifact).manifest
    lowered = lower_for_rtx(onnx.load(str(artifact / "model.onnx")), manifest, MAX_SEQ_LEN)
    num_slots, bs = 4, manifest.kv_cache.block_size
    slots = SlotOnnxRunner(lowered, num_slots=num_slots)
    reference = OnnxReferenceRunner(artifact, num_blocks=num_slots * MAX_SEQ_LEN // bs)
    tables = {
        slot: list(range(slot * MAX_SEQ_LEN // bs, (slot + 1) * MAX_SEQ_LEN // bs))
        for slot in range(num_slots)
    }

    def run_slots(step):
        logits = np.zeros((len(step.context_lens), manifest.model.vocab_size), np.float32)
        for call in slot_calls(step, num_slots, MAX_SEQ_LEN):
            rows = slice(call.first_slot, call.first_slot + len(call.seqs))
            feeds = call.inputs | {name: buf[rows] for name, buf in slots.cache.items()}
            out = dict(zip(slots.output_names, slots.session.run(None, feeds)))
            for name, buf in slots.cache.items():
                buf[rows] = out[name.replace("_cache.", "_cache_out.")]
            logits[call.seqs] = out["logits"]
        return logits

    rng = np.random.default_rng(0)
    cached = [0] * num_slots
    schedule = [
        [(0, 7), (2, 12)],
        [(2, 1), (0, 1), (3, 5)],
        [(3, 20), (1, 3)],
        [(0, 1), (1, 1), (2, 1), (3, 1)],
        [(1, 1), (3, 1)],
        [(0, 9), (2, 1)],
    ]  # (slot, new tokens), in scheduler order
    for entries in schedule:
        new = {slot: rng.integers(0, 256, n).tolist() for slot, n in entries}
        got = run_slots(paged([(new[slot], cached[slot], slot) for slot, _ in entries]))
        want = reference.step(
            [SequenceWork(new[slot], cached[slot], tables[slot]) for slot, _ in entries]
        )
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4, err_msg=f"step {entries}")
        for slot, n in entries:
            cached[slot] += n
