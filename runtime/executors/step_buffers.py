"""The static inputs of captured step graphs: a step's tensors packed into pinned host buffers
and their device twins, which a CUDA graph reads. Loading a step fills the host buffers through
numpy views and queues two asynchronous copies; each layout pads the step to its graph's shape
so that the padding writes no KV and its logits rows are never read.

- `DecodeInputs`: ``batch`` sequences of one token (decode graphs).
- `MultiTokenInputs`: ``batch`` sequences of ``tokens`` each (verifying drafts).
- `MixedStepInputs`: ``tokens`` tokens over ``seqs`` sequences (prefill and mixed steps)."""

from __future__ import annotations

import numpy as np
import torch

from trtc.contract import StepInputs


class StepBuffers:
    """A captured graph's step inputs packed into two device buffers (int64 and int32) with host
    twins, pinned on a GPU: loading a step costs two asynchronous host-to-device copies (not one
    copy per tensor plus kernels that fill the padding). Subclasses fill the host twins through
    numpy views (torch ops would each dispatch, and this is on a step's critical path) between
    `_host` and `_send`."""

    def __init__(self, host64: torch.Tensor, host32: torch.Tensor, device: torch.device):
        pinned = device.type == "cuda"
        self.host64 = host64.pin_memory() if pinned else host64
        self.host32 = host32.pin_memory() if pinned else host32
        self.dev64, self.dev32 = self.host64.to(device), self.host32.to(device)
        self.host64_np, self.host32_np = self.host64.numpy(), self.host32.numpy()
        self.copied = torch.cuda.Event() if pinned else None

    def _host(self) -> tuple[np.ndarray, np.ndarray]:
        """The host twins, once the previous step's copies have read them."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host64_np, self.host32_np

    def _send(self, width32: int | None = None) -> None:
        """Queue the copies to the device (of the int32 buffer, its first ``width32``)."""
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32[:width32].copy_(self.host32[:width32], non_blocking=True)
        if self.copied is not None:
            self.copied.record()


class StaticStepInputs(StepBuffers):
    """The static inputs of a captured step of ``batch`` sequences x ``tokens`` tokens each.
    Padding writes no KV (slot -1) and sees ``tokens`` positions of its own."""

    def __init__(self, batch: int, tokens: int, max_blocks: int, device: torch.device):
        self.batch, self.tokens, self.max_blocks = batch, tokens, max_blocks
        width = batch * tokens
        host64 = torch.zeros(3, width, dtype=torch.int64)  # ids, positions, slots
        host32 = torch.zeros(batch * (1 + max_blocks), dtype=torch.int32)  # lengths, tables
        host64[2] = -1
        host32[:batch] = tokens
        super().__init__(host64, host32, device)
        self.tensors = {
            "input_ids": self.dev64[0],
            "positions": self.dev64[1],
            "slot_mapping": self.dev64[2],
            "block_tables": self.dev32[batch:].view(batch, max_blocks),
            "context_lens": self.dev32[:batch],
            "query_start_loc": torch.arange(0, width + 1, tokens, dtype=torch.int32, device=device),
            "logits_indices": torch.arange(width, dtype=torch.int64, device=device),
        }


class MultiTokenInputs(StaticStepInputs):
    """A step's sequences laid out ``tokens`` apart, each padded after its own tokens: the
    padding sits after the real tokens, so their causal view is unchanged (context lengths grow
    by the padding). ``load`` returns the rows of the logits the step asked for."""

    def __init__(self, batch: int, tokens: int, max_blocks: int, device: torch.device):
        super().__init__(batch, tokens, max_blocks, device)
        self.host_rows = torch.zeros(batch * tokens, dtype=torch.int64)
        if device.type == "cuda":
            self.host_rows = self.host_rows.pin_memory()
        self.dev_rows = self.host_rows.to(device)

    def load(self, step: StepInputs) -> torch.Tensor:
        q = self.tokens
        starts = step.query_start_loc.numpy().astype(np.int64)
        counts = np.diff(starts)
        n, width = step.block_tables.shape
        seq_of = np.repeat(np.arange(n), counts)
        # Where each of the step's tokens goes: its sequence's slot of q, at its own offset.
        at = seq_of * q + (np.arange(step.num_tokens) - starts[seq_of])
        h64, h32 = self._host()
        last_position = step.positions.numpy()[starts[1:] - 1]
        h64[0], h64[2] = 0, -1
        h64[1] = np.repeat(np.append(last_position, np.zeros(self.batch - n, np.int64)), q)
        h64[0, at], h64[1, at] = step.input_ids.numpy(), step.positions.numpy()
        h64[2, at] = step.slot_mapping.numpy()
        h32[:n] = step.context_lens.numpy() - counts + q
        h32[n : self.batch] = q
        h32[self.batch :].reshape(self.batch, self.max_blocks)[:n, :width] = (
            step.block_tables.numpy()
        )
        rows = at[step.logits_indices.numpy()]
        self.host_rows.numpy()[: len(rows)] = rows
        self.dev_rows.copy_(self.host_rows, non_blocking=True)
        self._send()
        return self.dev_rows[: len(rows)]


class DecodeInputs(StaticStepInputs):
    """One captured decode graph's inputs: ``batch`` rows of one token. Rows past the step's
    sequences are padding; their logits are never read. ``load`` returns the step's rows (its
    sequences)."""

    def __init__(self, batch: int, max_blocks: int, device: torch.device):
        super().__init__(batch, 1, max_blocks, device)

    def load(self, step: StepInputs) -> int:
        n, width = step.block_tables.shape
        h64, h32 = self._host()
        h64[0, :n], h64[1, :n] = step.input_ids.numpy(), step.positions.numpy()
        h64[2, :n] = step.slot_mapping.numpy()
        h64[:2, n:], h64[2, n:] = 0, -1
        h32[:n], h32[n : self.batch] = step.context_lens.numpy(), 1
        h32[self.batch :].reshape(self.batch, self.max_blocks)[:n, :width] = (
            step.block_tables.numpy()
        )
        self._send()
        return n


class MixedStepInputs(StepBuffers):
    """The static inputs of a captured prefill / mixed step of ``tokens`` tokens over ``seqs``
    sequences, with ``seqs`` logits rows. A step of ``n`` sequences and ``t`` tokens fills the
    first ``n`` sequences and ``t`` tokens; sequence ``n`` is padding that takes the remaining
    tokens (slot -1: it writes no KV; it attends to its own positions through block 0, whatever
    that holds: its rows are never read), and the sequences after it have no tokens (their
    attention tiles return at once). ``tokens`` exceeds ``seqs``, so the attention launch is a
    prefill one (`plan`), as the steps' own launches are."""

    def __init__(
        self, tokens: int, seqs: int, max_blocks: int, block_size: int, device: torch.device
    ):
        if tokens <= seqs:
            raise ValueError(f"a mixed-step graph needs more tokens ({tokens}) than seqs ({seqs})")
        if tokens > max_blocks * block_size:  # the padding sequence's block table holds them
            raise ValueError(f"{tokens} tokens exceed a block table ({max_blocks} blocks)")
        self.num_tokens, self.num_seqs = tokens, seqs
        self.max_blocks, self.block_size = max_blocks, block_size
        # int64: ids, positions, slots (tokens each), logits rows (seqs); int32: context lengths
        # (seqs), query starts (seqs + 1), block tables (seqs x max_blocks).
        super().__init__(
            torch.zeros(3 * tokens + seqs, dtype=torch.int64),
            torch.zeros(2 * seqs + 1 + seqs * max_blocks, dtype=torch.int32),
            device,
        )
        t, s = tokens, seqs
        self.tensors = {
            "input_ids": self.dev64[:t],
            "positions": self.dev64[t : 2 * t],
            "slot_mapping": self.dev64[2 * t : 3 * t],
            "logits_indices": self.dev64[3 * t :],
            "context_lens": self.dev32[:s],
            "query_start_loc": self.dev32[s : 2 * s + 1],
            "block_tables": self.dev32[2 * s + 1 :].view(s, max_blocks),
        }
        self.load(None)  # a valid empty step for the capture: all padding

    def fits(self, step: StepInputs) -> bool:
        return (
            step.num_tokens <= self.num_tokens
            and step.num_seqs < self.num_seqs
            and step.logits_indices.shape[0] <= self.num_seqs
            and step.block_tables.shape[1] <= self.max_blocks
        )

    def load(self, step: StepInputs | None) -> int:
        """Copy ``step`` in (None: no sequence, all padding); returns its logits rows."""
        t, s = self.num_tokens, self.num_seqs
        h64, h32 = self._host()
        ids, pos, slots, rows = h64[:t], h64[t : 2 * t], h64[2 * t : 3 * t], h64[3 * t :]
        lens, starts = h32[:s], h32[s : 2 * s + 1]
        tables = h32[2 * s + 1 :].reshape(s, self.max_blocks)
        n = step.num_seqs if step is not None else 0
        used = step.num_tokens if step is not None else 0
        logits = step.logits_indices.shape[0] if step is not None else 0
        if step is not None:
            ids[:used], pos[:used] = step.input_ids.numpy(), step.positions.numpy()
            slots[:used] = step.slot_mapping.numpy()
            rows[:logits] = step.logits_indices.numpy()
            lens[:n], starts[: n + 1] = step.context_lens.numpy(), step.query_start_loc.numpy()
            tables[:n, : step.block_tables.shape[1]] = step.block_tables.numpy()
        pad = t - used
        ids[used:], pos[used:], slots[used:], rows[logits:] = 0, np.arange(pad), -1, 0
        lens[n], lens[n + 1 :] = pad, 0
        starts[n + 1 :] = t
        # The padding sequence reads its blocks (block 0); the rows after it are never read
        # (no tokens), so only the tables up to its row are copied.
        tables[n, : -(-pad // self.block_size)] = 0
        self._send(width32=2 * s + 1 + (n + 1) * self.max_blocks)
        return logits
