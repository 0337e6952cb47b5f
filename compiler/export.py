"""Export: the step model to ONNX (torch dynamo exporter), with the symbolic dimensions and
tensor names of the step contract.

The model is traced on fake tensors (`model.step_skeleton`): the graph holds each weight as a
placeholder initializer (external data at `weights.PENDING`, never read) that
`weights.bind` later gives its recipe. Exporting costs the graph's memory, not the model's."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings

import onnx
import torch
from torch.export import Dim

from trtc import contract
from trtc.compiler.model import StepModel
from trtc.compiler.passes.swiglu import OPSET
from trtc.compiler.weight_recipes import PENDING
from trtc.contract import SequenceWork, StepInputs, make_step

ONNX_DTYPES = {
    "fp32": onnx.TensorProto.FLOAT,
    "fp16": onnx.TensorProto.FLOAT16,
    "bf16": onnx.TensorProto.BFLOAT16,
    "fp8": onnx.TensorProto.FLOAT8E4M3FN,
    "int64": onnx.TensorProto.INT64,
    "int32": onnx.TensorProto.INT32,
}


def example_step(block_size: int) -> tuple[StepInputs, int]:
    """Three sequences (a prefill chunk after cached context verifying two drafts, a fresh
    prefill, a decode token), sizes chosen so no dimension is 0 or 1 (torch.export would
    specialise on those) and the logits rows (5) differ from the sequences (3).
    Returns the step and the number of KV blocks it uses."""
    shapes = [([5, 6, 7], block_size + 1, 3), ([8, 9], 0, 1), ([10], block_size * 2, 1)]
    work, next_block = [], 0
    for tokens, cached, logits in shapes:
        n = max(2, -(-(cached + len(tokens)) // block_size))
        blocks = list(range(next_block, next_block + n))
        work.append(SequenceWork(tokens, cached, blocks, logits))
        next_block += n
    return make_step(work, block_size), next_block


def _dynamic_shapes(num_layers: int):
    tokens = Dim(contract.NUM_TOKENS, min=2, max=1 << 20)
    seqs = Dim(contract.NUM_SEQS, min=2, max=1 << 16)
    logits = Dim(contract.NUM_LOGITS, min=2, max=1 << 20)
    blocks_per_seq = Dim(contract.MAX_BLOCKS, min=2, max=1 << 20)
    blocks = Dim(contract.NUM_BLOCKS, min=2, max=1 << 30)
    per_input = {
        "input_ids": {0: tokens},
        "positions": {0: tokens},
        "slot_mapping": {0: tokens},
        "block_tables": {0: seqs, 1: blocks_per_seq},
        "context_lens": {0: seqs},
        "query_start_loc": {0: seqs + 1},
        "logits_indices": {0: logits},
    }
    return tuple(per_input[n] for n in contract.STEP_INPUTS) + (({1: blocks},) * num_layers,)


def _apply_contract_shapes(model: onnx.ModelProto, specs_in, specs_out) -> None:
    """Name every dimension as the contract does (the exporter writes e.g. 'num_seqs + 1')."""
    for value, spec in list(zip(model.graph.input, specs_in)) + list(
        zip(model.graph.output, specs_out)
    ):
        if value.name != spec.name:
            raise RuntimeError(f"exported I/O {value.name!r} where the contract has {spec.name!r}")
        value.type.tensor_type.elem_type = ONNX_DTYPES[spec.dtype]
        dims = value.type.tensor_type.shape.dim
        del dims[:]
        for d in spec.shape:
            dim = dims.add()
            if isinstance(d, int):
                dim.dim_value = d
            else:
                dim.dim_param = d


def export_onnx(model: StepModel, kv_dtype: str, block_size: int) -> onnx.ModelProto:
    g = model.geometry
    step, num_blocks = example_step(block_size)
    kv = torch.zeros(
        (2, num_blocks + 1, block_size, g.num_kv_heads, g.head_dim),
        dtype=contract.TORCH_DTYPES[kv_dtype],
    )
    caches = tuple(kv.clone() for _ in range(g.num_layers))
    specs_in, specs_out = contract.step_io(
        g.num_layers, g.num_kv_heads, g.head_dim, block_size, kv_dtype, g.vocab_size
    )
    # The exporter is chatty (progress lines, torchvision notices); keep them out of the user's way.
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        program = torch.onnx.export(
            model,
            tuple(step.as_dict().values()) + caches,
            dynamo=True,
            opset_version=OPSET,
            dynamic_shapes=_dynamic_shapes(g.num_layers),
            optimize=False,
            verbose=False,
            input_names=[s.name for s in specs_in],
            output_names=[s.name for s in specs_out],
        )
    _fake_weights_to_placeholders(program.model)
    proto = program.model_proto
    _apply_contract_shapes(proto, specs_in, specs_out)
    return proto


def _fake_weights_to_placeholders(model) -> None:
    """Replace each initializer traced from a fake tensor by an external-data reference to
    `PENDING` (serialising a fake tensor's data is impossible, and not wanted)."""
    import onnx_ir as ir
    from torch._subclasses.fake_tensor import FakeTensor

    for name, value in model.graph.initializers.items():
        tensor = value.const_value
        if isinstance(getattr(tensor, "raw", None), FakeTensor):
            value.const_value = ir.ExternalTensor(
                PENDING,
                0,
                tensor.nbytes,
                tensor.dtype,
                shape=tensor.shape,
                name=name,
            )
