"""CUDA graphs for decode steps: one graph per bucketed batch size, replayed with static buffers.

A decode step (one new token per sequence) has the same kernels for every batch of a
given size, so it is captured once per bucket and replayed: the step's inputs are
copied into static buffers, padding rows get slot -1 (nothing stored) and context 0,
and the hidden states of the real rows are read back. Buffers are sized for the
largest bucket and for ``max_model_len`` (a block table row holds
ceil(max_model_len / block_size) blocks, so a sequence of full length fits too).
Mixed and prefill steps run eagerly.
"""

from __future__ import annotations

import torch

from twinplane.dataplane.attention_backends.base import AttentionMetadata
from twinplane.dataplane.models.decoder import DecoderForCausalLM


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (and max_num_seqs itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    """Captured decode forwards, keyed by padded batch size."""

    def __init__(self, model: DecoderForCausalLM, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        max_bs = self.batch_sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, **i32)
        self.context_lens = torch.zeros(max_bs, **i32)
        self.cu_seqlens_q = torch.arange(max_bs + 1, **i32)
        self.block_tables = torch.zeros(max_bs, max_blocks, **i32)
        self.hidden = torch.zeros(max_bs, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens_q[:bs + 1], cu_seqlens_k=self.cu_seqlens_q[:bs + 1],
            context_lens=self.context_lens[:bs], max_seqlen_q=1, max_seqlen_k=self.max_model_len,
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            query_lens_host=[1] * bs, context_lens_host=[1] * bs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first, sharing one memory pool."""
        self.context_lens.fill_(1)  # warm-up rows read block 0; their slot is -1 so nothing is stored
        for bs in reversed(self.batch_sizes):
            metadata = self._metadata(bs)
            args = (self.input_ids[:bs], self.positions[:bs], metadata)
            self.hidden[:bs] = self.model(*args)  # warm-up: compiles kernels, settles allocations
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, self.pool):
                self.hidden[:bs] = self.model(*args)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return (bool(self.graphs) and metadata.max_seqlen_q == 1 and metadata.num_seqs <= self.batch_sizes[-1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Replays the smallest bucket that holds this decode step; returns hidden [n, hidden]."""
        n = input_ids.shape[0]
        bs = next(b for b in self.batch_sizes if b >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = metadata.slot_mapping
        self.slot_mapping[n:bs] = -1
        self.context_lens[:n] = metadata.context_lens
        self.context_lens[n:bs] = 0
        width = metadata.block_tables.shape[1]
        self.block_tables[:n, :width] = metadata.block_tables
        self.graphs[bs].replay()
        return self.hidden[:n]
