"""Sizing and allocating the paged KV cache.

One tensor [2, num_layers, num_blocks, block_size, kv_heads, head_dim] holds every layer's
K and V, in the model's dtype or in float8_e4m3fn (``--kv-cache-dtype fp8``: half the bytes of
16 bits, so twice the blocks); each attention module gets views ``kv[0, i]`` and ``kv[1, i]``.
On CPU the number of blocks follows ``cpu_kv_cache_gib``; on CUDA it is measured: a warm-up forward of
``max_num_batched_tokens`` tokens (against a one-block scratch cache, slots -1) gives the
activation peak, and what is left of ``gpu_memory_utilization`` becomes KV blocks.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from twinplane.dataplane.attention_backends.base import AttentionMetadata
from twinplane.dataplane.layers.attention import Attention
from twinplane.dataplane.models.decoder import DecoderForCausalLM


def resolve_kv_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for a --kv-cache-dtype value: "fp8" is float8_e4m3fn, "auto" the model's dtype."""
    return torch.float8_e4m3fn if name == "fp8" else dtype


def bytes_per_block(layers: list[Attention], block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block across all layers (this rank's heads)."""
    per_token = sum(2 * a.num_kv_heads * a.head_dim for a in layers)
    return per_token * block_size * dtype.itemsize


def cpu_num_blocks(cache_gib: float, block_bytes: int) -> int:
    num_blocks = int(cache_gib * (1 << 30)) // block_bytes
    if num_blocks < 1:
        raise ValueError(f"cpu_kv_cache_gib={cache_gib} holds no KV block of {block_bytes} bytes")
    return num_blocks


def available_memory(device: torch.device) -> int:
    """Bytes a new tensor can take on device now: the GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_num_blocks(num_blocks: int, block_bytes: int, device: torch.device, asked: str) -> None:
    """ValueError when num_blocks blocks (what ``asked`` gave) do not fit in the device's memory now,
    instead of an out-of-memory error (or the host's OOM killer) once the model is loaded."""
    need, free = num_blocks * block_bytes, available_memory(device)
    if need > free:
        where = "the GPU has" if device.type == "cuda" else "the host has"
        raise ValueError(f"{asked} asks for {num_blocks} KV blocks, {need / 2**30:.1f} GiB at {block_bytes} bytes "
                         f"a block; {where} {free / 2**30:.1f} GiB free after the weights: at most "
                         f"{free // block_bytes} blocks fit")


def allocate_kv_cache(layers: list[Attention], num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """Allocate the cache and bind each layer's views; returns the backing tensor."""
    first = layers[0]
    assert all((a.num_kv_heads, a.head_dim) == (first.num_kv_heads, first.head_dim) for a in layers), (
        "all layers must share kv_heads and head_dim")
    kv = torch.zeros(2, len(layers), num_blocks, block_size, first.num_kv_heads, first.head_dim,
                     dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        layer.bind_kv_cache(kv[0, i], kv[1, i])
    return kv


def _profile_metadata(num_tokens: int, max_seq_len: int, block_size: int, device: torch.device) -> AttentionMetadata:
    lens = [min(max_seq_len, num_tokens - start) for start in range(0, num_tokens, max_seq_len)]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    as_tensor = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int32)).to(device)  # noqa: E731
    return AttentionMetadata(
        cu_seqlens_q=as_tensor(cu), cu_seqlens_k=as_tensor(cu), context_lens=as_tensor(lens),
        max_seqlen_q=max(lens), max_seqlen_k=max(lens),
        slot_mapping=as_tensor(np.full(num_tokens, -1)),
        block_tables=as_tensor(np.zeros((len(lens), -(-max(lens) // block_size)))),
        query_lens_host=lens, context_lens_host=lens)


@torch.inference_mode()
def cuda_num_blocks(model: DecoderForCausalLM, block_size: int, kv_dtype: torch.dtype, device: torch.device,
                    num_tokens: int, max_seq_len: int, num_logit_rows: int, utilization: float) -> int:
    """KV blocks of ``kv_dtype`` that fit in ``utilization`` of the GPU after weights and a peak-sized warm-up."""
    layers = model.attention_layers()
    allocate_kv_cache(layers, 1, block_size, kv_dtype, device)  # scratch: slots are -1, block 0 is read only
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    metadata = _profile_metadata(num_tokens, max_seq_len, block_size, device)
    # int32 inputs, as real steps have: a warm-up in int64 would compile kernels serving never uses.
    input_ids = torch.zeros(num_tokens, dtype=torch.int32, device=device)
    positions = torch.cat([torch.arange(n, dtype=torch.int32, device=device) for n in metadata.query_lens_host])
    hidden = model(input_ids, positions, metadata)
    model.compute_logits(hidden[:num_logit_rows])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    used_outside_torch = total - free - torch.cuda.memory_reserved(device)
    budget = int(total * utilization) - peak - used_outside_torch
    num_blocks = budget // bytes_per_block(layers, block_size, kv_dtype)
    if num_blocks < 1:
        raise ValueError(f"no room for KV blocks: peak {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB; "
                         "raise gpu_memory_utilization or lower max_num_batched_tokens")
    return int(num_blocks)
