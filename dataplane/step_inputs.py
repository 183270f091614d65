"""Turn a checked StepPlan plus the sequence mirrors into the forward pass's tensors.

Everything is assembled in numpy on the host and copied to the device once per array;
the attention metadata also keeps host lists of query and context lengths so backends
that loop in Python never read device memory back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from twinplane.dataplane.attention_backends.base import AttentionMetadata
from twinplane.dataplane.plan import ScheduledSeq
from twinplane.dataplane.sampling_batch import SamplingBatch, SamplingRow, build_sampling_batch
from twinplane.dataplane.sequence_state import SequenceMirror


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    metadata: AttentionMetadata
    sample_indices: torch.Tensor  # int64 [num_sampled]: rows of the hidden states to sample from
    sampling: SamplingBatch | None  # None when no sequence samples


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _block_tables(mirrors: list[SequenceMirror], context_lens: np.ndarray, block_size: int) -> np.ndarray:
    """int32 [n, max_blocks]: each sequence's blocks covering its context, padded with 0."""
    needed = -(-context_lens // block_size)
    table = np.zeros((len(mirrors), max(int(needed.max(initial=0)), 1)), dtype=np.int32)
    for row, (mirror, count) in enumerate(zip(mirrors, needed)):
        table[row, :count] = mirror.block_table[:count]
    return table


def build_metadata(seqs: list[ScheduledSeq], mirrors: list[SequenceMirror], block_size: int,
                   device: torch.device) -> AttentionMetadata:
    query_lens = np.array([s.num_tokens for s in seqs], dtype=np.int32)
    context_lens = np.array([s.context_len for s in seqs], dtype=np.int32)
    cu_seqlens_q = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    cu_seqlens_k = np.concatenate([[0], np.cumsum(context_lens)]).astype(np.int32)
    slot_mapping = np.concatenate([s.slot_mapping for s in seqs]).astype(np.int32)
    return AttentionMetadata(
        cu_seqlens_q=_to_device(cu_seqlens_q, device),
        cu_seqlens_k=_to_device(cu_seqlens_k, device),
        context_lens=_to_device(context_lens, device),
        max_seqlen_q=int(query_lens.max()),
        max_seqlen_k=int(context_lens.max()),
        slot_mapping=_to_device(slot_mapping, device),
        block_tables=_to_device(_block_tables(mirrors, context_lens, block_size), device),
        query_lens_host=query_lens.tolist(),
        context_lens_host=context_lens.tolist(),
    )


def sampling_rows(seqs: list[ScheduledSeq], mirrors: list[SequenceMirror]) -> list[SamplingRow]:
    """One row per sequence with sample=True, in plan order."""
    rows = []
    for seq, mirror in zip(seqs, mirrors):
        if seq.sample:
            prompt_end = min(mirror.num_prompt_tokens, seq.context_len)
            rows.append(SamplingRow(params=mirror.sampling, output_pos=seq.context_len - mirror.num_prompt_tokens,
                                    prompt_ids=mirror.tokens[:prompt_end],
                                    output_ids=mirror.tokens[prompt_end:seq.context_len]))
    return rows


def build_step_inputs(seqs: list[ScheduledSeq], mirrors: list[SequenceMirror], block_size: int,
                      vocab_size: int, device: torch.device) -> StepInputs:
    """Tensors for a non-empty list of checked sequences and their (already updated) mirrors."""
    assert seqs and len(seqs) == len(mirrors), "build_step_inputs needs one mirror per scheduled sequence"
    input_ids = np.concatenate([s.token_ids for s in seqs]).astype(np.int64)
    positions = np.concatenate([np.arange(s.start_pos, s.context_len, dtype=np.int64) for s in seqs])
    ends = np.cumsum([s.num_tokens for s in seqs]) - 1
    sample_indices = np.array([end for end, s in zip(ends, seqs) if s.sample], dtype=np.int64)
    rows = sampling_rows(seqs, mirrors)
    return StepInputs(
        input_ids=_to_device(input_ids, device),
        positions=_to_device(positions, device),
        metadata=build_metadata(seqs, mirrors, block_size, device),
        sample_indices=_to_device(sample_indices, device),
        sampling=build_sampling_batch(rows, vocab_size, device) if rows else None,
    )
