"""One step's inputs, from the driver to every worker, over the control group.

The scheduler runs once, in the driver; each worker runs the same step on its rank's graph.
A step travels as two gloo broadcasts: a fixed header (what follows and its sizes) and the
step contract's integer tensors packed into one int64 buffer. Ids already on the driver's
device (async scheduling: the previous step's sampled tokens) go over the device group
instead, so they never visit the host. A header with ``STOP`` ends the workers' loop.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trtc.contract import STEP_INPUTS, StepInputs

STEP, STOP = 1, 0
_HEADER = 6  # kind, num_tokens, num_seqs, max_blocks, num_logits, device input ids (count)
_DTYPES = {"int64": torch.int64, "int32": torch.int32}


def _sizes(num_tokens: int, num_seqs: int, max_blocks: int, num_logits: int) -> dict[str, int]:
    """Elements of each contract input (their order in the packed buffer: STEP_INPUTS')."""
    return {
        "input_ids": num_tokens,
        "positions": num_tokens,
        "slot_mapping": num_tokens,
        "block_tables": num_seqs * max_blocks,
        "context_lens": num_seqs,
        "query_start_loc": num_seqs + 1,
        "logits_indices": num_logits,  # one per sequence, or more (`trtc eval`)
    }


def send_step(step: StepInputs, input_ids: torch.Tensor | None, control, device_group) -> None:
    """Driver side (rank 0): broadcast ``step`` (host tensors) and, if given, ``input_ids`` on
    the device (they replace the first of the step's)."""
    header = torch.tensor(
        [
            STEP,
            step.num_tokens,
            step.num_seqs,
            step.block_tables.shape[1],
            step.logits_indices.shape[0],
            0 if input_ids is None else input_ids.shape[0],
        ],
        dtype=torch.int64,
    )
    dist.broadcast(header, src=0, group=control)
    packed = torch.cat([t.reshape(-1).to(torch.int64) for t in step.as_dict().values()])
    dist.broadcast(packed, src=0, group=control)
    if input_ids is not None:
        dist.broadcast(input_ids, src=0, group=device_group)


def send_stop(control) -> None:
    dist.broadcast(
        torch.tensor([STOP] + [0] * (_HEADER - 1), dtype=torch.int64), src=0, group=control
    )


def receive_step(
    control, device_group, device: torch.device
) -> tuple[StepInputs, torch.Tensor | None] | None:
    """Worker side: the next step and its device input ids (or None), or None at STOP."""
    header = torch.empty(_HEADER, dtype=torch.int64)
    dist.broadcast(header, src=0, group=control)
    kind, num_tokens, num_seqs, max_blocks, num_logits, device_ids = header.tolist()
    if kind == STOP:
        return None
    sizes = _sizes(num_tokens, num_seqs, max_blocks, num_logits)
    packed = torch.empty(sum(sizes.values()), dtype=torch.int64)
    dist.broadcast(packed, src=0, group=control)
    tensors = {}
    for (name, (dtype, _, _)), part in zip(STEP_INPUTS.items(), packed.split(list(sizes.values()))):
        tensors[name] = part.to(_DTYPES[dtype])
    tensors["block_tables"] = tensors["block_tables"].view(num_seqs, max_blocks)
    input_ids = None
    if device_ids:
        input_ids = torch.empty(device_ids, dtype=torch.int64, device=device)
        dist.broadcast(input_ids, src=0, group=device_group)
    return StepInputs(**tensors), input_ids
