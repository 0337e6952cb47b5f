"""The CUDA executor: the torch executor on a GPU, with the KV pool preallocated from a memory
fraction and decode steps captured as CUDA graphs for a set of batch sizes (a decode step of a
small model is mostly host overhead otherwise). Prefill and mixed steps run eagerly.

A decode step of ``n`` sequences replays the graph of the smallest captured size ``>= n``; the
extra rows are padding (slot -1, so nothing is written; one visible cached position, so nothing
divides by zero) and their logits are dropped."""
from __future__ import annotations

from pathlib import Path

import torch

from trtc.compiler.artifact import read_manifest
from trtc.runtime.torch_executor import TorchExecutor

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def blocks_for_memory(manifest: dict, memory_fraction: float, device: torch.device,
                      weight_bytes: int) -> int:
    """KV blocks that fit in ``memory_fraction`` of the GPU, after the weights and a margin for
    activations."""
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * memory_fraction) - (total - free) - weight_bytes - (1 << 30)
    blocks = budget // manifest["kv_cache"]["bytes_per_block"]
    if blocks < 1:
        raise RuntimeError(f"no GPU memory left for the KV cache ({budget / 2**30:.1f} GiB after the weights)")
    return int(blocks)


class CudaExecutor(TorchExecutor):
    name = "cuda"

    def __init__(self, artifact_dir: str | Path, num_blocks: int | None = None, device: str = "cuda",
                 memory_fraction: float = 0.9, max_graph_batch: int | None = None, use_cuda_graphs: bool = True):
        manifest = read_manifest(artifact_dir)
        if num_blocks is None:
            weight_bytes = manifest["graph"]["weight_bytes"]["total"]
            num_blocks = blocks_for_memory(manifest, memory_fraction, torch.device(device), weight_bytes)
        super().__init__(artifact_dir, num_blocks, device)
        limits = manifest["limits"]
        self.max_blocks_per_seq = -(-limits["max_seq_len"] // self.block_size)
        top = min(max_graph_batch or limits["max_num_seqs"], limits["max_num_seqs"])
        self.graph_sizes = [b for b in GRAPH_BATCH_SIZES if b <= top] or [1]
        if self.graph_sizes[-1] < top:
            self.graph_sizes.append(top)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict, torch.Tensor]] = {}
        if use_cuda_graphs:
            self._capture_all()

    def _static_inputs(self, batch: int) -> dict[str, torch.Tensor]:
        dev = self.device
        return {"input_ids": torch.zeros(batch, dtype=torch.int64, device=dev),
                "positions": torch.zeros(batch, dtype=torch.int64, device=dev),
                "slot_mapping": torch.full((batch,), -1, dtype=torch.int64, device=dev),
                "block_tables": torch.zeros(batch, self.max_blocks_per_seq, dtype=torch.int32, device=dev),
                "context_lens": torch.ones(batch, dtype=torch.int32, device=dev),
                "query_start_loc": torch.arange(batch + 1, dtype=torch.int32, device=dev),
                "logits_indices": torch.arange(batch, dtype=torch.int64, device=dev)}

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for batch in sorted(self.graph_sizes, reverse=True):    # largest first: smaller ones reuse its memory
            inputs = self._static_inputs(batch)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):                              # compile kernels, settle the allocator
                    self.forward(inputs)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.forward(inputs)
            pool = graph.pool()
            self.graphs[batch] = (graph, inputs, logits)
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def execute(self, step: dict[str, torch.Tensor]) -> torch.Tensor:
        num_tokens, num_seqs = step["input_ids"].shape[0], step["context_lens"].shape[0]
        size = next((b for b in sorted(self.graphs) if b >= num_seqs), None)
        if num_tokens != num_seqs or size is None:                # prefill or mixed: eager
            return self.forward({k: v.to(self.device, non_blocking=True) for k, v in step.items()})
        graph, inputs, logits = self.graphs[size]
        n = num_seqs
        for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
            inputs[name][:n].copy_(step[name], non_blocking=True)
        tables = step["block_tables"]
        inputs["block_tables"][:n, :tables.shape[1]].copy_(tables, non_blocking=True)
        # Padding rows: no KV write, one visible position, their own query token.
        inputs["slot_mapping"][n:].fill_(-1)
        inputs["context_lens"][n:].fill_(1)
        inputs["input_ids"][n:].zero_()
        inputs["positions"][n:].zero_()
        graph.replay()
        return logits[:n]              # stays on the GPU: the sampler copies back token ids only
