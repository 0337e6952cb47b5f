"""Run an artifact's compiled graph (``model.onnx``) step by step in onnxruntime on CPU, the
plugin nodes executed by their torch references. This is the check that the *compiled graph*
computes the model: the golden tests drive it against transformers.

The KV pool lives here as one numpy array per layer (``kv_cache.{i}``), fed in and read back
each step, since onnxruntime cannot alias the plugin's in-place output."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trtc.artifact import MODEL_FILE, WEIGHTS_FILE, Artifact
from trtc.contract import SequenceWork, kv_input_name, make_step
from trtc.errors import ArtifactError

NUMPY_KV = {"fp32": np.float32}


class OnnxReferenceRunner:
    def __init__(self, artifact_dir: str | Path, num_blocks: int, rank: int = 0):
        """``rank``: the tensor-parallel rank whose graph runs (its AllReduce nodes sum over
        the group `trtc.plugins.all_reduce.use_group` set in this process)."""
        from harness.onnxruntime_ops import session

        artifact = Artifact.open(artifact_dir)
        files = [artifact.manifest.rank_file(f, rank) for f in (MODEL_FILE, WEIGHTS_FILE)]
        artifact.verify(files)
        self.manifest = artifact.manifest
        kv = self.manifest.kv_cache
        if kv.dtype not in NUMPY_KV or self.manifest.precision != "fp32":
            raise ArtifactError(
                f"the onnxruntime reference runs fp32 artifacts; this one is "
                f"{self.manifest.precision} with a {kv.dtype} KV cache"
            )
        self.block_size = kv.block_size
        self.session = session(str(artifact.file(files[0])))
        shape = (2, num_blocks, self.block_size, kv.num_kv_heads, kv.head_dim)
        self.kv = {
            kv_input_name(i): np.zeros(shape, NUMPY_KV[kv.dtype]) for i in range(kv.num_layers)
        }
        self.output_names = [o.name for o in self.session.get_outputs()]

    def step(self, work: list[SequenceWork]) -> np.ndarray:
        """Run one step; returns ``logits[len(work), vocab]`` and keeps the updated KV pool."""
        feeds = {k: v.numpy() for k, v in make_step(work, self.block_size).as_dict().items()}
        outputs = dict(zip(self.output_names, self.session.run(None, feeds | self.kv)))
        for name in self.kv:
            self.kv[name] = outputs[name.replace("kv_cache.", "kv_cache_out.")]
        return outputs["logits"]
