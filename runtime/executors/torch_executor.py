"""The torch executor: runs an artifact's compiled graph (``model.onnx``) node by node with torch
ops (`torch_ops.py`); plugin nodes call the plugin implementation for the device (the torch
reference on CPU). The KV pool is one tensor ``[layers, 2, num_blocks, block_size, kv_heads,
head_dim]``; layer ``i``'s view is bound to ``kv_cache.{i}`` and updated in place, exactly as the
TensorRT plugin aliases it."""

from __future__ import annotations

import time

import onnx
import torch

from trtc.artifact import MODEL_FILE, WEIGHTS_FILE, Artifact
from trtc.contract import StepInputs, kv_input_name, kv_output_name, kv_pool
from trtc.errors import ArtifactError
from trtc.runtime.engine.startup import StartupPhases
from trtc.runtime.executors.base import Executor
from trtc.runtime.executors.graph import GraphNode, OpTable
from trtc.runtime.executors.torch_ops import ONNX_OPS
from trtc.runtime.executors.weight_loader import load_weights


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def with_device_ids(ids: torch.Tensor, device_ids: torch.Tensor) -> torch.Tensor:
    """The step's input ids with their first ``len(device_ids)`` replaced by ``device_ids``
    (queued in stream order: nothing waits for the step that produces them)."""
    if len(device_ids) == len(ids):
        return device_ids.to(ids.device)
    return torch.cat([device_ids.to(ids.device), ids[len(device_ids) :]])


class TorchExecutor(Executor):
    name = "torch"
    # `execute` takes ``input_ids`` already on the device (an async engine's next step reads
    # the previous step's tokens from there).
    takes_device_input_ids = True

    # The ops this executor runs: the ONNX ops of a trtc graph (an executor that rewrites the
    # graph adds the ops of its rewrites).
    ops: OpTable = ONNX_OPS

    def __init__(
        self,
        artifact: Artifact,
        num_blocks: int,
        device: str = "cpu",
        rank: int = 0,
        startup: StartupPhases | None = None,
    ):
        """``rank``: which tensor-parallel rank's graph to run (its AllReduce nodes sum over
        the group `trtc.plugins.all_reduce.use_group` set); 0 for a one-graph artifact.
        ``startup``: phases a subclass timed before this constructor (the CUDA context)."""
        self.artifact = artifact
        self.manifest = artifact.manifest  # read on every load and by benchmarks
        self.rank = rank
        self.startup = startup if startup is not None else StartupPhases()
        files = [self.manifest.rank_file(name, rank) for name in (MODEL_FILE, WEIGHTS_FILE)]
        self.device = torch.device(device)
        start = time.perf_counter()
        artifact.verify(files[:1])  # the graph; the weights are checked as they are read
        model = onnx.load(str(artifact.file(files[0])), load_external_data=False)
        self._load_graph(model, files[1])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        gb = artifact.file(files[1]).stat().st_size / 1e9
        self.startup.record(
            "weights",
            seconds,
            f"{gb:.2f} GB checked, read and placed on {self.device.type} at "
            f"{gb / max(seconds, 1e-9):.2f} GB/s",
        )
        kv = self.manifest.kv_cache
        self.block_size = kv.block_size
        self.num_blocks = num_blocks
        self.num_layers = kv.num_layers
        self.kv_pool = kv_pool(kv, num_blocks, self.device)

    def _load_graph(self, model: onnx.ModelProto, weights_name: str) -> None:
        unsupported = sorted(
            {
                f"{n.domain}::{n.op_type}" if n.domain else n.op_type
                for n in model.graph.node
                if (n.domain, n.op_type) not in self.ops
            }
        )
        if unsupported:
            raise ArtifactError(
                f"{self.artifact.path}: the torch executor cannot run op(s) "
                f"{', '.join(unsupported)}"
            )
        self.constants = load_weights(self.artifact, model, weights_name, self.device)
        self.graph_outputs = {o.name for o in model.graph.output}
        graph = self.rewrite(
            [
                GraphNode((n.domain, n.op_type), list(n.input), list(n.output), _attrs(n))
                for n in model.graph.node
            ]
        )
        self.nodes = [(self.ops[n.op], n.inputs, n.outputs, n.attrs) for n in graph]
        # Free each intermediate after its last reader: peak memory stays one layer's worth.
        last_use: dict[str, int] = {}
        for i, (_, inputs, _, _) in enumerate(self.nodes):
            for name in inputs:
                if name:  # "": an absent optional input
                    last_use[name] = i
        self.release = [
            [
                n
                for n in inputs
                if last_use.get(n) == i and n not in self.constants and n not in self.graph_outputs
            ]
            for i, (_, inputs, _, _) in enumerate(self.nodes)
        ]

    def rewrite(self, graph: list[GraphNode]) -> list[GraphNode]:
        """The node list this executor runs (here: the graph as compiled)."""
        return graph

    @torch.inference_mode()
    def execute(self, step: StepInputs, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step (the contract's inputs; ``input_ids``, if given, replaces the first of
        the step's: see `Executor.execute`); returns the logits (fp32, on the CPU).
        The KV pool is updated in place."""
        feeds = step.to(self.device).as_dict()
        if input_ids is not None:
            feeds["input_ids"] = with_device_ids(feeds["input_ids"], input_ids)
        return self.forward(feeds).cpu()

    def forward(self, step: dict[str, torch.Tensor]) -> torch.Tensor:
        """The graph on inputs already on the device; logits stay there."""
        env: dict[str, torch.Tensor] = dict(self.constants)
        env.update(step)
        for layer in range(self.num_layers):
            env[kv_input_name(layer)] = self.kv_pool[layer]
        for (fn, inputs, outputs, attrs), release in zip(self.nodes, self.release):
            results = fn([env[n] if n else None for n in inputs], attrs)
            env.update(zip(outputs, results))
            for name in release:
                del env[name]
        for layer in range(self.num_layers):
            if env[kv_output_name(layer)].data_ptr() != self.kv_pool[layer].data_ptr():
                self.kv_pool[layer].copy_(env[kv_output_name(layer)])
        return env["logits"].float()
