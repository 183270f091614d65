"""CUDA graphs for decode and mixed steps: captured once per padded shape, replayed with static buffers.

A step's forward pass launches the same kernels for every batch of a given shape, so it
is captured once per shape and replayed: the step's inputs are copied into static
buffers and the hidden states of the real rows are read back.

- Decode steps (one new token per sequence) are captured per bucketed batch size.
- Steps with prompt tokens (prompt chunks, alone or next to decodes) are captured per
  (sequence bucket, token bucket), when the attention backend allows it
  (``graphs_mixed_steps``: its launch may depend on the number of query tokens and of
  sequences, never on their lengths, which it reads from device memory). The token buckets
  reach ``max_num_batched_tokens``, so no step runs eagerly then. Eagerly, every such step
  would pay the host cost of launching ~400 kernels (~20-28 ms for Qwen3-0.6B, more than
  the GPU needs for 8,192 prompt tokens), and each running stream would see that gap
  whenever a new request is admitted.

Padding tokens get slot -1 (nothing stored) and belong to no sequence; padding sequences
have no query tokens and context 0. Buffers are sized for the largest shape and for
``max_model_len`` (a block table row holds ceil(max_model_len / block_size) blocks, so a
sequence of full length fits too).
"""

from __future__ import annotations

import torch

from twinplane.dataplane.attention_backends.base import AttentionMetadata
from twinplane.dataplane.models.decoder import DecoderForCausalLM
from twinplane.dataplane.plan import StepPath

MIXED_SEQ_BUCKETS = (16, 32, 64, 128, 256)
# Each bucket at most 1.5x the one before, so padding is at most a third of a replayed graph's tokens
# (a prompt of 560 tokens beside 45 decodes replays the 768-token graph, not the 1,024 one).
MIXED_TOKEN_BUCKETS = (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)  # and max_num_batched_tokens


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (and max_num_seqs itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


def bucket(sizes: list[int], n: int) -> int | None:
    """The smallest of ``sizes`` (ascending) that holds ``n``, or None."""
    return next((size for size in sizes if size >= n), None)


def mixed_shapes(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> list[tuple[int, int]]:
    """(sequences, tokens) buckets of mixed steps that a plan can fill, smallest token count first."""
    seqs = sorted({min(s, max_num_seqs) for s in MIXED_SEQ_BUCKETS})
    tokens = [t for t in MIXED_TOKEN_BUCKETS if t < max_num_batched_tokens] + [max_num_batched_tokens]
    return [(s, t) for t in tokens for s in seqs if s < t <= s * max_model_len]


class StepGraphs:
    """Captured forwards, keyed by (padded sequences, padded tokens)."""

    def __init__(self, model: DecoderForCausalLM, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 max_num_seqs: int, max_model_len: int, block_size: int, max_num_batched_tokens: int,
                 mixed: bool) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.mixed_shapes = mixed_shapes(max_num_seqs, max_num_batched_tokens, max_model_len) if mixed else []
        max_seqs = self.batch_sizes[-1]
        max_tokens = max([max_seqs] + [t for _, t in self.mixed_shapes])
        max_blocks = -(-max_model_len // block_size)
        i32 = dict(dtype=torch.int32, device=device)
        # int32 like InputBatch's step inputs: the compiled kernels must see one dtype.
        self.input_ids = torch.zeros(max_tokens, **i32)
        self.positions = torch.zeros(max_tokens, **i32)
        self.slot_mapping = torch.full((max_tokens,), -1, **i32)
        self.cu_seqlens_q = torch.arange(max_seqs + 1, **i32)
        self.context_lens = torch.zeros(max_seqs, **i32)
        self.block_tables = torch.zeros(max_seqs, max_blocks, **i32)
        self.rows = torch.arange(max_seqs, **i32)
        self.decode_order = torch.arange(max_seqs, **i32)  # padding rows (context 0) stay last
        self.hidden = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _metadata(self, seqs: int, tokens: int, lens: list[int]) -> AttentionMetadata:
        """Capture-time metadata over the static buffers; ``lens``: each sequence's query (= context) length."""
        return AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens_q[:seqs + 1], cu_seqlens_k=self.cu_seqlens_q[:seqs + 1],
            context_lens=self.context_lens[:seqs], max_seqlen_q=1 if seqs == tokens else tokens,
            max_seqlen_k=self.max_model_len, slot_mapping=self.slot_mapping[:tokens],
            block_tables=self.block_tables[:seqs], query_lens_host=lens, context_lens_host=lens,
            decode_order=self.decode_order[:seqs] if seqs == tokens else None)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every shape, most tokens first, sharing one memory pool."""
        shapes = [(bs, bs) for bs in self.batch_sizes] + self.mixed_shapes
        for seqs, tokens in sorted(shapes, key=lambda shape: (-shape[1], -shape[0])):
            # Warm-up lengths: the tokens spread over the sequences, each seeing only its own
            # queries in block 0; slots are -1, so nothing is stored.
            cu = [i * tokens // seqs for i in range(seqs + 1)]
            lens = [end - start for start, end in zip(cu, cu[1:])]
            self.cu_seqlens_q[:seqs + 1] = torch.tensor(cu)
            self.context_lens[:seqs] = torch.tensor(lens)
            metadata = self._metadata(seqs, tokens, lens)
            args = (self.input_ids[:tokens], self.positions[:tokens], metadata)
            self.hidden[:tokens] = self.model(*args)  # warm-up: compiles kernels, settles allocations
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, self.pool):
                self.hidden[:tokens] = self.model(*args)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[(seqs, tokens)] = graph
        torch.cuda.synchronize()

    def shape_for(self, metadata: AttentionMetadata, num_tokens: int) -> tuple[int, int] | None:
        """The smallest captured shape that holds this step, or None (run it eagerly)."""
        num_seqs = metadata.num_seqs
        if not self.graphs:
            return None
        if metadata.max_seqlen_q == 1:
            bs = bucket(self.batch_sizes, num_seqs)
            return None if bs is None else (bs, bs)
        return next(((s, t) for s, t in self.mixed_shapes if s >= num_seqs and t >= num_tokens), None)

    @staticmethod
    def path_of(shape: tuple[int, int]) -> StepPath:
        seqs, tokens = shape
        return StepPath.DECODE_GRAPH if seqs == tokens else StepPath.MIXED_GRAPH

    def run(self, shape: tuple[int, int], input_ids: torch.Tensor, positions: torch.Tensor,
            metadata: AttentionMetadata) -> torch.Tensor:
        """Replays the graph of ``shape`` (from ``shape_for``); returns hidden [num_tokens, hidden]."""
        seqs, tokens = shape
        n, s = input_ids.shape[0], metadata.num_seqs
        width = metadata.block_tables.shape[1]
        # the step's inputs into the graph's, in one call (each call costs more host time than its copy)
        targets = [self.input_ids[:n], self.positions[:n], self.slot_mapping[:n], self.cu_seqlens_q[:s + 1],
                   self.context_lens[:s], self.block_tables[:s, :width]]
        sources = [input_ids, positions, metadata.slot_mapping, metadata.cu_seqlens_q, metadata.context_lens,
                   metadata.block_tables]
        if seqs == tokens:  # padding rows (and steps without an order) launch in row order
            order = metadata.decode_order
            targets.append(self.decode_order[:seqs] if order is None else self.decode_order[:s])
            sources.append(self.rows[:seqs] if order is None else order)
            if order is not None and s < seqs:
                targets.append(self.decode_order[s:seqs])
                sources.append(self.rows[s:seqs])
        torch._foreach_copy_(targets, sources)
        if n < tokens:  # padding: stores nothing, attends to nothing
            self.slot_mapping[n:tokens] = -1
        if s < seqs:
            self.cu_seqlens_q[s + 1:seqs + 1] = n
            self.context_lens[s:seqs] = 0
        self.graphs[shape].replay()
        return self.hidden[:n]
