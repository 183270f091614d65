"""Which captured CUDA graph a step replays (pure shape logic; runs without a GPU)."""

from __future__ import annotations

import torch

from twinplane.dataplane.attention_backends.base import AttentionMetadata
from twinplane.dataplane.cuda_graphs import StepGraphs, graph_batch_sizes, mixed_shapes


def _metadata(query_lens: list[int]) -> AttentionMetadata:
    empty = torch.empty(0, dtype=torch.int32)
    return AttentionMetadata(cu_seqlens_q=empty, cu_seqlens_k=empty, context_lens=empty,
                             max_seqlen_q=max(query_lens), max_seqlen_k=4096, slot_mapping=empty,
                             block_tables=empty, query_lens_host=query_lens, context_lens_host=query_lens)


def test_mixed_shapes_hold_more_tokens_than_sequences_and_fit_the_limits():
    shapes = mixed_shapes(256, 8192, 4096)
    assert shapes[0] == (16, 256) and shapes[-1] == (256, 8192)
    assert all(s < t for s, t in shapes)  # a step with prefill has more tokens than sequences
    assert [t for _, t in shapes] == sorted(t for _, t in shapes)
    assert mixed_shapes(256, 1024, 4096)[-1][1] == 1024  # never past max_num_batched_tokens
    assert [t for s, t in mixed_shapes(16, 3000, 4096)] == [256, 384, 512, 768, 1024, 1536, 2048, 3000]  # ... up to it
    tokens = sorted({t for _, t in shapes})
    assert all(b <= 1.5 * a for a, b in zip(tokens, tokens[1:]))  # padding: a third of a graph at most
    assert mixed_shapes(4, 8192, 64) == [(4, 256)]  # 4 sequences of 64 tokens hold at most 256
    assert graph_batch_sizes(256)[:5] == [1, 2, 4, 8, 16] and graph_batch_sizes(256)[-1] == 256


def test_a_step_replays_the_smallest_graph_that_holds_it():
    graphs = StepGraphs(model=None, hidden_size=8, dtype=torch.float32, device=torch.device("cpu"),
                        max_num_seqs=256, max_model_len=4096, block_size=16, max_num_batched_tokens=8192,
                        mixed=True)
    assert graphs.shape_for(_metadata([1] * 5), 5) is None  # nothing captured yet: eager
    graphs.graphs = {shape: None for shape in [(b, b) for b in graphs.batch_sizes] + graphs.mixed_shapes}
    assert graphs.shape_for(_metadata([1] * 5), 5) == (8, 8)  # decode: batch bucket
    assert graphs.shape_for(_metadata([1] * 256), 256) == (256, 256)
    assert graphs.shape_for(_metadata([1] * 3 + [100]), 103) == (16, 256)  # a prompt chunk beside decodes
    assert graphs.shape_for(_metadata([1] * 40 + [300]), 340) == (64, 384)
    assert graphs.shape_for(_metadata([1] * 45 + [560]), 605) == (64, 768)
    assert graphs.shape_for(_metadata([1] * 200 + [1500]), 1700) == (256, 2048)
    assert graphs.shape_for(_metadata([3000]), 3000) == (16, 3072)  # a prompt alone
    assert graphs.shape_for(_metadata([3100]), 3100) == (16, 4096)
    assert graphs.shape_for(_metadata([4096, 4096]), 8192) == (16, 8192)  # a full step of prompts
    assert graphs.input_ids.shape[0] == 8192  # buffers hold the largest mixed shape
    decode_only = StepGraphs(model=None, hidden_size=8, dtype=torch.float32, device=torch.device("cpu"),
                             max_num_seqs=256, max_model_len=4096, block_size=16, max_num_batched_tokens=8192,
                             mixed=False)
    decode_only.graphs = {(b, b): None for b in decode_only.batch_sizes}
    assert decode_only.shape_for(_metadata([1] * 3 + [100]), 103) is None
    assert decode_only.input_ids.shape[0] == 256
