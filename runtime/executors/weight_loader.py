"""An artifact's weights onto the executor's device, read once from ``model.onnx.data``.

The graph is parsed without its external data; each weight is then a view of one read-only
mapping of the weights file at the offset the graph records (no protobuf copy, no numpy copy)
and goes to the device in file order. On a GPU, the file is checked against the manifest on
other threads meanwhile (hashlib and the copies release the GIL; a file recorded in 128 MiB
chunks is hashed a chunk a thread, `Artifact.verify`), so checking the artifact costs no time of
its own when the copies take longer than the hash."""

from __future__ import annotations

import mmap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from trtc.artifact import Artifact

# ONNX element types -> torch dtypes, for weights read straight from the file.
_DTYPES = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.FLOAT8E4M3FN: torch.float8_e4m3fn,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.UINT8: torch.uint8,
    onnx.TensorProto.INT16: torch.int16,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.BOOL: torch.bool,
}


def stays_on_host(tensor: torch.Tensor) -> bool:
    """Small int32/int64 constants are shapes, axes and split sizes: ops read them on the host,
    so they stay there (reading them from a GPU would synchronise and break graph capture)."""
    return tensor.dtype in (torch.int64, torch.int32) and tensor.numel() <= 64


def _inline(init: onnx.TensorProto, device: torch.device) -> torch.Tensor:
    if init.data_type in (onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT8E4M3FN):
        # numpy has no such dtypes: move the raw bits, then reinterpret them in torch.
        bits = numpy_helper.to_array(init)
        as_int = bits.view(np.uint16 if init.data_type == onnx.TensorProto.BFLOAT16 else np.uint8)
        return torch.from_numpy(as_int.copy()).view(_DTYPES[init.data_type]).to(device)
    tensor = torch.from_numpy(numpy_helper.to_array(init).copy())
    return tensor if stays_on_host(tensor) else tensor.to(device)


def load_weights(
    artifact: Artifact,
    model: onnx.ModelProto,
    weights_name: str,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The graph's initializers by name, on ``device`` (see the module's docstring). ``model``
    was loaded without external data; the weights file is checked against the manifest."""
    path = artifact.file(weights_name)
    external, tensors = [], {}
    for init in model.graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL:
            tensors[init.name] = _inline(init, device)
            continue
        info = {e.key: e.value for e in init.external_data}
        if Path(info["location"]).name != Path(weights_name).name:
            raise ValueError(
                f"{init.name}: stored in {info['location']}, not {weights_name}: not an artifact "
                "trtc wrote; rebuild it with `trtc build`"
            )
        external.append((int(info.get("offset", 0)), int(info["length"]), init))
    external.sort(key=lambda e: e[0])

    if device.type == "cuda":  # alongside the copies; its error is raised at the end
        checker = ThreadPoolExecutor(1, thread_name_prefix="trtc-verify-weights")
        check = checker.submit(artifact.verify, [weights_name])
        checker.shutdown(wait=False)
    else:  # on the CPU the tensors are clones of the mapping: check it first
        artifact.verify([weights_name])
        check = None
    view = None
    with open(path, "rb") as f:
        # ACCESS_COPY: a writable (copy-on-write) mapping, as torch.frombuffer wants one; the
        # file is never written.
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    for offset, length, init in external:
        dtype = _DTYPES.get(init.data_type)
        if dtype is None:
            raise ValueError(
                f"{init.name}: element type {onnx.TensorProto.DataType.Name(init.data_type)} "
                "is not one trtc writes; rebuild the artifact with this trtc"
            )
        count = length // torch.empty((), dtype=dtype).element_size()
        view = torch.frombuffer(mapped, dtype=dtype, count=count, offset=offset)
        view = view.reshape(tuple(init.dims))
        if stays_on_host(view) or device.type == "cpu":
            tensors[init.name] = view.clone()  # no tensor keeps the mapping alive
        else:
            tensors[init.name] = view.to(device)
    del view  # a copy from pageable memory has read its source when it returns
    mapped.close()
    if check is not None:
        check.result()
    return tensors
