"""Run a lowered (slot-contract) graph in onnxruntime on CPU: the check that the TensorRT-RTX
lowering computes what the paged graph computes, on a machine without a GPU.

``TRT_KVCacheUpdate`` is TensorRT's op, unknown to onnxruntime: in a copy of the graph it is moved
to a private domain where a Python custom op (onnxruntime-extensions) implements its linear-mode
semantics, ``out[b, :, write_indices[b] + s, :] = update[b, :, s, :]``. onnxruntime runs the
opset-23 ``Attention`` as emitted (4-D GQA inputs, bool mask) and the INT4 block-wise and FP8
``DequantizeLinear`` / ``QuantizeLinear`` of the quantized GEMMs natively, so nothing else is
rewritten.
fp32 graphs only (onnxruntime-extensions registers one type signature per op).

`assert_matches_paged_graph` steps a fixed schedule through a lowered graph and through the paged
graph it came from, and compares their logits."""

from __future__ import annotations

import copy
import tempfile
from functools import cache
from pathlib import Path

import numpy as np
import onnx

from trtc import slot_contract as slot
from trtc.artifact import Artifact, Manifest
from trtc.compiler.backends.rtx_lowering import KV_CACHE_UPDATE
from trtc.contract import SequenceWork

CHECK_DOMAIN = "trtc_rtx_check"
MAX_SEQ_LEN = 64  # the slot caches of the tiny checks (the artifacts' rope tables hold 512)


def for_onnxruntime(lowered: onnx.ModelProto, domain: str) -> onnx.ModelProto:
    """A copy onnxruntime can run: ``TRT_KVCacheUpdate`` moved to ``domain`` (where a Python
    custom op implements it) and TensorRT's ``TRT_decomposable`` hint dropped."""
    m = copy.deepcopy(lowered)
    for n in m.graph.node:
        if n.op_type == KV_CACHE_UPDATE and n.domain == "":
            n.domain = domain
        if n.op_type == "Attention":
            keep = [a for a in n.attribute if a.name != "TRT_decomposable"]
            del n.attribute[:]
            n.attribute.extend(keep)
    if not any(o.domain == domain for o in m.opset_import):
        m.opset_import.append(onnx.helper.make_opsetid(domain, 1))
    return m


def load(artifact: Path) -> tuple[onnx.ModelProto, Manifest]:
    """An artifact's compiled graph and manifest."""
    return onnx.load(str(artifact / "model.onnx")), Artifact.open(artifact).manifest


def kv_cache_update(cache: np.ndarray, update: np.ndarray, write_indices: np.ndarray) -> np.ndarray:
    """The reference of ``TRT_KVCacheUpdate`` (linear mode, padded BHND update), out of place."""
    out = np.array(cache, copy=True)
    new = update.shape[2]
    for b, start in enumerate(np.asarray(write_indices).tolist()):
        if start < 0 or start + new > out.shape[2]:
            raise ValueError(
                f"TRT_KVCacheUpdate: row {b} writes {start}..{start + new - 1}, outside "
                f"the cache's {out.shape[2]} positions"
            )
        out[b, :, start : start + new] = update[b]
    return out


@cache
def _register() -> str:
    from onnxruntime_extensions import PyCustomOpDef as T
    from onnxruntime_extensions import get_library_path, onnx_op

    @onnx_op(
        op_type=f"{CHECK_DOMAIN}::{KV_CACHE_UPDATE}",
        inputs=[T.dt_float, T.dt_float, T.dt_int32],
        outputs=[T.dt_float],
    )
    def _kv_cache_update(cache_in, update, write_indices):
        return kv_cache_update(cache_in, update, write_indices)

    return get_library_path()


class SlotOnnxRunner:
    """Steps a lowered graph with ``num_slots`` slot rows of KV cache kept here (numpy)."""

    def __init__(self, lowered: onnx.ModelProto, num_slots: int):
        import onnxruntime as ort

        self.contract_inputs = [i.name for i in lowered.graph.input]
        with tempfile.TemporaryDirectory(prefix="trtc-rtx-check-") as tmp:
            path = Path(tmp) / "lowered.onnx"
            onnx.save_model(
                for_onnxruntime(lowered, CHECK_DOMAIN),
                str(path),
                save_as_external_data=True,
                all_tensors_to_one_file=True,
                location="lowered.onnx.data",
                size_threshold=1024,
            )
            options = ort.SessionOptions()
            options.register_custom_ops_library(_register())
            options.log_severity_level = 3
            self.session = ort.InferenceSession(
                str(path), options, providers=["CPUExecutionProvider"]
            )
        self.cache = {}
        for i in self.session.get_inputs():
            if i.name.startswith(("k_cache.", "v_cache.")):
                _, kv_heads, max_seq_len, head_dim = i.shape
                if i.type != "tensor(float)":
                    raise ValueError(
                        f"the onnxruntime check runs fp32 graphs; {i.name} is {i.type}"
                    )
                self.cache[i.name] = np.zeros(
                    (num_slots, kv_heads, max_seq_len, head_dim), np.float32
                )
        self.max_seq_len = max_seq_len
        self.output_names = [o.name for o in self.session.get_outputs()]

    def step(self, work: list[slot.SlotWork], num_new_tokens: int | None = None) -> np.ndarray:
        """``work[b]`` runs in slot row ``b`` (rows past ``len(work)`` are not bound)."""
        feeds = slot.make_slot_step(work, self.max_seq_len, num_new_tokens)
        rows = len(work)
        feeds |= {name: buf[:rows] for name, buf in self.cache.items()}
        outputs = dict(zip(self.output_names, self.session.run(None, feeds)))
        for name, buf in self.cache.items():
            buf[:rows] = outputs[name.replace("_cache.", "_cache_out.")]
        return outputs["logits"]


# Steps of three slots: mixed prefill and decode, an idle slot, a chunked prefill, a row padded
# wider than any slot needs, and (for tiny-mistral's window of 24) sequences past the window.
SCHEDULE = [
    ([7, 12, 0], None),
    ([1, 1, 30], None),
    ([1, 5, 1], 9),
    ([1, 0, 1], None),
    ([1, 1, 1], None),
    ([1, 1, 1], None),
]


def assert_matches_paged_graph(lowered: onnx.ModelProto, paged_step, atol: float) -> list[int]:
    """Run SCHEDULE through the lowered graph (onnxruntime, three slots) and through
    ``paged_step`` (the paged graph: ``list[SequenceWork] -> logits``), asserting equal logits at
    every busy slot; returns the slots' cached lengths at the end."""
    runner = SlotOnnxRunner(lowered, num_slots=3)
    tables = [list(range(b * 4, b * 4 + 4)) for b in range(3)]
    rng = np.random.default_rng(0)
    cached = [0, 0, 0]
    for lengths, width in SCHEDULE:
        new = [rng.integers(0, 256, n).tolist() for n in lengths]
        logits = runner.step(
            [slot.SlotWork(t, c) for t, c in zip(new, cached)], num_new_tokens=width
        )
        busy = [b for b, t in enumerate(new) if t]
        want = paged_step([SequenceWork(new[b], cached[b], tables[b]) for b in busy])
        assert np.isfinite(logits).all(), "a padding or idle row produced NaN/inf"
        np.testing.assert_allclose(logits[busy], want, rtol=0, atol=atol, err_msg=f"step {lengths}")
        cached = [c + len(t) for c, t in zip(cached, new)]
    return cached
